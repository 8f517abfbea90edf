"""torch's private RPC collectives (``_all_gather``, ``_barrier``, ``_wait_all_workers``).

Programs and torch's own tests use them.  The worker with the smallest name
leads: every other worker sends it its object; once it has them all it sends
the whole map back to each.  Rounds over the same set of workers are told apart
by a per-set sequence number, so consecutive gathers never mix.  The rounds and
sequence numbers belong to the runtime (a new job in this process starts from 0).

A round, as each worker takes part in it::

    follower:  send its object to the leader      (_gather_to_leader: an RPC)
               wait for the whole map              (the signal wait)
    leader:    add its own object; wait until every worker's is in (the signal wait)
               send the map to every follower      (_broadcast_to_followers: RPCs)

The RPCs are bounded by the RPC timeout.  The signal wait has torch's bound:
``timeout`` seconds when one is given, none with the defaults - torch's shutdown
barrier relies on it, since workers may take arbitrarily long to get there.  Without
a bound the wait still ends once the round can no longer complete: a worker it
waits for (on the leader, each one whose object is not in yet; on a follower, the
leader) is lost, as the agent tells its plug-ins (``peer_lost``: a connection that
ended without a goodbye, a silent heartbeat, a listener that refused), or left the
group.  The waiter then raises a ``WorkerUnavailableError`` naming that worker and
why.  So that a worker that died before it ever talked to the waiter is found too,
the waiter holds a connection to every worker it waits for (dialled again each
``_PROBE_PERIOD`` while it has none: a dead process's listener refuses), and the
heartbeat watches them.  A slow worker that is alive is waited for as long as it
takes.

A leader that gives a round up tells every other follower (``_abandon_round``, a
one-way message); each fails the round with the same cause, at once if it waits
already, on arrival if it comes later.  Every worker keeps the rounds that failed
(without their objects), so a message of one that comes late gets the error back: a
follower's object that crossed the leader's message, the leader's result to a follower
that found it lost.
"""

from __future__ import annotations

import logging
import threading
import time

from .._agent.invoke import invoke_async, invoke_sync
from .._agent.runtime import current, require_agent
from .._base import threads
from .._base.errors import (RpcStateError, RpcTimeoutError, TorchwireError,
                            UnknownWorkerError, WorkerUnavailableError, not_initialized)
from .._base.options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

log = logging.getLogger("torchwire")

# Seconds between a waiter's looks at the workers it waits for (a dial to each one it
# holds no connection with); their losses reach it at once through ``peer_lost``.
_PROBE_PERIOD = 1.0


class AllGatherStates:
    """One gather round (torch's name and fields): the objects gathered so far, and the
    event set once every worker's is in - or once the round failed.

    ``names`` (the leader's: the workers taking part), ``leader`` (a follower's, once it
    takes part) and ``failure`` (why the round cannot complete) are torchwire's.
    """

    __slots__ = ("gathered_objects", "proceed_signal", "names", "leader", "failure")

    def __init__(self) -> None:
        self.gathered_objects: dict = {}
        self.proceed_signal = threading.Event()
        self.names: frozenset[str] | None = None
        self.leader: str | None = None
        self.failure: BaseException | None = None

    def __repr__(self) -> str:
        state = "failed" if self.failure is not None else \
            "done" if self.proceed_signal.is_set() else "waiting"
        return f"<AllGatherStates gathered={len(self.gathered_objects)} {state}>"


class Collectives:
    """The collectives' state in one runtime: rounds in progress, sequence numbers.

    An agent plug-in (``_agent/plugins.AgentPlugin``): a lost worker fails the rounds
    that wait for it, and closing the agent fails those still waiting.
    """

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

    def gather(self, seq_id: str, name: str, obj, names) -> AllGatherStates:
        """On the leader: add ``name``'s object to round ``seq_id`` (unless it failed)."""
        r = self.round(seq_id)
        with self.lock:
            if r.failure is not None:
                return r
            if name in r.gathered_objects:
                raise AssertionError(f"{name} reported intent sequence id {seq_id} twice.")
            r.names = frozenset(names)
            r.gathered_objects[name] = obj
            if r.names == set(r.gathered_objects):
                r.proceed_signal.set()
        return r

    def follow(self, seq_id: str, leader: str) -> AllGatherStates:
        """On a follower: take part in round ``seq_id``, led by ``leader``.

        Raises:
            WorkerUnavailableError: the leader gave the round up before this worker came.
        """
        r = self.round(seq_id)
        with self.lock:
            failure = r.failure
            r.leader = leader
        if failure is not None:
            raise failure
        return r

    def fail(self, r: AllGatherStates, error: BaseException) -> bool:
        """End round ``r`` with ``error`` unless it is complete; True if it was not.

        A failed round is kept (without its objects): a message of it that comes late
        (a follower's object, the leader's result) gets the error back.
        """
        with self.lock:
            if r.proceed_signal.is_set():
                return False
            r.failure = error
            r.gathered_objects = {}
            r.proceed_signal.set()
        return True

    def awaited(self, r: AllGatherStates) -> set[str]:
        """Who round ``r`` still waits for: on the leader, each worker whose object is
        not in; on a follower, the leader."""
        with self.lock:
            if r.proceed_signal.is_set():
                return set()
            if r.leader is not None:
                return {r.leader}
            if r.names is not None:
                return set(r.names) - set(r.gathered_objects)
            return set()

    # ------------------------------------------------------------------ agent plug-in

    def settle(self, deadline: float) -> None:
        """Nothing to send before a shutdown round."""

    def idle(self) -> bool:
        return True  # a round in progress holds no message of shutdown's to send

    def all_arrived(self) -> None:
        """Nothing to release when every worker has entered shutdown."""

    def peer_lost(self, rank: int, error: BaseException) -> None:
        """Fail every round that waits for the lost worker (``error`` names it)."""
        name = getattr(error, "worker_name", None)
        if name is None:
            return
        why = getattr(error, "reason", None) or str(error)
        with self.lock:
            rounds = list(self.rounds.values())
        for r in rounds:
            if name in self.awaited(r):
                self.fail(r, _lost(name, why, r.leader))

    def close(self) -> None:
        """The agent is closed: no round still waiting can complete."""
        with self.lock:
            rounds = list(self.rounds.values())
        for r in rounds:
            self.fail(r, RpcStateError("_all_gather: RPC was shut down on this worker while "
                                       "it waited for the other workers"))


def _lost(name: str, why: str, leader: str | None) -> WorkerUnavailableError:
    """The error of a round that waited for ``name`` (``leader``: this worker follows)."""
    if leader is None:
        message = f"_all_gather: {name} was lost ({why}) before it took part"
    else:
        message = f"_all_gather: the leader {name} was lost ({why}) before it sent the result"
    return WorkerUnavailableError(message, worker_name=name, reason=why)


def _state() -> Collectives:
    rt = current.runtime
    if rt is None:
        raise not_initialized()
    return rt.collectives


def _gather_to_leader(seq_id: str, name: str, obj, names) -> tuple[str, str] | None:
    """On the leader: ``name``'s object for round ``seq_id``.

    Returns:
        None; for a round the leader gave up, the lost worker's name and why (the
        follower raises the error ``_abandon_round`` would have).
    """
    r = _state().gather(seq_id, name, obj, names)
    failure = r.failure
    if failure is None:
        return None
    if isinstance(failure, WorkerUnavailableError) and failure.worker_name:
        return failure.worker_name, failure.reason or str(failure)
    raise type(failure)(*failure.args)  # a copy: late followers may raise it at once


def _broadcast_to_followers(seq_id: str, objects: dict) -> None:
    """On a follower: every worker's object of round ``seq_id``.

    Raises:
        WorkerUnavailableError: this follower gave the round up (it found the leader lost).
    """
    state = _state()
    r = state.round(seq_id)
    with state.lock:
        failure = r.failure
        if failure is None:
            if r.proceed_signal.is_set():
                raise AssertionError(f"Termination signal sequence id {seq_id} got set twice.")
            r.gathered_objects = objects
            r.proceed_signal.set()
    if failure is not None:
        raise type(failure)(*failure.args)


def _abandon_round(seq_id: str, leader: str, name: str, why: str) -> None:
    """On a follower (a one-way message): the leader gave round ``seq_id`` up, since
    ``name`` was lost before it took part."""
    state = _state()
    state.fail(state.round(seq_id), _given_up(leader, name, why))


def _given_up(leader: str, name: str, why: str) -> WorkerUnavailableError:
    return WorkerUnavailableError(
        f"_all_gather: {name} was lost ({why}) before it took part (the leader {leader} "
        "gave the round up)", worker_name=name, reason=why)


def _all_gather(obj, worker_names=None, timeout: float = UNSET_RPC_TIMEOUT) -> dict:
    """Gather ``obj`` from every worker in ``worker_names`` (default: all) on all of them.

    Args:
        obj: this worker's object.
        worker_names: the workers taking part (each must call this); default: every
            member of the job.
        timeout: ``UNSET_RPC_TIMEOUT`` (-1, the default): the RPCs of the round are
            bounded by the RPC timeout, and the wait for the other workers by nothing;
            ``DEFAULT_SHUTDOWN_TIMEOUT`` (0): neither is bounded; otherwise the seconds
            that bound both.  Unbounded, the wait still ends when a worker it waits for
            is lost or leaves the group.

    Returns:
        ``{worker name: obj}``.

    Raises:
        WorkerUnavailableError: a worker was lost (or left) before it took part, or the
            leader was lost before it sent the result: the error names it and why; or
            followers were lost before they received it (on the leader).
        RpcTimeoutError: a worker did not take part within ``timeout`` seconds, or an RPC
            of the round ran past its timeout.
        RpcStateError: RPC is not initialized, or was shut down while this waited.
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
        r = state.gather(seq_id, me, obj, names)
    else:
        r = state.follow(seq_id, leader)  # before the call: the leader's loss fails it
        try:
            given_up = invoke_sync(leader, _gather_to_leader, (seq_id, me, obj, names), None,
                                   rpc_timeout)
        except BaseException:
            state.forget(seq_id)
            raise
        if given_up is not None:  # crossed the leader's _abandon_round
            state.fail(r, _given_up(leader, *given_up))
    deadline = None if wait_for is None else time.monotonic() + wait_for
    if not r.proceed_signal.is_set():
        threads.wait_blocking(_wait_round, state, r, agent, deadline)
    if not r.proceed_signal.is_set():
        missing = sorted(state.awaited(r))
        state.forget(seq_id)
        raise RpcTimeoutError(f"timed out in _all_gather after {wait_for:.2f} seconds "
                              f"waiting for {', '.join(missing)}")
    if r.failure is not None:  # the round is kept (Collectives.fail)
        if me == leader and isinstance(r.failure, WorkerUnavailableError):
            _abandon(agent, seq_id, names - {me}, r.failure)
        raise r.failure
    if me == leader:
        _broadcast(state, seq_id, r.gathered_objects, names - {leader}, rpc_timeout)
    state.forget(seq_id)
    return r.gathered_objects


def _wait_round(state: Collectives, r: AllGatherStates, agent, deadline: float | None) -> None:
    """Wait for round ``r`` until ``deadline`` (None: as long as it can complete); fail
    it once a worker it waits for is found lost (module docstring)."""
    while not r.proceed_signal.is_set():
        now = time.monotonic()
        until = now + _PROBE_PERIOD if deadline is None else min(now + _PROBE_PERIOD, deadline)
        if until <= now:
            return
        lost = _find_lost(agent, state.awaited(r), until)
        if lost is not None:
            state.fail(r, _lost(*lost, r.leader))
            return
        r.proceed_signal.wait(max(0.0, until - time.monotonic()))


def _find_lost(agent, awaited: set[str], until: float) -> tuple[str, str] | None:
    """The first of ``awaited`` that this agent knows lost or gone, and why; each one it
    holds no connection with is dialled (until ``until`` at most)."""
    for name in sorted(awaited):
        try:
            rank = agent.get_worker_info(name).id
            agent.health.check(rank)  # down: raises, naming why
            agent.links.connection_to(rank, until)  # a dead listener refuses
        except UnknownWorkerError:
            continue  # not a member (yet): a dynamic group's newcomer may join still
        except WorkerUnavailableError as exc:  # lost, or it left the group
            return name, exc.reason or str(exc)
        except RpcTimeoutError:
            continue  # no answer in time is no proof of death: it is tried again
    return None


def _abandon(agent, seq_id: str, followers: set[str], failure: BaseException) -> None:
    """On the leader: tell the other followers that round ``seq_id`` failed."""
    lost = getattr(failure, "worker_name", None)
    why = getattr(failure, "reason", None) or str(failure)
    for follower in sorted(followers - {lost}):
        try:
            agent.notify(agent.get_worker_info(follower), _abandon_round,
                         (seq_id, agent.info.name, lost, why))
        except TorchwireError as exc:  # lost too, or this agent is closing
            log.debug("torchwire: could not tell %s that _all_gather round %s failed: %s",
                      follower, seq_id, exc)


def _broadcast(state: Collectives, seq_id: str, gathered: dict, followers: set[str],
               rpc_timeout: float) -> None:
    """On the leader: send the whole map to every follower and wait for them."""
    futs = {f: invoke_async(f, _broadcast_to_followers, (seq_id, gathered), None, rpc_timeout)
            for f in sorted(followers)}
    errors = []
    for follower, fut in futs.items():
        try:
            fut.wait()
        except RuntimeError as exc:
            errors.append((follower, exc))
    if not errors:
        return
    state.forget(seq_id)
    who = [e[0] for e in errors]
    if all(isinstance(e[1], WorkerUnavailableError) for e in errors):
        raise WorkerUnavailableError(
            f"_all_gather: followers {who} did not receive the result. The first exception "
            f"is {errors[0][1]}", worker_name=who[0], reason=str(errors[0][1]))
    raise RpcTimeoutError(f"Followers {who} timed out in _all_gather after {rpc_timeout:.2f} "
                          f"seconds. The first exception is {errors[0][1]}")


def _barrier(worker_names) -> None:
    """Block until every worker in ``worker_names`` has reached this call.

    As torch's, it raises nothing: a barrier that cannot complete (a worker was lost
    or left before it came, the leader was lost) logs the error, which names that
    worker, and returns.
    """
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError:
        log.exception("torchwire: _barrier failed")


def _wait_all_workers(timeout=DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker has reached this call (torch's pre-shutdown barrier).

    Raises:
        as ``_all_gather`` (``timeout`` 0, the default: no time limit).
    """
    _all_gather(None, timeout=timeout)
