"""Functions the RRef protocol runs on the owner, through ordinary RPC requests.

Each is a module-level function, pickled by reference.  A function that must wait
for the value (a ``remote()`` still running, a fetch that arrived first) returns a
:class:`~torchwire._agent.future.Deferred`: the agent replies when it completes, and
no thread waits meanwhile.
"""

from __future__ import annotations

import logging
import traceback
import types

from .. import _serialization as ser
from .._agent import profiling
from .._agent.future import Deferred, Future, add_done_callback
from .._agent.runtime import require_agent
from .._base import intraop as _intraop
from .._base.asyncexec import ASYNC_ATTR, check_future, is_async
from .._base.errors import RRefError
from .records import ControlOp, Entry, context

log = logging.getLogger("torchwire")

_COROUTINE = types.CoroutineType


def _on_loop(coro) -> Future:
    """Run a coroutine (an ``async def`` function's or method's) on the worker's event
    loop; the future of its result."""
    return require_agent().coroutines.future_of(coro)


def remote_exec(rref_id, fork_id, caller: int, func, args, kwargs):
    """Owner: create the value of a ``remote()`` call.

    The reply (None, or the function's error as bytes) confirms the caller's fork.
    """
    ctx = context()
    if fork_id is not None:
        entry = ctx.create_with_fork(rref_id, fork_id, caller)
    else:  # remote() to oneself: the caller's own RRef object holds the entry
        entry = ctx.entry_for(rref_id, creating=True)
    try:
        value = func(*(args or ()), **(kwargs or {}))
        if type(value) is Deferred:  # a proxy call (rref.remote().method())
            later = value.future
        elif type(value) is _COROUTINE:  # an async def: the value is its result
            later = _on_loop(value)
        elif is_async(func):
            check_future(func, value)
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
    add_done_callback(later, finish)
    return Deferred(reply)



# profiled, a remote() is named after the user's function (its 4th argument), and the
# type query by torch's name of it (profiling.py)
setattr(remote_exec, profiling.PROFILE_AS, ("remote", 3))

def _failed(ctx, entry: Entry, exc: BaseException) -> bytes:
    """Store ``exc`` as the value's error; the creation reply describes it."""
    entry.future.set_exception(exc)
    return ser.dumps_exception(exc, repr(ctx.agent.info), "".join(traceback.format_exception(exc)))


def _entry_of(target) -> Entry:
    """``target`` is an rref id (a tuple) or an RRef that came home to its owner."""
    if type(target) is tuple:
        return context().entry_for(target)
    return target._entry


def _awaited(target) -> Future:
    """The owner's value future of ``target``; an entry still waiting for its value is
    kept alive by the wait (it may have been made by this very message)."""
    entry = _entry_of(target)
    fut = entry.future
    if not fut.done():
        add_done_callback(fut, lambda _f: entry)
    return fut


def rref_fetch(target):
    """Owner: the value of ``target`` (an rref id or RRef) once it exists (``to_here``)."""
    fut = _entry_of(target).future
    return fut.value() if fut.done() else Deferred(_awaited(target))


def type_of(value_future) -> Future:
    """Future of the type of ``value_future``'s value (or of its error)."""
    out = Future()

    def fill(f):
        try:
            out.set_result(type(f.value()))
        except Exception as exc:
            out.set_exception(exc)
    add_done_callback(value_future, fill)
    return out


def rref_type(target):
    """Owner: the type of ``target``'s value, once it exists (proxies check methods)."""
    return Deferred(type_of(_awaited(target)))


setattr(rref_type, profiling.PROFILE_AS, ("async", "_rref_typeof_on_owner"))


def proxy_invoke(rref, name: str, args, kwargs):
    """Owner: ``getattr(value, name)(*args, **kwargs)`` once the value exists.

    A method decorated with ``@rpc.functions.async_execution`` replies when the
    future it returns completes; a coroutine method (``async def``) when it returns.
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
            later = type(result) is _COROUTINE
            if later:
                result = _on_loop(result)
            elif _is_async_method(value, name):
                check_future(getattr(value, name), result)
                later = True
            if later:
                def chain(r):
                    try:
                        out.set_result(r.value())
                    except Exception as exc:
                        out.set_exception(exc)
                add_done_callback(result, chain)
                return
            out.set_result(result)
        except Exception as exc:
            out.set_exception(exc)

    fut = _awaited(rref)
    if fut.done():
        run(fut)
    else:
        add_done_callback(fut, run)
    return Deferred(out)


setattr(proxy_invoke, profiling.PROFILE_AS, (None, 1))  # named after the method
_intraop.name_work_by_arg(proxy_invoke, 1)  # its intra-op threads: the method's own


def _is_async_method(value, name: str) -> bool:
    attr = getattr(type(value), name, None)
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    return getattr(attr, ASYNC_ATTR, None) is not None or \
        is_async(getattr(value, name, None))


def rref_control(sender: int, ops) -> list:
    """Apply a batch of control messages from ``sender`` (idempotent).

    Returns the fork ids whose registration was refused (their value is gone).
    """
    ctx = context()
    refused = []
    for op, rref_id, fork_id in ops:
        if op == ControlOp.FORK:
            try:
                entry = ctx.entry_for(rref_id)
            except RRefError as exc:
                log.warning("torchwire: fork %r from rank %d refused: %s", fork_id, sender, exc)
                refused.append(fork_id)
                continue
            ctx.add_fork(entry, fork_id, sender)
        elif op == ControlOp.DEL or op == ControlOp.FORGET:
            ctx.del_fork(rref_id, fork_id, tombstone=op == ControlOp.FORGET)
        elif op == ControlOp.ACCEPT:
            ctx.drop_child(fork_id)
        else:
            log.warning("torchwire: unknown RRef control message %r from rank %d", op, sender)
    return refused
