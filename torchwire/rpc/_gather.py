"""torch's private RPC collectives (``_all_gather``, ``_barrier``, ``_wait_all_workers``).

Programs and torch's own tests use them.  The worker with the smallest name
leads: every other worker sends it its object; once it has them all it sends
the whole map back to each.  Rounds over the same set of workers are told apart
by a per-set sequence number, so consecutive gathers never mix.
"""

from __future__ import annotations

import logging
import threading

from .._base import threads as _threads
from .._base.options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

log = logging.getLogger("torchwire")

_lock = threading.Lock()
_sequence: dict[str, int] = {}


class _Round:
    __slots__ = ("objects", "done")

    def __init__(self) -> None:
        self.objects: dict = {}
        self.done = threading.Event()


_rounds: dict[str, _Round] = {}


def _round(seq_id: str) -> _Round:
    with _lock:
        r = _rounds.get(seq_id)
        if r is None:
            r = _rounds[seq_id] = _Round()
        return r


def _gather_to_leader(seq_id: str, name: str, obj, names) -> None:
    r = _round(seq_id)
    with _lock:
        if name in r.objects:
            raise AssertionError(f"{name} reported intent sequence id {seq_id} twice.")
        r.objects[name] = obj
        if set(names) == set(r.objects):
            r.done.set()


def _broadcast_to_followers(seq_id: str, objects: dict) -> None:
    r = _round(seq_id)
    if r.done.is_set():
        raise AssertionError(f"Termination signal sequence id {seq_id} got set twice.")
    r.objects = objects
    r.done.set()


def _all_gather(obj, worker_names=None, timeout: float = UNSET_RPC_TIMEOUT) -> dict:
    """Gather ``obj`` from every worker in ``worker_names`` (default: all) on all of them.

    Returns:
        ``{worker name: obj}``.

    Raises:
        RuntimeError: a worker did not take part within ``timeout`` seconds (-1: the
            RPC timeout, 0: no limit).
    """
    from . import api
    agent = api._require_agent()
    names = set(worker_names) if worker_names else {i.name for i in agent.get_worker_infos()}
    leader = min(names)
    me = agent.info.name
    key = "".join(sorted(names))
    with _lock:
        n = _sequence.get(key, 0)
        _sequence[key] = n + 1
    seq_id = f"{key}{n}"
    if timeout == UNSET_RPC_TIMEOUT:
        rpc_timeout, wait_for = agent.rpc_timeout, None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, wait_for = 0, None
    else:
        rpc_timeout = wait_for = float(timeout)
    if me == leader:
        _gather_to_leader(seq_id, me, obj, names)
    else:
        api.rpc_sync(leader, _gather_to_leader, args=(seq_id, me, obj, names),
                     timeout=rpc_timeout)
    r = _round(seq_id)
    if not _wait(r.done, wait_for, agent):
        with _lock:
            _rounds.pop(seq_id, None)
            missing = sorted(names - set(r.objects)) if me == leader else [leader]
        raise RuntimeError(f"timed out in _all_gather after {wait_for:.2f} seconds waiting "
                           f"for {', '.join(missing)}")
    if me == leader:
        futs = {f: api.rpc_async(f, _broadcast_to_followers, args=(seq_id, r.objects),
                                 timeout=rpc_timeout) for f in sorted(names - {leader})}
        errors = []
        for follower, fut in futs.items():
            try:
                fut.wait()
            except RuntimeError as exc:
                errors.append((follower, exc))
        if errors:
            with _lock:
                _rounds.pop(seq_id, None)
            raise RuntimeError(f"Followers {[e[0] for e in errors]} timed out in _all_gather "
                               f"after {rpc_timeout:.2f} seconds. The first exception is "
                               f"{errors[0][1]}")
    with _lock:
        _rounds.pop(seq_id, None)
    return r.objects


def _wait(event: threading.Event, timeout: float | None, agent) -> bool:
    """Wait for ``event``; without a timeout, as long as the agent runs."""
    if not event.is_set():
        _threads.before_blocking()
    if timeout is not None:
        return event.wait(timeout)
    from .._agent import AgentState
    while not event.wait(0.5):
        if agent.state is AgentState.CLOSED:
            return False
    return True


def _barrier(worker_names) -> None:
    """Block until every worker in ``worker_names`` has reached this call."""
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError:
        log.exception("torchwire: _barrier failed")


def _wait_all_workers(timeout=DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker has reached this call (torch's pre-shutdown barrier)."""
    _all_gather(None, timeout=timeout)


def _reset() -> None:
    """Forget sequence numbers (a new job in this process starts from 0 again)."""
    with _lock:
        _sequence.clear()
        _rounds.clear()

