"""``RRef``: a reference to a value that lives on one worker, and its proxies."""

from __future__ import annotations

import enum
from typing import Any

import torch

from .. import _serialization as ser
from .._agent.future import Future, add_done_callback
from .._agent.invoke import check_call, invoke_async
from .._agent.runtime import current, require_runtime
from .._base.errors import RpcTimeoutError, RRefError
from .._base.options import UNSET_RPC_TIMEOUT, resolve_timeout
from .._base.worker_info import WorkerInfo
from .handlers import proxy_invoke, rref_fetch, rref_type, type_of
from .records import Entry, Event, UserState, context, gid, wait_done


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
        ctx = context()
        entry = Entry(ctx.new_id(), type_hint)
        entry.future.set_result(value)
        ctx.adopt_local(entry)
        self._init_owner(ctx, entry, None)

    # Internal constructors ------------------------------------------------------

    def _init_owner(self, ctx, entry: Entry, creation) -> None:
        self._ctx = ctx
        self._owner = ctx.rank
        self._entry = entry
        self._user = None
        self._creation = creation
        self._type = None
        self._type_future = None  # the future of the type query, once made

    @classmethod
    def _new_owner(cls, ctx, entry: Entry, creation=None) -> RRef:
        ctx.adopt_local(entry)  # findable while this object holds it, forks or not
        r = cls.__new__(cls)
        r._init_owner(ctx, entry, creation)
        return r

    @classmethod
    def _new_user(cls, ctx, state: UserState, creation=None, type_=None) -> RRef:
        r = cls.__new__(cls)
        r._ctx = ctx
        r._owner = state.owner
        r._entry = None
        r._user = state
        r._creation = creation
        r._type = type_
        r._type_future = None
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
        rt = current.runtime
        if state is not None and rt is not None and not state.deleted \
                and rt.rrefs is getattr(self, "_ctx", None):  # of an earlier session: no
            rt.rrefs.janitor.put((Event.DELETED, state))

    # torch's API ----------------------------------------------------------------

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._entry is not None

    def owner(self) -> WorkerInfo:
        """:class:`WorkerInfo` of the owner."""
        return self._context().agent.get_worker_info(self._owner)

    def owner_name(self) -> str:
        """Name of the owner."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always True on the owner)."""
        return self._entry is not None or self._user.confirmed

    def local_value(self) -> Any:
        """The value, on the owner (waits until a ``remote()`` creating it finished).

        Raises:
            RRefError: called on a user RRef.
            Exception: the function that should have created the value raised (that
                error).
        """
        if self._entry is None:
            s = self._user
            ctx = self._context()
            # torch's wording, then what to do instead
            raise RRefError(
                f"For UserRRef(rref_id={gid(s.rref_id)}, fork_id={gid(s.fork_id)}), can't "
                f"call localValue() on user {ctx.agent.info!r}. Call it on owner "
                f"{self.owner()!r}: local_value() works on a non-owner RRef only there; "
                "use to_here() or a proxy (rref.rpc_sync()) here")
        return self._entry.value()

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT):
        """Copy the value here (blocking).

        Args:
            timeout: seconds; -1 (default) uses the RPC default timeout, 0 waits forever.

        Raises:
            RpcTimeoutError: the value did not arrive in time.
            Exception: the error of the function that should have made the value.
            WorkerUnavailableError: the owner is gone.
            RRefError: this user RRef was deleted.
        """
        self._check_alive("to_here()")
        agent = self._ctx.agent
        timeout = resolve_timeout(timeout, agent.rpc_timeout)
        if self._entry is not None:
            return self._entry.value(timeout)
        creation = self._creation
        if creation is not None and creation.done():
            self._get_future().wait()  # raises the creation error (remote failure, timeout)
        # by id, this RRef pinned to the call: the owner needs no RRef object for it
        value = agent.call(agent.get_worker_info(self._owner), rref_fetch,
                           (self._user.rref_id,), None, timeout, pin=self, sync=True).wait()
        if creation is not None:
            # Only the remote() that made the value sets it, after registering this
            # fork: the value proves the owner knows of us (its reply may still be on
            # its way).  The creation callback handles a deletion before it arrives.
            self._user.confirmed = True
        return value

    def to_here_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Future:
        """Copy the value here without blocking: a :class:`Future` of it.

        ``await rref.to_here_async()`` in a coroutine does not block the event loop;
        ``rref.to_here_async().wait()`` is ``to_here()``.  torchwire addition.

        Args:
            timeout: as :meth:`to_here`.

        Returns:
            A future of the value, or of the error :meth:`to_here` would raise
            (``RpcTimeoutError``, the creating function's error,
            ``WorkerUnavailableError``).

        Raises:
            RRefError: this user RRef was deleted.
        """
        self._check_alive("to_here_async()")
        agent = self._ctx.agent
        timeout = resolve_timeout(timeout, agent.rpc_timeout)
        if self._entry is not None:
            return _copy_of(self._entry.future)
        creation = self._creation
        if creation is not None and creation.done():
            try:
                self._get_future().value()
            except Exception as exc:  # the creation failed: its error, as to_here
                failed = Future()
                failed.set_exception(exc)
                return failed
        fut: Future = agent.call(agent.get_worker_info(self._owner), rref_fetch,
                                 (self._user.rref_id,), None, timeout, pin=self)
        if creation is not None:
            state = self._user

            def confirm(f) -> None:  # as to_here: the value proves the owner knows us
                try:
                    f.value()
                except Exception:
                    return
                state.confirmed = True
            fut._add_inline_callback(confirm)
        return fut

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT):
        """Proxy: ``rref.rpc_sync().method(*args)`` runs ``method`` on the owner, blocking."""
        return _Proxy(self, _ProxyMode.SYNC, timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT):
        """Proxy: ``rref.rpc_async().method(*args)`` returns a future of the result."""
        return _Proxy(self, _ProxyMode.ASYNC, timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT):
        """Proxy: ``rref.remote().method(*args)`` returns an RRef to the result (on the owner)."""
        return _Proxy(self, _ProxyMode.REMOTE, timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass from the value (a scalar tensor), on its owner.

        Args:
            dist_autograd_ctx_id: a distributed autograd context id: a distributed
                backward pass in that context, from the owner (read the gradients
                with ``torchwire.autograd.get_gradients``).  -1 (default): a local
                ``value.backward()``, allowed on the owner only.
            retain_graph: keep the graph for another backward.

        Raises:
            DistAutogradError: -1 on a user RRef ("User RRefs require
                'dist_autograd_ctx_id' to be specified"); the value is not a tensor
                ("RRef should contain a tensor for .backward()"); the context does
                not exist on the owner, or the backward pass failed.
        """
        require_runtime(lookup=True).autograd.rref_backward(self, dist_autograd_ctx_id,
                                                            retain_graph)

    def _get_future(self) -> Future:
        """The future of the ``remote()`` that created this RRef (done for other RRefs)."""
        fut = self._creation
        if fut is None:
            return _done(None)
        if not isinstance(fut, _Creation):
            fut = self._creation = _Creation(fut)
        return fut

    def _get_profiling_future(self) -> Future:
        """torch's: completes once a profiled ``remote()``'s events are recorded (the
        creation future here: it completes only after that)."""
        return self._get_future()

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True):
        """Type of the value, fetched from the owner once and cached.

        With ``blocking=False`` returns a future of it.

        Raises:
            RpcTimeoutError: (blocking) the type was not known within ``timeout``
                seconds (-1: the RPC default; 0: no limit): on a user RRef, the query
                to the owner timed out; on the owner, the value is not made yet.
        """
        if blocking and self._type is not None:
            return self._type
        fut = self._type_future  # as torch: one future of it, for every non-blocking call
        if fut is not None and fut.done():
            try:
                fut.value()
            except Exception:
                fut = self._type_future = None  # it failed: ask again
        if fut is not None:
            # made by an earlier call, with its own timeout (or none: the owner's)
            return fut if not blocking else self._wait_type(fut, timeout)
        if self._type is None:
            self._check_alive("a proxy")
        asked = False  # a query to the owner, which its own timeout bounds
        if self._type is not None:
            fut = _done(self._type)
        elif self._entry is not None:
            fut = type_of(self._entry.future)
        else:
            agent = self._context().agent
            fut = agent.call(agent.get_worker_info(self._owner), rref_type,
                             (self._user.rref_id,), None,
                             resolve_timeout(timeout, agent.rpc_timeout), pin=self)
            asked = True

        def keep(f):
            try:
                self._type = f.value()
            except Exception:
                pass
        add_done_callback(fut, keep)
        self._type_future = fut
        if not blocking:
            return fut
        # now: the next call must find it
        self._type = fut.wait() if asked else self._wait_type(fut, timeout)
        return self._type

    def _wait_type(self, fut: Future, timeout: float):
        """``fut.wait()``, at most the call's timeout: on the owner, ``fut`` waits for
        the value itself (a ``remote()`` still running, or an entry an early fetch made
        whose creator died), which nothing else bounds."""
        timeout = resolve_timeout(timeout, self._context().agent.rpc_timeout)
        if timeout > 0 and not fut.done():
            rref_id = self._entry.rref_id if self._entry is not None else self._user.rref_id
            wait_done(fut, timeout, f"the type of the value of {gid(rref_id)}")
        return fut.wait()

    def _context(self):
        """This session's RRef context.

        Raises:
            RpcStateError: RPC is not running.
            RRefError: this RRef was made in an earlier session (``init_rpc`` again
                after ``shutdown()``): its ids may name another value now.
        """
        ctx = context()
        if ctx is not self._ctx:
            raise RRefError(f"{self!r} belongs to an RPC session that was shut down: an "
                            "RRef does not outlive rpc.shutdown()")
        return ctx

    def _check_alive(self, what: str) -> None:
        state = self._user
        if state is not None and state.lost is not None:
            raise self._context().owner_lost(state)
        if state is not None and state.deleted:
            raise RRefError(f"User RRef with RRefId={gid(state.rref_id)} and "
                            f"ForkId={gid(state.fork_id)} has been deleted. "
                            f"Cannot call {what} on it after deletion.")
        self._context()

    def __reduce__(self):
        # torch's wording; the RPC pickler handles RRefs before this is reached
        raise RRefError("Can not pickle rref in python pickler, rref can only be pickled "
                        "when using RPC")

    def __repr__(self) -> str:
        if self._entry is not None:
            return f"OwnerRRef({gid(self._entry.rref_id)})"
        s = self._user
        return f"UserRRef(RRefId = {gid(s.rref_id)}, ForkId = {gid(s.fork_id)})"

    __str__ = __repr__


def remote(to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> RRef:
    """``rpc.remote``: run ``func`` on ``to`` and keep the result there; a user RRef."""
    _agent, info, args, kwargs, timeout = check_call(to, func, args, kwargs, timeout)
    return context().remote(info, func, args, kwargs, timeout)


def _check_method(cls: type, name: str) -> None:
    if issubclass(cls, (torch.jit.ScriptModule, torch._C.ScriptModule)):
        return  # script modules resolve methods on the instance
    getattr(cls, name)  # AttributeError: "type object 'X' has no attribute 'name'"


def _copy_of(source) -> Future:
    """A future completed as ``source`` is (which callers must not complete)."""
    out = Future()

    def copy(f) -> None:
        try:
            out.set_result(f.value())
        except Exception as exc:
            out.set_exception(exc)
    source._add_inline_callback(copy)
    return out


def _done(value) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


class _ProxyMode(enum.Enum):
    SYNC = "rpc_sync"  # rref.rpc_sync().method(): the result
    ASYNC = "rpc_async"  # rref.rpc_async().method(): a future of the result
    REMOTE = "remote"  # rref.remote().method(): an RRef to the result, on the owner


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
            if mode is not _ProxyMode.ASYNC or rref._type is not None:
                # As torch: the value's type (fetched once per RRef) must have the
                # method; a typo fails here, before anything runs remotely.
                _check_method(rref._get_type(timeout), name)
            rref._check_alive(f"{mode.value}().{name}()")
            call_args = (rref, name, args, kwargs)
            if mode is _ProxyMode.REMOTE:
                return remote(rref._owner, proxy_invoke, call_args, None, timeout)
            fut = invoke_async(rref._owner, proxy_invoke, call_args, None, timeout)
            return fut.wait() if mode is _ProxyMode.SYNC else fut
        method.__name__ = name
        return method

    def __repr__(self) -> str:
        return f"<RRef {self._mode.value} proxy of {self._rref}>"


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
