"""Remote references: owner and user RRefs and their reference-counting protocol.

An RRef names a value that lives on one worker, its *owner*.  Every other worker
that holds it holds a *user* RRef, identified by the value's ``rref_id`` and its
own ``fork_id`` (both ``(created_on, local_id)``: the rank that made it and a
counter).  The owner keeps the value while any fork of it exists anywhere, and
while local RRef objects on the owner refer to it.

The protocol (torch's RRef design note; G1: the owner learns of every user's
deletion; G2: a parent keeps its own fork until the owner knows of the child):

* ``remote(to, f)``: the caller makes ``rref_id`` and ``fork_id`` and sends
  ``_remote_exec``; the owner registers the fork, runs ``f`` and replies.  The
  reply *confirms* the caller's fork.
* A user RRef pickled into a message to a third worker makes a child fork: the
  parent keeps itself alive in ``_children`` until the child has told the owner
  ("fork" control message, confirmed by its reply) and then the parent
  ("accept").
* Pickled into a *request* to its owner, nothing is forked: the parent is
  pinned to the call until the reply, by which time the owner has unpickled it.
  Into a *reply* to its owner it is forked, and the owner sends "accept".
* The owner pickling its own RRef for a user registers the fork itself: the
  child is confirmed at once.
* A user RRef that dies (or is deleted by shutdown) sends "del" once it is
  confirmed; never before, so a deletion cannot overtake its fork.

Control messages ("fork", "del", "accept") go through one background thread per
process (the janitor) that batches them per destination into one internal RPC,
and retries on timeout (they are idempotent; user functions are never retried).
Finalizers only put events on a :class:`queue.SimpleQueue`, which is safe from
``__del__``.

Out-of-order arrival: a fork or fetch may reach the owner before the
``_remote_exec`` that creates the value (a pool runs them concurrently); the owner
then creates the entry empty and the value fills it later.  A deletion that
arrives for a fork never registered leaves a tombstone, so the late registration
is dropped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref

import torch

from .. import _serialization as ser
from .._base import threads as _threads
from .._base.errors import RpcStateError, RpcTimeoutError, WorkerUnavailableError
from .._agent.future import Deferred, Future

log = logging.getLogger("torchwire")

_ctx: RRefContext | None = None

_CONTROL_RETRIES = 5
_BATCH_DELAY = 0.002
_TOMBSTONES_MAX = 100_000
_UNSET = -1.0


# Ids are plain ``(created_on, local_id)`` tuples (the rank that made the id and its
# counter): they pickle compactly.  Printed as torch prints its GloballyUniqueId.
_Id = tuple


def _gid(i) -> str:
    return f"GloballyUniqueId(created_on={i[0]}, local_id={i[1]})"


def _require_ctx() -> RRefContext:
    ctx = _ctx
    if ctx is None:
        raise RpcStateError("Current RPC agent is not set! Did you initialize the RPC "
                            "framework (torchwire.rpc.init_rpc)? RRefs need it, and it has "
                            "not been initialized or has been shut down")
    return ctx


# --------------------------------------------------------------------------- owner side


class _Entry:
    """The owner's record of one value: its future and the forks that hold it."""

    __slots__ = ("rref_id", "future", "forks", "type_hint", "__weakref__")

    def __init__(self, rref_id: _Id, type_hint=None) -> None:
        self.rref_id = rref_id
        self.future = Future()
        self.forks: dict[_Id, int] = {}  # fork id -> holder rank
        self.type_hint = type_hint

    def value(self, timeout: float | None = None):
        fut = self.future
        if not fut.done():
            if timeout is not None and timeout > 0:
                _wait_done(fut, timeout, f"the value of {_gid(self.rref_id)}")
            else:
                fut.wait()
        return fut.value()  # raises the stored error


def _wait_done(fut, timeout: float, what: str) -> None:
    done = threading.Event()
    fut.add_done_callback(lambda _f: done.set())
    if not done.is_set():
        _threads.before_blocking()
    if not done.wait(timeout):
        raise RpcTimeoutError(f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) "
                              f"waiting for {what}")


class _UserState:
    """Mutable protocol state of one user fork; changed only by the janitor thread
    (``confirmed`` is also set by the creation callback, before it queues an event)."""

    __slots__ = ("owner", "rref_id", "fork_id", "confirmed", "deleted", "gone", "gate")

    def __init__(self, owner: int, rref_id, fork_id, confirmed: bool) -> None:
        self.gate = None  # future a request waits on before its function runs
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.confirmed = confirmed
        self.deleted = False  # the RRef object died or shutdown deleted it
        self.gone = False  # nothing more to tell the owner (deletion sent, or owner lost)


# --------------------------------------------------------------------------- the RRef


class RRef:
    """A reference to a value that lives on one worker (its owner).

    ``RRef(value)`` makes an owner RRef on this worker; ``rpc.remote`` returns a
    user RRef whose owner is the callee.  Send RRefs in RPC arguments or return
    values freely: the value lives while any reference to it exists anywhere.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.to_here()
        tensor([2., 2.])
        >>> rref.rpc_sync().size()         # runs value.size() on worker1
        torch.Size([2])
    """

    def __init__(self, value, type_hint=None) -> None:
        ctx = _require_ctx()
        entry = _Entry(ctx.new_id(), type_hint)
        entry.future.set_result(value)
        ctx.adopt_local(entry)
        self._init_owner(ctx, entry, None)

    # Internal constructors ------------------------------------------------------

    def _init_owner(self, ctx, entry: _Entry, creation) -> None:
        self._owner = ctx.rank
        self._entry = entry
        self._user = None
        self._creation = creation
        self._type = None

    @classmethod
    def _new_owner(cls, ctx, entry: _Entry, creation=None) -> RRef:
        ctx.adopt_local(entry)  # findable while this object holds it, forks or not
        r = cls.__new__(cls)
        r._init_owner(ctx, entry, creation)
        return r

    @classmethod
    def _new_user(cls, state: _UserState, creation=None, type_=None) -> RRef:
        r = cls.__new__(cls)
        r._owner = state.owner
        r._entry = None
        r._user = state
        r._creation = creation
        r._type = type_
        return r

    def __class_getitem__(cls, item):
        """``RRef[T]`` in annotations.  TorchScript only understands torch's own RRef
        type, so a script function annotated ``RRef[Tensor]`` compiles against that."""
        try:
            from torch._jit_internal import RRef as torch_rref
            return torch_rref[item]
        except (ImportError, AttributeError, TypeError):
            return cls

    def __del__(self) -> None:
        state = getattr(self, "_user", None)
        ctx = _ctx
        if state is not None and ctx is not None and not state.deleted:
            ctx.events.put(("del", state))

    # torch's API ----------------------------------------------------------------

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._entry is not None

    def owner(self):
        """:class:`WorkerInfo` of the owner."""
        return _require_ctx().agent.get_worker_info(self._owner)

    def owner_name(self) -> str:
        """Name of the owner."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always True on the owner)."""
        return self._entry is not None or self._user.confirmed

    def local_value(self):
        """The value, on the owner (waits until a ``remote()`` creating it finished).

        Raises:
            RuntimeError: called on a user RRef; or the function that should have
                created the value raised (that error).
        """
        if self._entry is None:
            s = self._user
            ctx = _require_ctx()
            # torch's wording, then what to do instead
            raise RuntimeError(
                f"For UserRRef(rref_id={_gid(s.rref_id)}, fork_id={_gid(s.fork_id)}), can't "
                f"call localValue() on user {ctx.agent.info!r}. Call it on owner "
                f"{self.owner()!r}: local_value() works on a non-owner RRef only there; "
                "use to_here() or a proxy (rref.rpc_sync()) here")
        return self._entry.value()

    def to_here(self, timeout: float = _UNSET):
        """Copy the value here (blocking).

        Args:
            timeout: seconds; -1 (default) uses the RPC default timeout, 0 waits forever.

        Raises:
            RpcTimeoutError: the value did not arrive in time.
            Exception: the error of the function that should have made the value.
            WorkerUnavailableError: the owner is gone.
        """
        self._check_alive("to_here()")
        ctx = _require_ctx()
        timeout = ctx.resolve_timeout(timeout)
        if self._entry is not None:
            return self._entry.value(timeout)
        creation = self._creation
        if creation is not None and creation.done():
            self._get_future().wait()  # raises the creation error (remote failure, timeout)
        # by id, this RRef pinned to the call: the owner needs no RRef object for it
        value = ctx.agent.call(ctx.agent.get_worker_info(self._owner), _rref_fetch,
                               (self._user.rref_id,), None, timeout, pin=self,
                               sync=True).wait()
        if creation is not None:
            # Only the remote() that made the value sets it, after registering this
            # fork: the value proves the owner knows of us (its reply may still be on
            # its way).  The creation callback handles a deletion before it arrives.
            self._user.confirmed = True
        return value

    def rpc_sync(self, timeout: float = _UNSET):
        """Proxy: ``rref.rpc_sync().method(*args)`` runs ``method`` on the owner, blocking."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = _UNSET):
        """Proxy: ``rref.rpc_async().method(*args)`` returns a future of the result."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = _UNSET):
        """Proxy: ``rref.remote().method(*args)`` returns an RRef to the result (on the owner)."""
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass from the value (a scalar tensor), on its owner.

        Args:
            dist_autograd_ctx_id: a distributed autograd context id: a distributed
                backward pass in that context, from the owner (read the gradients
                with ``torchwire.autograd.get_gradients``).  -1 (default): a local
                ``value.backward()``, allowed on the owner only.
            retain_graph: keep the graph for another backward.

        Raises:
            RuntimeError: -1 on a user RRef ("User RRefs require
                'dist_autograd_ctx_id' to be specified"); the value is not a tensor
                ("RRef should contain a tensor for .backward()"); the context does
                not exist on the owner, or the backward pass failed.
        """
        from .._autograd import backward as _backward  # the layer above, loaded on use
        _backward.rref_backward(self, dist_autograd_ctx_id, retain_graph)

    def _get_future(self):
        """The future of the ``remote()`` that created this RRef (done for other RRefs)."""
        fut = self._creation
        if fut is None:
            return _done(None)
        if not isinstance(fut, _Creation):
            fut = self._creation = _Creation(fut)
        return fut

    def _get_type(self, timeout: float = _UNSET, blocking: bool = True):
        """Type of the value, fetched from the owner once and cached.

        With ``blocking=False`` returns a future of it.
        """
        if self._type is not None:
            return self._type if blocking else _done(self._type)
        if self._entry is not None:
            fut = _type_of(self._entry.future)
        else:
            ctx = _require_ctx()
            fut = ctx.agent.call(ctx.agent.get_worker_info(self._owner), _rref_type,
                                 (self._user.rref_id,), None, ctx.resolve_timeout(timeout),
                                 pin=self)

        def keep(f):
            try:
                self._type = f.value()
            except Exception:
                pass
        fut.add_done_callback(keep)
        return fut.wait() if blocking else fut

    def _check_alive(self, what: str) -> None:
        state = self._user
        if state is not None and state.deleted:
            raise RuntimeError(f"User RRef with RRefId={_gid(state.rref_id)} and "
                               f"ForkId={_gid(state.fork_id)} has been deleted. "
                               f"Cannot call {what} on it after deletion.")

    def __reduce__(self):
        # torch's wording; the RPC pickler handles RRefs before this is reached
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled "
                           "when using RPC")

    def __repr__(self) -> str:
        if self._entry is not None:
            return f"OwnerRRef({_gid(self._entry.rref_id)})"
        s = self._user
        return f"UserRRef(RRefId = {_gid(s.rref_id)}, ForkId = {_gid(s.fork_id)})"

    __str__ = __repr__


def _check_method(cls: type, name: str) -> None:
    if issubclass(cls, (torch.jit.ScriptModule, torch._C.ScriptModule)):
        return  # script modules resolve methods on the instance
    getattr(cls, name)  # AttributeError: "type object 'X' has no attribute 'name'"


def _done(value) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute access names a method of the value."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str):
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args, **kwargs):
            api = _rpc_api or _import_api()
            if mode != "async" or rref._type is not None:
                # As torch: the value's type (fetched once per RRef) must have the
                # method; a typo fails here, before anything runs remotely.
                _check_method(rref._get_type(timeout), name)
            call_args = (rref, name, args, kwargs)
            if mode == "remote":
                return api.remote(rref._owner, _proxy_invoke, call_args, timeout=timeout)
            fut = api.rpc_async(rref._owner, _proxy_invoke, call_args, timeout=timeout)
            return fut.wait() if mode == "sync" else fut
        method.__name__ = name
        return method

    def __repr__(self) -> str:
        return f"<RRef {self._mode} proxy of {self._rref}>"


_rpc_api = None  # torchwire.rpc.api, once imported (it imports this module)


def _import_api():
    """The API module, imported on first use: an import statement in a call's path
    costs microseconds with cold caches."""
    global _rpc_api
    from ..rpc import api
    _rpc_api = api
    return api


# --------------------------------------------------------------------------- the context


class RRefContext:
    """Per-process RRef state: the owner table, pending children, the janitor."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.rank = agent.rank
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._owned: dict[_Id, _Entry] = {}  # entries with forks (held)
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._deleted: dict[_Id, None] = {}  # rref ids freed for good
        self._dead_forks: dict[_Id, None] = {}  # deleted before registered
        self._children: dict[_Id, RRef] = {}  # forks sent, not yet accepted
        self._child_dest: dict[_Id, int] = {}  # fork id -> the rank it was sent to
        self._users: dict[_Id, _UserState] = {}  # live user forks
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._urgent = threading.Event()  # a fork waits: do not linger before the next batch
        self._inflight = 0
        self._busy = False
        self._closed = False
        self._janitor = threading.Thread(target=self._run_janitor,
                                         name=f"torchwire-rref-{agent.name}", daemon=True)
        self._janitor.start()

    def new_id(self) -> _Id:
        return (self.rank, next(self._ids))

    def resolve_timeout(self, timeout) -> float:
        if timeout is None or timeout == _UNSET:
            return self.agent.rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or -1 for the default, "
                             f"got {timeout!r}")
        return float(timeout)

    def debug_info(self) -> dict[str, int]:
        """Counters, as torch's ``_rref_context_get_debug_info`` (plus torchwire's)."""
        with self._lock:
            return {
                "num_owner_rrefs": len(self._owned),
                "num_forks": sum(len(e.forks) for e in self._owned.values()),
                "num_live_values": len(self._owned) + sum(
                    1 for k in list(self._live.keys()) if k not in self._owned),
                "num_pending_users": sum(1 for s in self._users.values() if not s.confirmed),
                "num_pending_children": len(self._children),
                "num_user_rrefs": len(self._users),
            }

    # owner table -------------------------------------------------------------------

    def adopt_local(self, entry: _Entry) -> None:
        with self._lock:
            self._live[entry.rref_id] = entry

    def entry_for(self, rref_id: _Id, creating: bool = False) -> _Entry:
        """The live entry for ``rref_id``, created empty if it has not arrived yet.

        Raises:
            RuntimeError: the value was already deleted (every reference to it died).
        """
        with self._lock:
            entry = self._owned.get(rref_id) or self._live.get(rref_id)
            if entry is None:
                if rref_id in self._deleted and not creating:
                    raise RuntimeError(f"RRef {_gid(rref_id)} owned by {self.agent.name} has "
                                       "already been deleted (no reference to it was left)")
                self._deleted.pop(rref_id, None)
                entry = _Entry(rref_id)
                self._live[rref_id] = entry
            return entry

    def add_fork(self, entry: _Entry, fork_id, holder: int) -> bool:
        with self._lock:
            if self._dead_forks.pop(fork_id, None) is not None:
                return False  # its deletion overtook it
            entry.forks[fork_id] = holder
            self._owned[entry.rref_id] = entry
            return True

    def create_with_fork(self, rref_id: _Id, fork_id: _Id, holder: int) -> _Entry:
        """``_remote_exec``: the entry (made now unless a fetch or fork made it first)
        with the creator's fork.  Held by the fork only: no weak-table entry."""
        with self._lock:
            entry = self._owned.get(rref_id) or self._live.get(rref_id)
            if entry is None:
                self._deleted.pop(rref_id, None)
                entry = _Entry(rref_id)
            if self._dead_forks.pop(fork_id, None) is None:
                entry.forks[fork_id] = holder
                self._owned[rref_id] = entry
            return entry

    def del_fork(self, rref_id, fork_id) -> None:
        with self._lock:
            entry = self._owned.get(rref_id)
            if entry is None or entry.forks.pop(fork_id, None) is None:
                self._dead_forks[fork_id] = None
                self._trim()
                return
            if not entry.forks:
                self._owned.pop(rref_id, None)
                if entry.future.done():
                    # The last fork of a made value is gone: unless a local RRef still
                    # holds it (found in _live first), a later reference is stale.  Not
                    # so before the value is made: the creator's fork is registered by
                    # _remote_exec, which may arrive after its children's forks came
                    # and went; it makes the entry anew.
                    self._deleted[rref_id] = None
                    self._trim()
        del entry  # may free the value here, outside the lock

    def _trim(self) -> None:
        for table in (self._dead_forks, self._deleted):
            while len(table) > _TOMBSTONES_MAX:
                table.pop(next(iter(table)))

    def forks_of(self, holder: int) -> list:
        with self._lock:
            return [(e.rref_id, f) for e in self._owned.values()
                    for f, h in e.forks.items() if h == holder]

    # pickling ------------------------------------------------------------------------

    def reduce(self, rref: RRef):
        sent = ser.current_send()
        if sent is None:
            raise RuntimeError("Can not pickle rref in python pickler, rref can only be "
                               "pickled when using RPC")
        dest = sent.dest
        if rref._entry is not None:  # on the owner
            entry = rref._entry
            if dest == self.rank:
                sent.pins.append(rref)
                return _rebuild_rref, (self.rank, entry.rref_id, None, self.rank, True)
            fork_id = self.new_id()
            self.add_fork(entry, fork_id, dest)
            sent.undo.append(lambda: self.del_fork(entry.rref_id, fork_id))
            return _rebuild_rref, (self.rank, entry.rref_id, fork_id, self.rank, True)
        state = rref._user
        if state.deleted:
            raise RuntimeError("Cannot call fork an UserRRef after deletion.")
        if dest == state.owner and sent.request:
            sent.pins.append(rref)  # the reply proves the owner has unpickled it
            return _rebuild_rref, (state.owner, state.rref_id, None, self.rank, False)
        fork_id = self.new_id()
        with self._lock:
            self._children[fork_id] = rref
            self._child_dest[fork_id] = dest
        sent.undo.append(lambda: self._drop_child(fork_id))
        return _rebuild_rref, (state.owner, state.rref_id, fork_id, self.rank, False)

    def rebuild(self, owner: int, rref_id, fork_id, parent: int, confirmed: bool) -> RRef:
        if owner == self.rank:
            entry = self.entry_for(rref_id)
            if fork_id is not None:  # a user's fork came home in a reply: tell its parent
                self.events.put(("accept", parent, fork_id))
            return RRef._new_owner(self, entry)
        state = _UserState(owner, rref_id, fork_id, confirmed)
        with self._lock:
            self._users[fork_id] = state
        if not confirmed:
            # As torch: a request's function runs once the owner has confirmed the
            # forks in its arguments, so inside it confirmed_by_owner() is True.
            gate = Future()
            if ser.add_gate(gate):
                state.gate = gate
            self.events.put(("fork", state, parent))
            self._urgent.set()
        return RRef._new_user(state)

    def _drop_child(self, fork_id) -> None:
        with self._lock:
            rref = self._children.pop(fork_id, None)
            self._child_dest.pop(fork_id, None)
        del rref  # outside the lock: may be the last reference

    # remote() ---------------------------------------------------------------------

    def remote(self, to, func, args, kwargs, timeout: float) -> RRef:
        agent = self.agent
        rref_id, fork_id = self.new_id(), self.new_id()
        if to.id == self.rank:
            entry = self.entry_for(rref_id, creating=True)
            fut = agent.call(to, _remote_exec, (rref_id, None, self.rank, func, args, kwargs),
                             None, timeout)
            return RRef._new_owner(self, entry, fut)
        state = _UserState(to.id, rref_id, fork_id, False)
        with self._lock:
            self._users[fork_id] = state
        fut = agent.call(to, _remote_exec, (rref_id, fork_id, self.rank, func, args, kwargs),
                         None, timeout)

        def confirm(f) -> None:  # on the reader thread: bookkeeping only
            try:
                f.value()
            except (WorkerUnavailableError, RpcStateError):
                self.events.put(("lost", state))
                return
            except Exception:
                pass  # timed out (the deletion settles it either way) or the owner failed
            # Dekker with the janitor's "del": it sets deleted, then reads confirmed.
            state.confirmed = True
            if state.deleted:
                self.events.put(("confirmed", state))
        fut._add_inline_callback(confirm)
        return RRef._new_user(state, fut)

    # janitor -----------------------------------------------------------------------

    def _run_janitor(self) -> None:
        events = self.events
        while True:
            try:
                first = events.get(timeout=0.5)
            except queue.Empty:
                if self._closed:
                    return
                continue
            self._busy = True
            self._urgent.clear()
            try:
                batch = [first]
                while True:
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                if self._closed:
                    return
                self._process(batch)
            except Exception:
                log.exception("torchwire: RRef control messages failed")
            finally:
                self._busy = False
            # Let the next events gather: one wake-up per batch, not per event.
            self._urgent.wait(_BATCH_DELAY)

    def _process(self, batch) -> None:
        out: dict[int, list] = {}
        for ev in batch:
            kind = ev[0]
            if kind in ("del", "confirmed"):
                # Dekker with the creation callback: "del" sets deleted, then reads
                # confirmed; the callback sets confirmed, then reads deleted.  Whichever
                # event comes second sends the deletion, once.
                state = ev[1]
                if kind == "del":
                    state.deleted = True
                    self._forget_user(state)
                if state.deleted and state.confirmed and not state.gone:
                    state.gone = True
                    out.setdefault(state.owner, []).append(
                        ("del", state.rref_id, state.fork_id, None))
            elif kind == "lost":
                state = ev[1]
                state.gone = True
                self._forget_user(state)
            elif kind == "fork":
                state, parent = ev[1], ev[2]
                out.setdefault(state.owner, []).append(
                    ("fork", state.rref_id, state.fork_id, (state, parent)))
            elif kind == "accept":
                out.setdefault(ev[1], []).append(("accept", None, ev[2], None))
            elif kind == "retry":
                self._send_ops(ev[1], ev[2], ev[3])
        for dest, ops in out.items():
            forks = [op for op in ops if op[0] == "fork"]
            rest = [op[:3] for op in ops if op[0] != "fork"]
            if rest:  # deletions and accepts need no reply: a lost one means a lost peer
                try:
                    self.agent.notify(self.agent.get_worker_info(dest), _rref_control,
                                      (self.rank, rest))
                except Exception as exc:
                    log.debug("torchwire: RRef control to rank %d not sent: %s", dest, exc)
            if forks:
                self._send_ops(dest, forks)

    def _forget_user(self, state: _UserState) -> None:
        with self._lock:
            self._users.pop(state.fork_id, None)

    def _send_ops(self, dest: int, ops: list, attempt: int = 0) -> None:
        agent = self.agent
        wire = [(op, rid, fid) for op, rid, fid, _local in ops]
        timeout = agent.rpc_timeout if agent.rpc_timeout > 0 else 60.0
        with self._lock:
            self._inflight += 1
        try:
            fut = agent.call(agent.get_worker_info(dest), _rref_control, (self.rank, wire),
                             None, timeout)
        except Exception as exc:
            with self._lock:
                self._inflight -= 1
            log.debug("torchwire: RRef control to rank %d not sent: %s", dest, exc)
            return
        fut.add_done_callback(lambda f: self._ops_done(f, dest, ops, attempt))

    def _ops_done(self, fut, dest: int, ops: list, attempt: int) -> None:
        try:
            fut.wait()
        except RpcTimeoutError:
            if attempt < _CONTROL_RETRIES and not self._closed:
                self.events.put(("retry", dest, ops, attempt + 1))
            else:
                log.warning("torchwire: RRef control messages to rank %d timed out %d times; "
                            "giving up", dest, attempt + 1)
        except Exception as exc:
            log.debug("torchwire: RRef control messages to rank %d failed: %s", dest, exc)
            for op, _rid, _fid, local in ops:
                if op == "fork":
                    self.events.put(("lost", local[0]))
                    _open_gate(local[0])
        else:
            refused = set(fut.value() or ())
            for op, _rid, fid, local in ops:
                if op == "fork" and fid in refused:
                    self.events.put(("lost", local[0]))
                    _open_gate(local[0])
                elif op == "fork":
                    state, parent = local
                    state.confirmed = True
                    _open_gate(state)
                    self.events.put(("confirmed", state))
                    if parent == self.rank:
                        self._drop_child(state.fork_id)
                    else:
                        self.events.put(("accept", parent, state.fork_id))
        finally:
            with self._lock:
                self._inflight -= 1

    # shutdown hooks (see RpcAgent.add_plugin) -----------------------------------------

    def idle(self) -> bool:
        return self.events.empty() and not self._busy and self._inflight == 0

    def settle(self, deadline: float) -> None:
        quiet = 0
        while quiet < 2:  # twice in a row: an event just taken off the queue shows as busy
            quiet = quiet + 1 if self.idle() else 0
            if time.monotonic() >= deadline:
                return  # the agent's own wait reports the timeout
            time.sleep(0.001)

    def peer_lost(self, rank: int, error: BaseException) -> None:
        """The agent lost ``rank`` (see RpcAgent.add_plugin): nothing it held or owned
        can be settled with it any more.

        * forks it held of values owned here are released (G1 cannot hold: its
          deletions will never come);
        * user RRefs it owns are forgotten here (no deletion to send); using one
          still raises the agent's ``WorkerUnavailableError`` naming it;
        * children forks sent to it, or of values it owns, are dropped (their
          "accept" will never come).
        """
        forks = self.forks_of(rank)
        for rref_id, fork_id in forks:
            self.del_fork(rref_id, fork_id)
        with self._lock:
            users = [s for s in self._users.values() if s.owner == rank]
            children = [f for f, d in self._child_dest.items() if d == rank]
            children += [f for f, r in self._children.items()
                         if r._user is not None and r._user.owner == rank]
        for state in users:
            self.events.put(("lost", state))
            _open_gate(state)
        for fork_id in children:
            self._drop_child(fork_id)
        log.debug("torchwire: rank %d lost (%s): released %d forks it held, forgot %d user "
                  "RRefs it owns, dropped %d children", rank, error, len(forks), len(users),
                  len(children))

    def all_arrived(self) -> None:
        """Every worker is shutting down: delete every user RRef (torch does the same)."""
        from ..rpc import api
        api._delete_all_user_and_unforked_owner_rrefs()

    def delete_all_users(self) -> None:
        with self._lock:
            states = list(self._users.values())
        for state in states:
            state.deleted = True  # at once: later use raises "... after deletion"
            self.events.put(("del", state))

    def leaks(self) -> list[str]:
        with self._lock:
            owned = [f"{_gid(e.rref_id)} (forks held by ranks "
                     f"{sorted(set(e.forks.values()))})" for e in self._owned.values()]
            users = [f"{_gid(s.rref_id)} fork {_gid(s.fork_id)}" for s in self._users.values()
                     if not s.deleted]
        return [f"owner RRef {o}" for o in owned] + [f"user RRef {u}" for u in users]

    def close(self) -> None:
        self._closed = True
        self.events.put(("stop",))


def _open_gate(state: _UserState) -> None:
    gate, state.gate = state.gate, None
    if gate is not None:
        gate.set_result(None)


class _Creation(Future):
    """Future of a ``remote()`` creation: None, or the error that prevented it."""

    def __init__(self, call_fut) -> None:
        super().__init__()
        call_fut._add_inline_callback(self._done)

    def _done(self, f) -> None:
        try:
            status = f.value()
        except Exception as exc:
            if isinstance(exc, RpcTimeoutError):
                exc = RpcTimeoutError(f"RRef creation via rpc.remote() timed out, and it is "
                                      f"possible that the RRef on the owner has not been "
                                      f"created: {exc}")
            self.set_exception(exc)
            return
        if status is None:
            self.set_result(None)
        else:
            self.set_exception(ser.loads_exception(status))


# --------------------------------------------------------------------------- wire side
# Module-level functions, run on the remote worker through ordinary RPC requests.


def _rebuild_rref(owner, rref_id, fork_id, parent, confirmed):
    return _require_ctx().rebuild(owner, rref_id, fork_id, parent, confirmed)


def _reduce_rref(rref: RRef):
    state = rref._user
    if state is not None and state.deleted:
        raise RuntimeError("Cannot call fork an UserRRef after deletion.")
    return _require_ctx().reduce(rref)


ser.hooks.register_reducer(RRef, _reduce_rref)


class _PlainRRef:
    """RRef arguments of plain calls (``ser.plain_call``): only a user RRef sent to its
    owner, which needs no fork (the owner finds its own RRef); the request pins it
    until the reply, as pickled."""

    rref_type = RRef

    @staticmethod
    def can(rref: RRef, dest: int) -> bool:
        state = rref._user
        return state is not None and not state.deleted and state.owner == dest

    @staticmethod
    def encode(rref: RRef, send) -> tuple:
        send.pins.append(rref)
        return (rref._user.rref_id, _require_ctx().rank)

    @staticmethod
    def decode(desc) -> RRef:
        rref_id, parent = desc
        ctx = _require_ctx()
        return ctx.rebuild(ctx.rank, tuple(rref_id), None, parent, False)


ser.hooks.set_rref_codec(_PlainRRef())


def _remote_exec(rref_id, fork_id, caller: int, func, args, kwargs):
    """Owner: create the value of a ``remote()`` call.

    The reply (None, or the function's error as bytes) confirms the caller's fork.
    """
    ctx = _require_ctx()
    if fork_id is not None:
        entry = ctx.create_with_fork(rref_id, fork_id, caller)
    else:  # remote() to oneself: the caller's own RRef object holds the entry
        entry = ctx.entry_for(rref_id, creating=True)
    try:
        value = func(*(args or ()), **(kwargs or {}))
        if type(value) is Deferred:  # a proxy call (rref.remote().method())
            later = value.future
        elif getattr(func, "_wrapped_async_rpc_function", None) is not None:
            if not isinstance(value, torch._C.Future):
                raise RuntimeError(
                    "Functions decorated with @rpc.async_function must return a "
                    f"torch.futures.Future object, but {getattr(func, '__qualname__', func)} "
                    f"returned {type(value).__name__}")
            later = value
        else:
            later = None
    except Exception as exc:
        return _failed(ctx, entry, exc)
    if later is None:
        entry.future.set_result(value)
        return None
    reply = Future()

    def finish(f) -> None:
        try:
            result = f.wait()
        except Exception as exc:
            reply.set_result(_failed(ctx, entry, exc))
            return
        entry.future.set_result(result)
        reply.set_result(None)
    later.add_done_callback(finish)
    return Deferred(reply)


def _failed(ctx, entry: _Entry, exc: BaseException) -> bytes:
    """Store ``exc`` as the value's error; the creation reply describes it."""
    import traceback
    entry.future.set_exception(exc)
    return ser.dumps_exception(exc, ctx.agent._desc, "".join(traceback.format_exception(exc)))


def _awaited(target):
    """The owner's value future of ``target`` (an RRef or an rref id); an entry still
    waiting for its value is kept alive by the wait (it may have been made by this
    very message)."""
    entry = _entry_of(target)
    fut = entry.future
    if not fut.done():
        fut.add_done_callback(lambda _f: entry)
    return fut


def _entry_of(target) -> _Entry:
    if isinstance(target, RRef):
        return target._entry
    return _require_ctx().entry_for(target)


def _rref_fetch(target):
    """Owner: the value of ``target`` (an rref id or RRef) once it exists (``to_here``)."""
    fut = _entry_of(target).future
    return fut.value() if fut.done() else Deferred(_awaited(target))


def _type_of(value_future) -> Future:
    """Future of the type of ``value_future``'s value (or of its error)."""
    out = Future()

    def fill(f):
        try:
            out.set_result(type(f.value()))
        except Exception as exc:
            out.set_exception(exc)
    value_future.add_done_callback(fill)
    return out


def _rref_type(target):
    return Deferred(_type_of(_awaited(target)))


def _proxy_invoke(rref: RRef, name: str, args, kwargs):
    """Owner: ``getattr(value, name)(*args, **kwargs)`` once the value exists.

    A method decorated with ``@rpc.functions.async_execution`` replies when the
    future it returns completes.
    """
    fut = rref._entry.future
    if fut.done():
        value = fut.value()
        if not _is_async_method(value, name):
            return getattr(value, name)(*args, **kwargs)
    out = Future()

    def run(f) -> None:
        try:
            value = f.value()
            result = getattr(value, name)(*args, **kwargs)
            if _is_async_method(value, name) and isinstance(result, torch._C.Future):
                def chain(r):
                    try:
                        out.set_result(r.value())
                    except Exception as exc:
                        out.set_exception(exc)
                result.add_done_callback(chain)
                return
            out.set_result(result)
        except Exception as exc:
            out.set_exception(exc)

    fut = _awaited(rref)
    if fut.done():
        run(fut)
    else:
        fut.add_done_callback(run)
    return Deferred(out)


def _is_async_method(value, name: str) -> bool:
    attr = getattr(type(value), name, None)
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    return getattr(attr, "_wrapped_async_rpc_function", None) is not None or \
        getattr(getattr(value, name, None), "_wrapped_async_rpc_function", None) is not None


def _rref_control(sender: int, ops) -> list:
    """Apply a batch of control messages from ``sender`` (idempotent).

    Returns the fork ids whose registration was refused (their value is gone).
    """
    ctx = _require_ctx()
    refused = []
    for op, rref_id, fork_id in ops:
        if op == "fork":
            try:
                entry = ctx.entry_for(rref_id)
            except RuntimeError as exc:
                log.warning("torchwire: fork %r from rank %d refused: %s", fork_id, sender, exc)
                refused.append(fork_id)
                continue
            ctx.add_fork(entry, fork_id, sender)
        elif op == "del":
            ctx.del_fork(rref_id, fork_id)
        elif op == "accept":
            ctx._drop_child(fork_id)
        else:
            log.warning("torchwire: unknown RRef control message %r from rank %d", op, sender)
    return refused


# --------------------------------------------------------------------------- lifecycle


def start(agent) -> RRefContext:
    global _ctx
    ctx = RRefContext(agent)
    agent.add_plugin(ctx)
    _ctx = ctx
    return ctx


def stop(ctx: RRefContext) -> None:
    global _ctx
    if _ctx is ctx:
        _ctx = None


def debug_info() -> dict[str, int]:
    return _require_ctx().debug_info()

