"""torch's private RPC collectives (``_all_gather``, ``_barrier``, ``_wait_all_workers``).

Programs and torch's own tests use them.  The worker with the smallest name
leads: every other worker sends it its object; once it has them all it sends
the whole map back to each.  Rounds over the same set of workers are told apart
by a per-set sequence number, so consecutive gathers never mix.  The rounds and
sequence numbers belong to the runtime (a new job in this process starts from 0).
"""

from __future__ import annotations

import logging
import threading

from .._agent.invoke import invoke_async, invoke_sync
from .._agent.runtime import current, require_agent
from .._base import threads
from .._base.errors import RpcTimeoutError, not_initialized
from .._base.options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

log = logging.getLogger("torchwire")


class AllGatherStates:
    """One gather round (torch's name and fields): the objects gathered so far, and the
    event set once every worker's is in."""

    __slots__ = ("gathered_objects", "proceed_signal")

    def __init__(self) -> None:
        self.gathered_objects: dict = {}
        self.proceed_signal = threading.Event()

    def __repr__(self) -> str:
        return (f"<AllGatherStates gathered={len(self.gathered_objects)} "
                f"done={self.proceed_signal.is_set()}>")


class Collectives:
    """The collectives' state in one runtime: rounds in progress, sequence numbers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequence: dict[str, int] = {}
        self.rounds: dict[str, AllGatherStates] = {}

    def __repr__(self) -> str:
        return f"<Collectives rounds={len(self.rounds)} sets={len(self.sequence)}>"

    def round(self, seq_id: str) -> AllGatherStates:
        with self.lock:
            r = self.rounds.get(seq_id)
            if r is None:
                r = self.rounds[seq_id] = AllGatherStates()
            return r

    def next_id(self, key: str) -> str:
        with self.lock:
            n = self.sequence.get(key, 0)
            self.sequence[key] = n + 1
        return f"{key}{n}"

    def forget(self, seq_id: str) -> None:
        with self.lock:
            self.rounds.pop(seq_id, None)


def _state() -> Collectives:
    rt = current.runtime
    if rt is None:
        raise not_initialized()
    return rt.collectives


def _gather_to_leader(seq_id: str, name: str, obj, names) -> None:
    """On the leader: ``name``'s object for round ``seq_id``."""
    state = _state()
    r = state.round(seq_id)
    with state.lock:
        if name in r.gathered_objects:
            raise AssertionError(f"{name} reported intent sequence id {seq_id} twice.")
        r.gathered_objects[name] = obj
        if set(names) == set(r.gathered_objects):
            r.proceed_signal.set()


def _broadcast_to_followers(seq_id: str, objects: dict) -> None:
    """On a follower: every worker's object of round ``seq_id``."""
    r = _state().round(seq_id)
    if r.proceed_signal.is_set():
        raise AssertionError(f"Termination signal sequence id {seq_id} got set twice.")
    r.gathered_objects = objects
    r.proceed_signal.set()


def _all_gather(obj, worker_names=None, timeout: float = UNSET_RPC_TIMEOUT) -> dict:
    """Gather ``obj`` from every worker in ``worker_names`` (default: all) on all of them.

    Returns:
        ``{worker name: obj}``.

    Raises:
        RpcTimeoutError: a worker did not take part within ``timeout`` seconds (-1:
            the RPC timeout, 0: no limit).
    """
    agent = require_agent()
    state = _state()
    names = set(worker_names) if worker_names else {i.name for i in agent.get_worker_infos()}
    leader = min(names)
    me = agent.info.name
    seq_id = state.next_id("".join(sorted(names)))
    if timeout == UNSET_RPC_TIMEOUT:
        rpc_timeout, wait_for = agent.rpc_timeout, None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, wait_for = 0, None
    else:
        rpc_timeout = wait_for = float(timeout)
    if me == leader:
        _gather_to_leader(seq_id, me, obj, names)
    else:
        invoke_sync(leader, _gather_to_leader, (seq_id, me, obj, names), None, rpc_timeout)
    r = state.round(seq_id)
    if not _wait(r.proceed_signal, wait_for, agent):
        with state.lock:
            missing = sorted(names - set(r.gathered_objects)) if me == leader else [leader]
        state.forget(seq_id)
        raise RpcTimeoutError(f"timed out in _all_gather after {wait_for:.2f} seconds "
                              f"waiting for {', '.join(missing)}")
    if me == leader:
        gathered = r.gathered_objects
        futs = {f: invoke_async(f, _broadcast_to_followers, (seq_id, gathered), None,
                                rpc_timeout) for f in sorted(names - {leader})}
        errors = []
        for follower, fut in futs.items():
            try:
                fut.wait()
            except RuntimeError as exc:
                errors.append((follower, exc))
        if errors:
            state.forget(seq_id)
            raise RpcTimeoutError(f"Followers {[e[0] for e in errors]} timed out in "
                                  f"_all_gather after {rpc_timeout:.2f} seconds. The first "
                                  f"exception is {errors[0][1]}")
    state.forget(seq_id)
    return r.gathered_objects


def _wait(event: threading.Event, timeout: float | None, agent) -> bool:
    """Wait for ``event``; without a timeout, as long as the agent runs."""
    if event.is_set():
        return True
    if timeout is not None:
        return threads.wait_blocking(event.wait, timeout)
    return threads.wait_blocking(_wait_while_running, event, agent)


def _wait_while_running(event: threading.Event, agent) -> bool:
    while not event.wait(0.5):
        if agent.closed:
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
