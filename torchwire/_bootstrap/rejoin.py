"""Rejoin: a restarted worker takes its rank back in a running static group.

A process that calls ``init_rpc(name, rank=r, world_size=n)`` against the store
of a running job finds ``rank/<r>`` already claimed (``rendezvous.join``, step 1).
It is then either a second process claiming a live worker's rank (refused) or
the next *incarnation* of a worker that died (admitted)::

    1. wait for "worker/<r>" (the record of the rank's holder), init timeout
    2. its name differs from ours               -> refused: a rank keeps its name
    3. its listener accepts connections         -> refused: the holder is alive
    4. compare_set("worker/<r>", its record, ours with incarnation + 1)
                                                -> lost the race: refused
    5. the join goes on as a first join does (wait for every record, check them);
       "job" is left as it is: the restarted worker reads the job token
    6. once serving, call _rejoined(our record) on every other rank, in parallel

Each worker that hears of the new incarnation, through ``_rejoined`` or through a
connection from it (:class:`StaticAdmission`, which reads "worker/<r>" when a
connection arrives), replaces the rank's member (``RpcAgent.add_member``): the old
incarnation's links are retired, calls pending on it fail with
``WorkerUnavailableError`` saying it restarted, and the plug-ins forget it (its
RRefs, its forks, its autograd contexts).  Nothing else restarts.

Rank 0 of ``tcp://``/``env://`` hosts the store: when it dies the store dies
with it and no rank can rejoin (the others' stores fail; see docs).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta

from .._agent.runtime import current
from .._base.errors import RendezvousError, RpcStateError, WorkerUnavailableError
from .._base.worker_record import WorkerRecord
from .._wire.listener import host_identity, listener_alive

log = logging.getLogger("torchwire")


def take_over(store, rank: int, record: dict, deadline: float) -> None:
    """Steps 1-4: make this process rank ``rank``'s next incarnation; sets
    ``record["incarnation"]`` and publishes ``record`` as ``worker/<rank>``.

    Raises:
        RendezvousError: the holder never published itself, has another name, is
            alive, or another process took its place first; the store failed.
    """
    key = f"worker/{rank}"
    try:
        store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        old_raw = store.get(key).decode()
    except Exception as exc:
        raise RendezvousError(
            f"rank {rank} is already taken by another process in this job (two workers "
            f"were started with rank={rank}), which did not publish itself in time") from exc
    old = json.loads(old_raw)
    if old.get("name") != record["name"]:
        raise RendezvousError(
            f"rank {rank} is already taken by worker {old.get('name')!r} of this job; a "
            f"restarted worker rejoins under its own name and rank, and {record['name']!r} "
            f"is not rank {rank}'s name")
    if record_alive(old, max(0.05, min(2.0, deadline - time.monotonic()))):
        raise RendezvousError(
            f"rank {rank} is already taken by worker {old['name']!r} (pid {old.get('pid')}), "
            "which is alive: only a worker whose process is gone can be replaced (stop the "
            "running one first, or give this process another rank)")
    record["incarnation"] = int(old.get("incarnation", 0)) + 1
    new_raw = json.dumps(record)
    try:
        found = store.compare_set(key, old_raw, new_raw).decode()
    except Exception as exc:
        raise RendezvousError(f"rendezvous store failed: {exc}") from exc
    if found != new_raw:
        raise RendezvousError(
            f"another process took the place of worker {old['name']!r} (rank {rank}) at the "
            "same time; it rejoined instead of this one")
    if old.get("pid") == os.getpid() and old.get("host") == host_identity():
        # this process's own init_rpc failed before anyone else joined (sessions.py)
        log.info("torchwire: %s takes rank %d again after its failed init_rpc (incarnation "
                 "%d)", record["name"], rank, record["incarnation"])
        return
    log.warning("torchwire: %s rejoins the job as rank %d (incarnation %d; the process of "
                "incarnation %d, pid %s, is gone)", record["name"], rank,
                record["incarnation"], record["incarnation"] - 1, old.get("pid"))


def record_alive(record: dict, timeout: float) -> bool:
    """Is the worker of rendezvous ``record`` still there?  (Its listener, through its
    Unix socket when on this host; see ``listener_alive``.)"""
    unix = record.get("unix") if record.get("host") == host_identity() else None
    return listener_alive(tuple(record["tcp"]), unix, timeout)


def announce(agent, record: dict, deadline: float) -> None:
    """Step 6: tell every other rank of this incarnation (bounded by ``deadline``).
    A rank that cannot be reached learns of it when a connection from us arrives."""
    timeout = max(0.001, deadline - time.monotonic())
    calls = [(info, agent.call(info, _rejoined, (record,), None, timeout))
             for info in agent.get_worker_infos() if info.id != agent.rank]
    for info, fut in calls:
        try:
            fut.wait()
        except (WorkerUnavailableError, RpcStateError) as exc:
            log.info("torchwire: %s could not tell %s that it rejoined: %s", agent.name,
                     info.name, exc)
        except Exception as exc:
            log.warning("torchwire: %s could not tell %s that it rejoined: %s", agent.name,
                        info.name, exc)


def _rejoined(record: dict) -> None:
    """Runs on every other rank when ``record``'s worker rejoins (step 6)."""
    rt = current.runtime
    if rt is None or rt.agent.closed:
        raise RpcStateError("this worker is not serving")
    rt.agent.add_member(WorkerRecord.from_json(record))


class StaticAdmission:
    """The agent's admission of connections in a static group: a connection from a
    rank whose record in the store is not the one known here comes from its next
    incarnation (it rejoined), which replaces the old one.

    Args:
        store: the prefixed rendezvous store.
        agent: the agent it admits connections for.
    """

    def __init__(self, store, agent) -> None:
        self._store = store
        self._agent = agent

    def __repr__(self) -> str:
        return f"<StaticAdmission of {self._agent.name}>"

    def admit(self, rank: int, known):
        """Handshake thread: the member a connection from ``rank`` comes from."""
        if known is None:
            return None
        try:
            raw = self._store.get(f"worker/{rank}")
            record = WorkerRecord.from_json(json.loads(raw))
        except Exception as exc:  # the store is gone (rank 0 died): keep what we know
            log.debug("torchwire: reading the record of rank %d failed: %s", rank, exc)
            return known
        if record == known.record or record.incarnation < known.record.incarnation:
            return known
        return self._agent.add_member(record)


__all__ = ["StaticAdmission", "announce", "record_alive", "take_over"]
