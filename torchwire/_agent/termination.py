"""Graceful shutdown of a static group: termination detection through the store.

::

    DRAINING:  round r = 0, 1, ...
                 settle: wait until this worker has no pending outgoing call and no
                   plug-in has control messages to send
                 publish "sd/<r>/<rank>" = requests sent, requests received
                   (and, once some worker is down, the counts per peer)
                 wait for every rank's round-r record, except from ranks that have
                   left ("sd/exit/<rank>" set) or that this shutdown gave up on
                   (proved dead, or a liveness probe could not reach them)
                 after round 0 every worker has arrived: the plug-ins hear it
                   (RRefs: delete every user RRef, as torch does)
                 stop when totals balance (sent == received) and equal the previous
                 round's: no request is in flight or being served (with ranks given
                 up on: per pair of workers that reach each other)
    EXIT:      set "sd/over" (the job is over: an init_rpc on this store now starts a
               new session), then "sd/exit/<rank>"; rank 0 (which may host the
               store) waits until every rank that was not given up on has, then all
               close their sockets.
               A warning names the ranks that did not take part: no exit key, and
               proved dead or no record at all (died, or could not be reached
               through the whole shutdown).  A rank that published a record or its
               exit key is not gone.

Waiting is cheap for the store's host: every shutdown key is counted in ``sd/n`` as it
is set, and a waiting worker reads that one counter per poll (every 20 ms at most, every
100 ms once it has waited 2 s); it reads the keys themselves only when the counter
moved (or a probe ran, or a rank was given up on).  Reading every rank's key on every
poll made each of N waiting workers send the store about N requests every 20 ms, all
served by rank 0's process, the one that usually still has work to do.

A rank merely *down* on the links (a heartbeat that went late, a connect that timed
out under load, a partition that has healed) is not given up on: it may well be
publishing its records.  While waiting, every rank that has not reported is probed
every ``_LIVENESS_PERIOD`` (one that is down at once, for ``_DOWN_PROBE`` at most): a
probe that reaches it clears it; one that proves it dead, or cannot reach it within
its bound (``handshake_timeout``, or the shutdown's deadline if sooner), ends the wait
for it instead of a hang.  Every wait ends at the deadline; with none (``timeout=0``)
a dead or frozen rank still ends it, through the probes.
"""

from __future__ import annotations

import itertools
import logging
import time

from .._base.errors import RpcStateError, RpcTimeoutError, WorkerUnavailableError
from .._wire.listener import listener_alive
from .liveness import PeerState

log = logging.getLogger("torchwire")

_LIVENESS_PERIOD = 1.0  # seconds between liveness checks while shutdown waits
# Seconds a probe of a peer that is down may take: enough to reach it over a healed
# link, short, since a frozen peer costs every graceful shutdown this much.
_DOWN_PROBE = 0.5
_COUNT_KEY = "sd/n"  # shutdown keys set so far (any round, exit keys too)
# Set by every worker that reaches the exit barrier: the job is over, and a process
# that joins this store now starts a new one (torchwire/_bootstrap/sessions.py).
OVER_KEY = "sd/over"
# Seconds between polls of that count: at most _POLL_MAX, and _LONG_POLL_MAX once a
# wait has lasted _LONG_WAIT (a worker that waits that long is waiting for another's
# work to end, not for the next round).
_POLL_MAX, _LONG_POLL_MAX, _LONG_WAIT = 0.02, 0.1, 2.0


class Termination:
    """The shutdown rounds of one agent (see the module docstring)."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self._unreachable: set[int] = set()  # ranks the last probe could not reach
        self._next_probe: dict[int, float] = {}  # rank -> when to probe it again

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
                publish(store, keys[agent.rank], self._record(full))
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
        try:
            store.set(OVER_KEY, "1")
            publish(store, f"sd/exit/{agent.rank}", "1")
            if agent.rank == 0:
                self._gather([f"sd/exit/{k}" for k in range(world)], deadline)
            gone = self._absent(records)
        except RpcTimeoutError:
            raise
        except Exception as exc:
            raise self._store_gone(exc) from exc
        if gone:
            names = ", ".join(agent.names.name_of(k) for k in gone)
            log.warning("torchwire: %s shut down gracefully without worker(s) %s (gone or "
                        "cut off)", agent.name, names)

    def _absent(self, records: dict[int, str]) -> list[int]:
        """The ranks that did not take part in this shutdown: missing from the last
        round gathered, without an exit key, and either proved dead or without any
        record.  The others missing left after deciding at another round (views differ
        once a rank is given up on), or took part but were cut off from this worker."""
        agent = self._agent
        store, health = agent.store, agent.health
        gone = []
        for k in range(agent.world_size):
            if k in records or store.check([f"sd/exit/{k}"]):
                continue
            if health.state(k) is PeerState.DEAD or not store.check([f"sd/0/{k}"]):
                gone.append(k)
            else:
                log.info("torchwire: %s shut down before %s, which took part but could not "
                         "be reached to the end", agent.name, agent.names.name_of(k))
        return gone

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
        """Wait for one key per rank, except from ranks that left or that this shutdown
        gave up on; between waits, probe the missing ranks (module docstring).

        Returns:
            ``{rank: value}`` for the ranks whose key is there.

        Raises:
            RpcTimeoutError: ``deadline`` passed or the store is gone.
        """
        agent = self._agent
        store, health, me = agent.store, agent.health, agent.rank
        start = time.monotonic()
        delay = 0.001
        seen = None  # the key counter at the last full read
        waiting: list[int] = []
        try:
            # Created if missing, once: the polls read it with get(), which blocks on a
            # missing key and, unlike add(), writes nothing (a FileStore appends
            # every write to its file).
            store.add(_COUNT_KEY, 0)
        except Exception as exc:
            raise self._store_gone(exc) from exc
        while True:
            try:
                count = store.get(_COUNT_KEY)
                waiting = [k for k in waiting if not self._given_up(k)]
                if count != seen or not waiting:
                    seen = count
                    missing = [k for k, key in enumerate(keys) if not store.check([key])]
                    # A rank sets its exit key after its last record: read the record
                    # again when the exit key is there, else one set in between would
                    # be missed.
                    left = [k for k in missing if store.check([f"sd/exit/{k}"])]
                    late = {k for k in left if store.check([keys[k]])}
                    missing = [k for k in missing if k not in late]
                    waiting = [k for k in missing if k not in left and not self._given_up(k)]
                    if not waiting:
                        present = [k for k in range(len(keys)) if k not in missing]
                        return dict(zip(present,
                                        store.multi_get([keys[k] for k in present])))
            except Exception as exc:
                raise self._store_gone(exc) from exc
            now = time.monotonic()
            if now >= deadline:
                names = ", ".join(agent.names.name_of(k) for k in waiting)
                raise RpcTimeoutError(
                    f"graceful shutdown of {agent.name} timed out waiting for the other "
                    f"workers to call shutdown() (still waiting for {names})")
            # A rank down on the links is probed at once: it may have come back.
            due = [k for k in waiting if k != me and now >= self._next_probe.get(
                k, now if health.is_down(k) else start + _LIVENESS_PERIOD)]
            if due:
                for k in due:
                    # Probes take time: one that reported meanwhile (and maybe closed
                    # its listener on leaving) must not be probed, nor reported lost.
                    try:
                        if store.check([keys[k]]) or store.check([f"sd/exit/{k}"]):
                            continue
                    except Exception as exc:
                        raise self._store_gone(exc) from exc
                    self._probe(k, deadline)
                seen = None  # read the keys again: a probe takes time
                continue
            # Polling the store (rather than store.wait) keeps torch's C++ layer from
            # logging a timeout warning on every liveness period.
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, _POLL_MAX if now - start < _LONG_WAIT else _LONG_POLL_MAX)

    def _given_up(self, rank: int) -> bool:
        """Has this shutdown stopped waiting for ``rank``: proved dead, or the last
        probe could not reach it?  Merely down on the links is not enough."""
        return (rank in self._unreachable
                or self._agent.health.state(rank) is PeerState.DEAD)

    def _probe(self, rank: int, deadline: float) -> None:
        """Probe ``rank`` now and schedule its next probe."""
        if self._alive(rank, deadline):
            self._unreachable.discard(rank)
        else:
            self._unreachable.add(rank)
        self._next_probe[rank] = time.monotonic() + _LIVENESS_PERIOD

    def _alive(self, rank: int, deadline: float) -> bool:
        """Shutdown waits for ``rank``: can it be reached?  With the heartbeat on, a
        connection to it settles that (a frozen peer fails the handshake or falls
        silent on it); one that is down is dialled again, briefly (``_DOWN_PROBE``): a
        healed link counts.  Without the heartbeat, a listener that still accepts."""
        agent = self._agent
        health = agent.health
        if health.state(rank) is PeerState.DEAD:
            return False
        if health.timeout > 0:
            limit = deadline
            if health.is_down(rank):
                limit = min(deadline, time.monotonic() + _DOWN_PROBE)
            try:
                if limit == float("inf"):
                    agent.links.connection_to(rank)  # bounded by handshake_timeout
                else:
                    agent.links.connection_to(rank, deadline=limit)
            except RpcTimeoutError:
                return limit >= deadline  # the shutdown's own deadline: its wait ends
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
                        dead=True, member=member)
        return False


def publish(store, key: str, value: str) -> None:
    """Set shutdown key ``key``, then count it: waiting workers poll the count alone
    (:meth:`Termination._gather`)."""
    store.set(key, value)
    store.add(_COUNT_KEY, 1)


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
