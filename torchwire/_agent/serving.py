"""Serving: what the agent does with the frames its readers decode.

Replies complete their pending calls (``pending.py``).  Requests run their
function and send its reply on the connection they came in on:

* a lone request, or a few (``_INLINE_MAX``), that end what the reader has read run
  on the reader's own thread (``inline.py``); a larger batch goes to the pool in one
  hand-off;
* a PLAIN request is either a call (decoded by the plain codec) or an internal
  one-way message, handed to the handler its kind's layer registered;
* a request whose arguments hold an RRef fork its owner has not confirmed yet runs
  once it is (no thread waits meanwhile), or fails with the error that names the
  owner if it never will be;
* a function that returns a coroutine (``async def``) has it run as a task of the
  worker's event loop (``coroutines.py``); the reply is sent when the task ends,
  from the loop thread if it is small and plain, else from the pool;
* an ``@async_execution`` function, or a torchwire-internal one that returns a
  ``Deferred``, replies when its future completes; completed on an I/O thread, a
  small plain value is written from there (``send_nowait``), anything else on the
  pool.

Every request with a request id gets a reply, whatever fails: a function that
raises ``SystemExit`` (an error for the caller; this worker serves on), an exception
whose ``__str__`` fails, a return value that cannot be pickled for any reason.
A one-way request (request id 0) gets no reply; its failure is logged here.
"""

from __future__ import annotations

import logging
import sys
import traceback
import types

import torch

from .. import _serialization as ser
from .._base import intraop as _intraop
from .._base import threads as _threads
from .._base.asyncexec import ASYNC_ATTR, check_future
from .._base.errors import (LinkError, ProtocolError, RemoteCallError, RpcStateError,
                            SerializationError)
from .._wire import frame as F
from . import profiling
from .future import Deferred, add_done_callback
from .inline import InlineScheduler

log = logging.getLogger("torchwire")

_INLINE_MAX = 4  # a reader runs a batch of at most this many requests itself
_PLAIN_TYPES = frozenset((type(None), bool, int, float, str, bytes))
_NOWAIT_MAX = 16 << 10  # bytes of reply payload an I/O thread may write itself

_K_RESPONSE, _K_REQUEST, _K_GOODBYE = F.K_RESPONSE, F.K_REQUEST, F.K_GOODBYE
_F_PLAIN = F.F_PLAIN
_COROUTINE = types.CoroutineType


def _received_bytes(tensors) -> int:
    """The bytes of a request's received buffers (``bytearray``s or 1-D ``uint8``
    tensors: ``len`` is their size)."""
    n = 0
    for t in tensors:
        n += len(t)
    return n


class Server:
    """Runs the requests that arrive for one agent and sends their replies.

    Args:
        agent: the :class:`~torchwire._agent.agent.RpcAgent` (its pending calls, pool,
            counters, links).
    """

    def __init__(self, agent) -> None:
        self._agent = agent
        self._pending = agent.pending
        self._pool = agent.pool
        self._counters = agent.counters
        self._desc = repr(agent.info)
        self.async_active = 0  # @async_execution functions whose future is not done
        self.large_replies = _intraop.LargeReplies()
        self.inline = InlineScheduler(agent.pool.submit, agent.links.spawn_reader)

    def __repr__(self) -> str:
        return f"<Server of {self._desc} {self.inline!r}>"

    def on_frames(self, conn, frames, at_rest: bool = False) -> bool:
        """Reader thread: dispatch a batch of decoded frames.

        When the batch ends what the reader has read (``at_rest``) and holds a few
        requests (``_INLINE_MAX``; a ``remote()`` followed by ``to_here()`` typically
        arrives as two), the reader runs them itself, in order (``inline.py``).

        Returns:
            True if the reading was handed to another thread meanwhile: the reader
            must stop.
        """
        work = []
        synced = False  # a caller waiting at once got its reply
        for kind, flags, rid, payload, tensors in frames:
            if kind == _K_RESPONSE:
                if self._pending.complete(rid, flags, payload, tensors):
                    synced = True
            elif kind == _K_REQUEST:
                work.append((self.serve_plain if flags & _F_PLAIN else self.serve,
                             (conn, rid, payload, tensors)))
            elif kind != _K_GOODBYE:
                raise ProtocolError(f"unexpected frame kind {kind} on an established "
                                    "connection")
        if work:
            c = self._counters
            with c.lock:  # (Counters.count_received, inlined: every request's path)
                c.received += len(work)
                c.recv_from[conn.peer_rank] += len(work)
            if at_rest and len(work) <= _INLINE_MAX:
                # The requests own their payloads and tensors now: nothing else may keep
                # a received tensor (its buffer, its mapping) alive while they run.
                frames.clear()
                del payload, tensors
                return self.inline.run(conn, work)
            self._pool.submit_many(work)
        elif synced and at_rest:
            # its caller may well wait for the next reply at once: lend it the reading
            # (``_wire/lending.py``); this thread parks until the reading comes back
            role = getattr(conn, "role", None)
            if role is not None:
                # nothing may keep a received buffer alive while this thread parks
                frames.clear()
                del payload, tensors
                pending = self._pending
                error = role.lend(lambda: pending.idle_on(conn))
                if error is not None:  # a borrower broke the stream: end the connection
                    raise error
        return False

    # ------------------------------------------------------------------ requests

    def serve(self, conn, rid: int, payload, tensors) -> None:
        """Decode one pickled request, run it and reply (a request carrying large
        tensors with torch's own intra-op threads: ``intraop.full_for``)."""
        saved = _intraop.full_for(_received_bytes(tensors)) if tensors else None
        try:
            gates: list = []
            try:
                func, args, kwargs = ser.loads(payload, tensors, gates=gates)
            except BaseException as exc:  # (a __setstate__ may even sys.exit())
                self.reply_error(conn, rid, exc, "")
                return
            del payload, tensors
            if gates:
                # Something in the arguments is not ready yet (an RRef fork the owner
                # has not confirmed): run the function once it is, without holding
                # this thread.
                torch.futures.collect_all(gates).add_done_callback(
                    lambda _f: self._pool.submit(self._run_gated, conn, rid, gates, func,
                                                 args, kwargs))
                return
            self.run(conn, rid, func, args, kwargs)
        finally:
            if saved is not None:
                _intraop.restore(saved)

    def serve_plain(self, conn, rid: int, payload, tensors) -> None:
        """A PLAIN request: a call (``ser.plain_call``), run and replied as any; or an
        internal one-way message, to its handler on this thread (a failure can only be
        logged: the handlers report their own errors to whoever waits)."""
        if rid != 0:  # a call
            saved = _intraop.full_for(_received_bytes(tensors)) if tensors else None
            try:
                try:
                    if not payload or payload[0] != ser.PlainKind.CALL:
                        raise ProtocolError("malformed plain request")
                    func, args, kwargs = ser.plain_call_decode(payload, tensors)
                except Exception as exc:
                    self.reply_error(conn, rid, exc, "")
                    return
                del payload, tensors
                self.run(conn, rid, func, args, kwargs)
            finally:
                if saved is not None:
                    _intraop.restore(saved)
            return
        try:
            if not payload:
                raise ProtocolError("empty internal message")
            handler = ser.hooks.plain_handler(payload[0])
            if handler is None:
                raise ProtocolError(f"unknown internal message kind {payload[0]}")
            handler(conn.peer_rank, payload, tensors)
        except Exception:
            log.exception("torchwire: internal message from %s failed",
                          self._agent.name_of(conn.peer_rank))

    def _run_gated(self, conn, rid: int, gates: list, func, args, kwargs) -> None:
        """Pool: run a request whose gates are settled, or reply with the error of one
        that failed (an RRef fork its owner will never confirm: the error names it)."""
        for gate in gates:
            try:
                gate.value()
            except Exception as exc:
                del func, args, kwargs  # release the RRefs before replying
                self.reply_error(conn, rid, exc, "")
                return
        self.run(conn, rid, func, args, kwargs)

    def run(self, conn, rid: int, func, args, kwargs) -> None:
        """Run a decoded request and reply (now, or when its future completes)."""
        # in a job trace, the function's run is a range of it (profiling.py)
        span = profiling.serve_begin(func, args, self._agent.name_of(conn.peer_rank),
                                     self._agent.name) if profiling.traced else None
        key = _intraop.work_key(func, args)
        saved = self.large_replies.full_for(key)
        try:
            if getattr(func, ASYNC_ATTR, None) is not None:
                fut = func(*(args or ()), **(kwargs or {}))
                check_future(func, fut)
                with self._counters.lock:
                    self.async_active += 1
                add_done_callback(fut, lambda f: self._async_done(conn, rid, f))
                return
            result = func(*(args or ()), **(kwargs or {}))
            t = type(result)
            if t is Deferred:  # torchwire-internal functions (RRefs)
                torch._C.Future.add_done_callback(
                    result.future, lambda f: self.reply_future(conn, rid, f))
                return
            if t is _COROUTINE:  # an async def: to the event loop, no thread waits
                self._agent.coroutines.start(
                    result, lambda task: self._coroutine_done(conn, rid, task))
                return
        except BaseException as exc:  # SystemExit too: the caller gets an error, we serve on
            tb = traceback.format_exc()
            # As torch, the callee reports a failing function on its stderr too, not
            # only through the caller's exception.
            print(f"On {self._desc}:\n{_describe(exc)}\n{tb}", file=sys.stderr)
            if isinstance(exc, TypeError) and _is_torch_op(func):
                exc = RemoteCallError("Overloaded torch operator invoked from Python failed "
                                      f"to match any schema: {exc}")
            self.reply_error(conn, rid, exc, tb)
            return
        finally:
            if span is not None:
                profiling.serve_end(span)
            if saved is not None:
                _intraop.restore(saved)
        # Release the arguments before replying: an RRef among them sends its
        # deletion before the caller learns the call is over.
        del func, args, kwargs
        self.reply_value(conn, rid, result, key)

    def _coroutine_done(self, conn, rid: int, task) -> None:
        """Loop thread: reply with what the task of an ``async def`` call ended with."""
        if task.cancelled():
            self._defer(self.reply_error, conn, rid, self._agent.coroutines.cancelled_error(),
                        "")
            return
        exc = task.exception()
        if exc is not None:
            tb = "".join(traceback.format_exception(exc))
            print(f"On {self._desc}:\n{exc!r}\n{tb}", file=sys.stderr)
            self._defer(self.reply_error, conn, rid, exc, tb)
            return
        value = task.result()
        if not self._reply_nowait(conn, rid, value):
            self._defer(self.reply_value, conn, rid, value)

    def _defer(self, fn, *args) -> None:
        try:
            self._pool.submit(fn, *args)
        except RpcStateError:
            log.debug("torchwire: reply %d dropped: %s is shut down", args[1], self._desc)

    def _async_done(self, conn, rid: int, fut) -> None:
        with self._counters.lock:
            self.async_active -= 1
        self.reply_future(conn, rid, fut)

    # ------------------------------------------------------------------ replies

    def reply_future(self, conn, rid: int, fut) -> None:
        """Reply with what ``fut`` holds (it is done)."""
        if _threads.in_io_thread():
            # A reader completed the future (the reply to a nested call arrived): a
            # small plain value is sent from here without waking a pool thread.
            try:
                value = fut.value()
            except Exception:
                value = _NO_VALUE  # errors: the pool formats them
            if value is _NO_VALUE or not self._reply_nowait(conn, rid, value):
                self._pool.submit(self.reply_future, conn, rid, fut)
            return
        try:
            value = fut.wait()
        except Exception as exc:
            self.reply_error(conn, rid, exc, traceback.format_exc())
            return
        self.reply_value(conn, rid, value)

    def _reply_nowait(self, conn, rid: int, value) -> bool:
        """I/O thread: reply with ``value`` if it is small and plain (no user code
        runs to pickle it, no tensors) and the link can write without blocking
        (``Connection.send_nowait``); False to leave the reply to the pool."""
        send = getattr(conn, "send_nowait", None)
        if send is None or rid == 0:
            return False
        if not _plain_value(value, 0):
            return False
        try:
            payload, _, _ = ser.dumps_to(value, conn.peer_rank, False, True)
        except SerializationError:
            return False
        if len(payload) > _NOWAIT_MAX:
            return False
        counters = self._counters
        counters.count_reply(1)
        if not send(F.pack_header(F.K_RESPONSE, 0, rid, len(payload), 0) + payload):
            counters.count_reply(-1)
            return False
        counters.count_reply_in_place()
        return True

    def reply_value(self, conn, rid: int, value, key=None) -> None:
        """Send ``value`` as the reply to request ``rid`` (nothing for a one-way one);
        ``key``: the work key of the function that made it, whose calls learn its size
        (before it is sent: the caller's next call may arrive at once)."""
        if rid == 0:
            return
        flags, sent = _F_PLAIN, None
        try:
            plain = ser.plain_reply(value)
            if plain is None:
                flags = 0
                payload, tensors, sent = ser.dumps_to(value, conn.peer_rank, False, True)
            else:
                payload, tensors = plain
        except SerializationError as exc:
            self.reply_error(conn, rid, SerializationError(
                f"the return value could not be serialized: {exc}"), "")
            return
        except BaseException as exc:  # its own error (an RRef whose owner is lost) or a bug
            self.reply_error(conn, rid, exc, traceback.format_exc())
            return
        agent = self._agent
        size = len(payload)
        for t in tensors:
            size += t.nbytes
        if size > agent.limits.smallest and size > agent.limits.of(conn.peer_rank):
            if sent is not None:
                sent.abort()
            self.reply_error(conn, rid, SerializationError(
                f"a reply of {size} bytes to {agent.name_of(conn.peer_rank)} exceeds "
                f"max_message_size {agent.limits.of(conn.peer_rank)} (the smaller of its "
                "caller's and this worker's)"), "")
            return
        c = self._counters
        with c.lock:  # before the write: the caller may go on before it returns
            c.replies += 1
        if key is not None:
            self.large_replies.learn(key, size)
        saved = _intraop.full_for(size) if tensors else None  # (a same-host channel copies)
        try:
            conn.send_frame(_K_RESPONSE, flags, rid, payload, tensors)
        except LinkError:
            c.count_reply(-1)
            if sent is not None:
                sent.abort()
            log.debug("torchwire: reply %d to rank %s dropped: connection closed", rid,
                      conn.peer_rank)
        finally:
            if saved is not None:
                _intraop.restore(saved)

    def reply_error(self, conn, rid: int, exc: BaseException, tb: str) -> None:
        """Send ``exc`` as the reply to request ``rid`` (logged for a one-way one)."""
        if not isinstance(exc, Exception):  # SystemExit: an error for the caller, no exit
            exc = RemoteCallError(f"the function raised {_describe(exc)}")
        if rid == 0:
            log.warning("torchwire: one-way request from rank %s failed on %s: %s: %s\n%s",
                        conn.peer_rank, self._agent.name, type(exc).__name__,
                        _describe(exc), tb)
            return
        try:
            payload = ser.dumps_exception(exc, self._desc, tb)
        except BaseException as bad:  # (dumps_exception guards str(); this is the last resort)
            payload = ser.dumps_exception(RemoteCallError(
                f"{type(exc).__qualname__} raised, and describing it failed: "
                f"{type(bad).__qualname__}"), self._desc, "")
        self._counters.count_reply(1)
        try:
            conn.send_frame(_K_RESPONSE, F.F_ERROR, rid, payload)
        except LinkError:
            self._counters.count_reply(-1)
            log.debug("torchwire: error reply %d dropped: connection closed", rid)


_NO_VALUE = object()


def _describe(exc: BaseException) -> str:
    """``repr(exc)``, or its type's name when its ``__repr__`` fails."""
    try:
        return repr(exc)
    except Exception:
        return f"<{type(exc).__qualname__}: repr() failed>"


def _plain_value(value, depth: int) -> bool:
    """None, numbers, strings and bytes, and small tuples and lists of them."""
    t = type(value)
    if t in _PLAIN_TYPES:
        return True
    if (t is tuple or t is list) and depth < 2 and len(value) <= 16:
        return all(_plain_value(v, depth + 1) for v in value)
    return False


def _is_torch_op(func) -> bool:
    """A builtin torch operator (``torch.add``), whose bad arguments torch reports as a
    RuntimeError ("failed to match any schema") rather than TypeError."""
    return type(func).__name__ == "builtin_function_or_method" and \
        getattr(func, "__module__", None) == "torch"
