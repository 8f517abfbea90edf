"""Graceful shutdown of a static group: termination detection through the store.

::

    DRAINING:  round r = 0, 1, ...
                 settle: wait until this worker has no pending outgoing call and no
                   plug-in has control messages to send
                 publish "sd/<r>/<rank>" = requests sent, requests received
                   (and, once some worker is down, the counts per peer)
                 wait for every rank's round-r record, except from ranks that are
                   gone (down, found dead, or already left: "sd/exit/<rank>" set)
                 after round 0 every worker has arrived: the plug-ins hear it
                   (RRefs: delete every user RRef, as torch does)
                 stop when totals balance (sent == received) and equal the previous
                 round's: no request is in flight or being served (with ranks gone:
                 per pair of workers that reach each other)
    EXIT:      set "sd/exit/<rank>"; rank 0 (which may host the store) waits until
               every rank that is not gone has, then all close their sockets.

While waiting, workers that have not reported are checked for life every
``_LIVENESS_PERIOD``: a dead one ends the wait instead of a hang.
"""

from __future__ import annotations

import itertools
import logging
import time

from .._base.errors import RpcStateError, RpcTimeoutError, WorkerUnavailableError
from .._wire.listener import listener_alive

log = logging.getLogger("torchwire")

_LIVENESS_PERIOD = 1.0  # seconds between liveness checks while shutdown waits


class Termination:
    """The shutdown rounds of one agent (see the module docstring)."""

    def __init__(self, agent) -> None:
        self._agent = agent

    def __repr__(self) -> str:
        return f"<Termination of {self._agent.name}>"

    def drain(self, deadline: float) -> None:
        """Run the rounds until the job is quiet, then the exit barrier.

        Raises:
            RpcTimeoutError: ``deadline`` passed, or the store is gone.
        """
        agent = self._agent
        store, world = agent.store, agent.world_size
        previous = None
        full = False  # publish per-peer counts (some worker is gone or cut off)
        for r in itertools.count():
            agent.settle(deadline)
            keys = [f"sd/{r}/{k}" for k in range(world)]
            try:
                store.set(keys[agent.rank], self._record(full))
            except Exception as exc:
                raise self._store_gone(exc) from exc
            records = {k: v.decode() for k, v in self._gather(keys, deadline).items()}
            balanced = _balanced(records, world)
            if balanced is None:
                full = True
            state = sorted(records.items())
            if balanced and state == previous:
                break
            if r == 0:
                agent.all_arrived()
            previous = state
        # Exit barrier: rank 0 may host the store, so it leaves last.
        store.set(f"sd/exit/{agent.rank}", "1")
        if agent.rank == 0:
            self._gather([f"sd/exit/{k}" for k in range(world)], deadline)
        gone = sorted(set(range(world)) - set(records))
        if gone:
            names = ", ".join(agent.names.name_of(k) for k in gone)
            log.warning("torchwire: %s shut down gracefully without worker(s) %s (gone or "
                        "cut off)", agent.name, names)

    def _record(self, full: bool) -> str:
        """This worker's round record (``Counters.shutdown_record``).

        A peer that was down and came back stays listed: what was in flight to it
        when the link broke is lost, so that pair's counts can never balance; only
        the calls still pending (on both sides) guard its traffic then.
        """
        health = self._agent.health
        down = sorted(set(health.down()) | health.ever_down)
        return self._agent.counters.shutdown_record(full, down)

    def _store_gone(self, exc: BaseException) -> RpcTimeoutError:
        return RpcTimeoutError(f"graceful shutdown of {self._agent.name} failed: the "
                               f"rendezvous store is gone ({exc})")

    def _gather(self, keys: list[str], deadline: float) -> dict[int, bytes]:
        """Wait for one key per rank, except from ranks that are gone; between waits,
        check that missing ranks are alive.

        Returns:
            ``{rank: value}`` for the ranks that are not gone.

        Raises:
            RpcTimeoutError: ``deadline`` passed or the store is gone.
        """
        agent = self._agent
        store, health = agent.store, agent.health
        next_probe = time.monotonic() + _LIVENESS_PERIOD
        delay = 0.001
        while True:
            try:
                missing = [k for k, key in enumerate(keys) if not store.check([key])]
                waiting = [k for k in missing if not health.is_down(k)
                           and not store.check([f"sd/exit/{k}"])]
                if not waiting:
                    present = [k for k in range(len(keys)) if k not in missing]
                    return dict(zip(present, store.multi_get([keys[k] for k in present])))
            except Exception as exc:
                raise self._store_gone(exc) from exc
            now = time.monotonic()
            if now >= deadline:
                names = ", ".join(agent.names.name_of(k) for k in waiting)
                raise RpcTimeoutError(
                    f"graceful shutdown of {agent.name} timed out waiting for the other "
                    f"workers to call shutdown() (still waiting for {names})")
            if now >= next_probe:
                for k in waiting:
                    if k != agent.rank:
                        self._alive(k)  # marks it down if it is not
                next_probe = time.monotonic() + _LIVENESS_PERIOD
                continue
            # Polling the store (rather than store.wait) keeps torch's C++ layer from
            # logging a timeout warning on every liveness period.
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.02)

    def _alive(self, rank: int) -> bool:
        """Shutdown waits for ``rank``: is it alive?  With the heartbeat on, a connection
        to it settles that (a frozen peer falls silent on it); else a dead listener."""
        agent = self._agent
        if agent.health.is_down(rank):
            return False
        if agent.health.timeout > 0:
            try:
                agent.links.connection_to(rank)
            except (WorkerUnavailableError, RpcStateError):
                return False
            return True
        member = agent.names.member(rank)
        if member is None:
            return True
        rec = member.record
        if listener_alive(rec.tcp, rec.unix if rec.host == agent.host else None):
            return True
        agent.peer_lost(rank, "its listener refused the connection (the process is gone)",
                        dead=True)
        return False


def _balanced(records: dict[int, str], world: int) -> bool | None:
    """Do the shutdown records show every request received?  None: cannot tell yet
    (a worker is gone and some record lacks per-peer counts: publish them).

    With every worker there and none down, the totals must balance.  Otherwise
    each pair of workers that still reach each other must: what i sent to j is
    what j received from i; traffic with the gone and the cut off is left out.
    """
    parsed = {}
    for k, v in records.items():
        parts = v.split(";")
        sent, recv = (int(x) for x in parts[0].split(","))
        if len(parts) == 1:
            parsed[k] = (sent, recv, None, frozenset())
        else:
            vec = [tuple(int(x) for x in p.split(":")) for p in parts[1].split()]
            down = frozenset(int(x) for x in parts[2].split(",") if x)
            parsed[k] = (sent, recv, vec, down)
    if len(parsed) == world and not any(p[3] for p in parsed.values()):
        return sum(p[0] for p in parsed.values()) == sum(p[1] for p in parsed.values())
    if any(p[2] is None for p in parsed.values()):
        return None
    for i, (_s, _r, vec_i, down_i) in parsed.items():
        for j, (_s, _r, vec_j, down_j) in parsed.items():
            if j not in down_i and i not in down_j and vec_i[j][0] != vec_j[i][1]:
                return False
    return True
