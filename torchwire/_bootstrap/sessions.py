"""Sessions: ``init_rpc`` again, after ``shutdown()``, on the same store.

Rank 0's process keeps the rendezvous store it hosts as long as it lives (the other
ranks may still read it when its own ``shutdown()`` returns), so a second
``init_rpc`` on the same ``init_method`` finds the first session's keys there.  As
with torch, that second ``init_rpc`` must start a new job.  Each session, of a
static or a dynamic group, keeps its keys under a prefix of its own: the first
session under the store's prefix itself (what a running job and its restarted
workers use), session ``n`` under ``session_<n>``.  The store's ``session`` key
holds the current one (absent: 0).

Rank 0 starts each new session; the other ranks wait for it::

    rank 0:  n = session; if this process took part in session n on this store,
             or session n is over ("sd/over" set: a worker reached the exit barrier
             of its graceful shutdown), or abandoned (this rank was taken there,
             some other worker published itself there, and every one that did
             is gone: its listener refuses), set session = n + 1 and join that
    rank k:  wait (init deadline) until session names one this process has not
             taken part in, not over and not abandoned; join it

A process that took part in a dynamic group's session is done with it too; a dynamic
member starts the next session itself when the current one holds a static group that
is over or was this process's (``enter_dynamic``).  A worker of either kind that
finds a session of the other kind that it may not move past is refused, as before:
a dynamic member moves past a static session only when it is over (a graceful
shutdown) or was this process's, and a static rank 0 past a dynamic one only when
it was this process's.  A rank 0 whose ``init_rpc`` failed before any
other worker published itself finds its session not abandoned: it goes back into
it and takes its own rank over (``rejoin.py``).  Sessions move on by
compare-and-set, so two workers that start one at once start the same.

A worker that waits on a store whose host then leaves opens the store again (a rank 0
started afresh serves a new one on the same address) within its init deadline.

A worker restarted into a running session (``rejoin.py``) finds it neither taken
part in (a new process) nor over, and joins it as before.  What a process took part
in is remembered per store *instance*: the first worker to use a store gives it a
random ``store_id``, so a rank 0 started afresh (a new store on the same port) starts
at session 0 again, and the others join it.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import torch.distributed as dist

from .._agent.termination import OVER_KEY
from .._base.errors import RendezvousError
from .rejoin import record_alive

class StoreLost(RendezvousError):
    """The store failed while a worker waited for its next session: its host left
    (rank 0 started afresh makes a new store on the same address)."""


_KEY = "session"
_PROBE_S = 0.5  # the longest probe of a listener that does not answer
_lock = threading.Lock()
_joined: dict[str, int] = {}  # store_id -> the last session this process joined there


def _prefixed(store, n: int):
    return store if n == 0 else dist.PrefixStore(f"session_{n}", store)


def _current(store) -> int:
    return int(store.get(_KEY)) if store.check([_KEY]) else 0


def _over(store, n: int, store_id: str) -> bool:
    with _lock:
        joined = _joined.get(store_id, -1)
    return joined >= n or _prefixed(store, n).check([OVER_KEY])


def _abandoned(store, n: int, rank: int, world_size: int) -> bool:
    """Session ``n`` is left by everyone: this rank was taken there before, some other
    worker published itself there, and every one that did is gone (its listener
    refuses).  A job
    that ended without a graceful shutdown leaves no ``sd/over``; a worker restarted
    into a running one finds some other worker alive."""
    session = _prefixed(store, n)
    if not session.check([f"rank/{rank}"]):
        return False
    keys = [f"worker/{k}" for k in range(world_size) if k != rank]
    present = [k for k in keys if session.check([k])]
    if not present:
        return False
    return not any(record_alive(json.loads(raw), _PROBE_S)
                   for raw in session.multi_get(present))


def enter(store, rank: int, world_size: int, deadline: float):
    """Which session of ``store`` this worker joins (see the module docstring).

    Args:
        store: the rendezvous store (prefixed).
        rank: this worker's rank; rank 0 starts new sessions.
        world_size: the size of the group it joins.
        deadline: ``time.monotonic()`` by which the session must be known.

    Returns:
        ``(session_store, (store_id, n))``: the store prefixed for session ``n``, and
        what :func:`joined` records once the join succeeded.

    Raises:
        StoreLost: the store failed (its host may have left: open it again).
        RendezvousError: rank 0 did not start a new session in time.
    """
    def done_with(n: int) -> bool:
        return _over(store, n, store_id) or _abandoned(store, n, rank, world_size)

    try:
        store_id = store.compare_set("store_id", "", secrets.token_hex(8)).decode()
        n = _current(store)
        if rank == 0:
            while done_with(n):
                n = _next(store, n)
            return _prefixed(store, n), (store_id, n)
        delay = 0.005
        while done_with(n):
            if time.monotonic() + delay >= deadline:
                raise RendezvousError(
                    f"rank 0 did not start a new RPC session on this rendezvous store within "
                    f"the init timeout: session {n} there is over or was this process's "
                    "(start rank 0's init_rpc too, with the same init_method)")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
            n = _current(store)
    except RendezvousError:
        raise
    except Exception as exc:
        raise StoreLost(f"rendezvous store failed: {exc}") from exc
    return _prefixed(store, n), (store_id, n)


def enter_dynamic(store, deadline: float):
    """:func:`enter` for a member of a dynamic group: the current session, unless it
    is a static group's that is over or was this process's; then the next, which any
    member may start.  (A dynamic group's own session goes on as members come and go.)

    Raises:
        StoreLost: the store failed.
    """
    try:
        store_id = store.compare_set("store_id", "", secrets.token_hex(8)).decode()
        n = _current(store)
        while _kind(store, n) == "static" and _over(store, n, store_id):
            if time.monotonic() >= deadline:
                raise RendezvousError("the rendezvous store's sessions moved on past the "
                                      "init timeout")
            n = _next(store, n)
    except RendezvousError:
        raise
    except Exception as exc:
        raise StoreLost(f"rendezvous store failed: {exc}") from exc
    return _prefixed(store, n), (store_id, n)


def _kind(store, n: int) -> str | None:
    """"static" or "dynamic": the kind of group session ``n`` holds (None: none yet)."""
    session = _prefixed(store, n)
    return session.get("group").decode() if session.check(["group"]) else None


def _next(store, n: int) -> int:
    """Start session ``n + 1``, unless a worker already moved the store past ``n``;
    the session current now."""
    found = store.compare_set(_KEY, str(n) if n else "", str(n + 1)).decode()
    return int(found) if found else 0


def joined(session: tuple[str, int]) -> None:
    """This process took part in ``session`` (what :func:`enter` returned)."""
    store_id, n = session
    with _lock:
        _joined[store_id] = n
