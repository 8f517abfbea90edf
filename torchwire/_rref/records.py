"""The records of the RRef protocol: ids, an owner's entry, a user's fork state, and the
kinds of janitor events and control messages.

Ids are plain ``(created_on, local_id)`` tuples (the rank that made the id and its
counter): they pickle compactly.  They print as torch prints its GloballyUniqueId.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from .._agent.future import Future, add_done_callback
from .._agent.runtime import current
from .._agent.state import AgentState
from .._base import threads
from .._base.errors import RpcTimeoutError, not_initialized

Id = tuple


def gid(i: Id) -> str:
    return f"GloballyUniqueId(created_on={i[0]}, local_id={i[1]})"


def context() -> Any:
    """This process's RRef context (a ``context.RRefContext``: not imported here, which
    would make records import the module that imports it).

    Raises:
        RpcStateError: RPC is not initialized ("Current RPC agent is not set", torch's
            phrase for RRefs).
    """
    rt = current.runtime  # (require_runtime, inlined: this is on every RRef's paths)
    if rt is None or rt.agent.state is _CLOSED:
        raise not_initialized(lookup=True)
    return rt.rrefs


_CLOSED = AgentState.CLOSED


class Entry:
    """The owner's record of one value: its future and the forks that hold it."""

    __slots__ = ("rref_id", "future", "forks", "type_hint", "__weakref__")

    def __init__(self, rref_id: Id, type_hint=None) -> None:
        self.rref_id = rref_id
        self.future = Future()
        self.forks: dict[Id, int] = {}  # fork id -> holder rank
        self.type_hint = type_hint

    def __repr__(self) -> str:
        return (f"<RRef entry {gid(self.rref_id)} done={self.future.done()} "
                f"forks={len(self.forks)}>")

    def value(self, timeout: float | None = None):
        fut = self.future
        if not fut.done():
            if timeout is not None and timeout > 0:
                wait_done(fut, timeout, f"the value of {gid(self.rref_id)}")
            else:
                fut.wait()
        return fut.value()  # raises the stored error


def wait_done(fut, timeout: float, what: str) -> None:
    """Wait until ``fut`` is done, at most ``timeout`` seconds.

    Raises:
        RpcTimeoutError: it was not done in time ("RPC ran for more than set timeout").
    """
    done = threading.Event()
    add_done_callback(fut, lambda _f: done.set())
    if not done.is_set() and not threads.wait_blocking(done.wait, timeout):
        raise RpcTimeoutError(f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) "
                              f"waiting for {what}")


class UserState:
    """Mutable protocol state of one user fork; changed only by the janitor thread
    (``confirmed`` is also set by the creation callback, before it queues an event)."""

    __slots__ = ("owner", "rref_id", "fork_id", "confirmed", "deleted", "gone", "gate", "lost",
                 "retried")

    def __init__(self, owner: int, rref_id: Id, fork_id: Id, confirmed: bool) -> None:
        self.gate = None  # future a request waits on before its function runs
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.confirmed = confirmed
        self.deleted = False  # the RRef object died or shutdown deleted it
        self.gone = False  # nothing more to tell the owner (deletion sent, or owner lost)
        # its FORK was sent more than once: copies may reach the owner after its deletion
        self.retried = False
        # (error, incarnation) once its owner was lost: every use raises (owner_lost)
        self.lost: tuple[BaseException, int | None] | None = None

    def __repr__(self) -> str:
        return (f"<UserState {gid(self.fork_id)} of {gid(self.rref_id)} owner={self.owner} "
                f"confirmed={self.confirmed} deleted={self.deleted} gone={self.gone}>")


# The janitor's callbacks (a confirmation, a failed FORK) and the agent's
# ``peer_lost`` may settle one fork's gate at once: it is taken under this lock,
# so exactly one of them completes it.
_gate_lock = threading.Lock()


def _take_gate(state: UserState):
    with _gate_lock:
        gate, state.gate = state.gate, None
    return gate


def open_gate(state: UserState) -> None:
    """Let a request waiting for this fork's confirmation run its function."""
    gate = _take_gate(state)
    if gate is not None:
        gate.set_result(None)


def fail_gate(state: UserState, error: BaseException) -> None:
    """The owner will never confirm this fork: the gate of the request waiting for it
    fails with ``error`` (which names the owner and why).  The caller records the
    failure on ``state`` first, so the function that may still run with this RRef
    raises it on any use."""
    gate = _take_gate(state)
    if gate is not None:
        gate.set_exception(error)


class Event(enum.Enum):
    """What the janitor thread is told (``(Event, ...)`` tuples on its queue)."""

    DELETED = "deleted"  # (state,): a user RRef died or was deleted
    CONFIRMED = "confirmed"  # (state,): the owner confirmed a fork (after a deletion?)
    LOST = "lost"  # (state,): the owner is gone or refused the fork: forget it
    FORK = "fork"  # (state, parent rank): tell the owner of a new fork
    ACCEPT = "accept"  # (parent rank, fork id): tell the parent the owner knows the child
    RETRY = "retry"  # (dest, ops, attempt): send timed-out fork messages again
    # (state, parent rank): the owner will never confirm the fork: undo it there (a
    # FORGET: a registration arriving later meets its tombstone) and release the parent
    ABANDONED = "abandoned"
    STOP = "stop"  # (): the context is closed


class ControlOp(enum.IntEnum):
    """A control message to another worker (sent as its int value, batched)."""

    FORK = 1  # to the owner: register fork (rref id, fork id) held by the sender
    DEL = 2  # to the owner: the sender's fork (rref id, fork id) is gone
    ACCEPT = 3  # to the parent: the owner knows the child fork (fork id)
    # to the owner: as DEL, for a fork whose FORK was sent more than once (retried
    # after timeouts, or given up on): copies that arrive later must be refused
    FORGET = 4
