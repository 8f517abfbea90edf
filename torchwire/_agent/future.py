"""The future type returned by ``rpc_async``.

It is a :class:`torch.futures.Future` (so ``torch.futures.wait_all`` and
``collect_all`` accept it), with one difference that matters for a transport:
callbacks added with :meth:`then` or :meth:`add_done_callback` never run on a
torchwire I/O thread.  If the future is completed by the reader or the timer,
the callback is handed to the worker pool, so a slow or blocking callback
cannot stall the wire.  Completed from any other thread, it runs inline as
torch's future does.

It is also awaitable: ``await fut`` in a running asyncio loop suspends the
coroutine until the future is done, without blocking the loop's thread, and gives
the value or raises the error, as :meth:`Future.wait` would.  Inside a running loop
it is an asyncio future too (``asyncio.gather``, ``wait``, ``wait_for`` take it as
it is), and a callback added there runs on that loop.  Cancelling the awaiting task,
or the future, stops the wait at once; the call itself goes on and its late reply
completes the future's torch side, which nothing reads (``awaiting.py``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
from typing import Any

import torch

from .._base import threads as _threads
from .._base.errors import CallbackError, RpcStateError
from .._wire import reader as _reader
from .._wire.lending import LENT as _LENT
from .awaiting import AsyncioFuture
from .runtime import current

log = logging.getLogger("torchwire")


def _run_off_io(fn, arg) -> None:
    """``fn(arg)``, on the runtime's pool when called on an I/O thread."""
    if _threads.in_io_thread():
        rt = current.runtime
        if rt is not None:
            try:
                rt.agent.defer(fn, arg)
                return
            except RpcStateError:
                pass  # the pool is shut down: run it here, nothing else would
    fn(arg)


class Deferred:
    """Returned by an internal function run through RPC: the reply is sent when
    ``future`` completes (like ``async_execution``, decided per call)."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future


class Future(AsyncioFuture, torch.futures.Future):
    """A :class:`torch.futures.Future` whose callbacks stay off I/O threads."""

    # (conn, deadline, pending calls) of a call sent while its connection's reading
    # was lent (``_wire/lending.py``); a class default until set: no dict per future
    _tw_link = None
    # its waiter may read the next reply itself (``wait()``, ``_read_idle``)
    lends = False

    def then(self, callback):
        if not callable(callback):
            raise TypeError(f"then(): incompatible function arguments: callback must be "
                            f"callable, got {type(callback).__name__}")
        child = Future()

        def run(fut):
            try:
                child.set_result(callback(fut))
            except Exception as exc:
                # torch's wording: code ported from torch matches on it
                err = CallbackError("Got the following error when running the callback: "
                                   f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                child.set_exception(err)

        self._queue(run)
        return child

    def add_done_callback(self, callback, *, context=None) -> None:
        """Run ``callback(fut)`` once done.  Added from a thread that runs an asyncio
        loop, it runs on that loop, as an asyncio future's callback does (in
        ``context``, if given); otherwise as torch's, off I/O threads."""
        if not callable(callback):
            raise TypeError(f"add_done_callback(): incompatible function arguments: callback "
                            f"must be callable, got {type(callback).__name__}")
        loop = asyncio._get_running_loop()
        if loop is not None:
            self._add_asyncio_callback(loop, callback, context)
            return
        if context is not None:
            callback = functools.partial(context.run, callback)
        self._add_torch_callback(callback)

    def _add_torch_callback(self, callback, prompt: bool = True) -> None:
        """``add_done_callback`` as torch's, from any thread (off I/O threads);
        ``prompt``: run it as soon as the reply comes (see :meth:`_need_reader`)."""

        def run(fut):
            try:
                callback(fut)
            except Exception as exc:  # as torch: logged, and the other callbacks still run
                log.error("Got the following error when running the callback: %s: %s",
                          type(exc).__name__, exc)
        self._queue(run, prompt)

    def _queue(self, run, prompt: bool = True) -> None:
        """Run ``run(self)`` once done, after the callbacks added before it (torch runs a
        future's callbacks in the order they were added; code relies on it, e.g. a
        ``then`` added after an ``add_done_callback`` to wait for it)."""
        with _queue_lock:
            pending = self.__dict__.get("_tw_pending")
            if pending is not None:  # earlier callbacks not run yet: run after them
                pending.append(run)
                return
            arm = not self._completed()
            if arm:
                self._tw_pending = [run]
        if arm:  # outside the lock: a future completing meanwhile drains inline
            super().add_done_callback(lambda _f: _run_off_io(_drain, self))
            if prompt:
                self._need_reader()
        else:
            run(self)  # done and nothing pending: inline, as torch

    def _need_reader(self) -> None:
        """Something will wait for this future without reading its reply itself: a
        connection that lent its reading to callers (``_wire/lending.py``) gives it
        back to its reader."""
        link = self._tw_link
        if link is not None:
            role = link[0].role
            if role.state is _LENT:
                role.reclaim()

    def _read_idle(self, loop) -> bool:
        """A task on ``loop`` (this thread's, running) is about to await this future:
        if the loop has nothing else to do, read the reply here, as ``wait()`` would
        (``_wire/lending.py``), until the loop has (``_idle_loop``): a reply then
        costs one thread wake-up, and no loop turn.  Whether it read."""
        idle = _idle_loop(loop)
        if idle is None or not _may_borrow():
            return False
        link = self._tw_link
        if link is None:  # the reader reads its reply; then it may lend the reading
            self.lends = True
            return False
        conn, deadline, pending = link
        role = conn.role
        if role.state is not _LENT or not role.borrow():
            return False
        _reader.read_borrowed(conn, role, self._completed, deadline,
                              lambda: pending.idle_on(conn), idle[0], idle[1])
        return True

    def _add_inline_callback(self, callback) -> None:
        """Internal: run ``callback(self)`` on whichever thread completes the future,
        I/O threads included.  Only for short, non-blocking bookkeeping."""
        torch._C.Future.add_done_callback(self, callback)

    def wait(self) -> Any:
        """Block until done; return the value or raise the error.

        Unlike torch's future, the error raised is a copy of the stored one: the
        stored exception then never gains a traceback through the waiter's frames,
        which would make an uncollectable cycle (future -> exception -> frame ->
        future, the first link in C++) keeping every local of those frames alive,
        RRefs and tensors included.

        On the main thread the wait is a Python lock's, which Ctrl-C interrupts
        (torch's own wait is a C++ condition variable that does not run signal
        handlers until the call ends).
        """
        try:
            if not self._completed():
                link = self._tw_link
                if link is not None:  # its reply may be read here (SyncReply.wait)
                    conn, deadline, pending = link
                    _read_own_reply(conn, _may_borrow(), self._completed, deadline, pending)
                elif _may_borrow():  # the reader reads it, and may lend for the next
                    self.lends = True
            if not self._completed():
                if threading.get_ident() == _main_ident:
                    done = _allocate_lock()
                    done.acquire()
                    torch._C.Future.add_done_callback(self, lambda _f: done.release())
                    _threads.wait_blocking(done.acquire)
                else:
                    return _threads.wait_blocking(super().wait)
            return super().wait()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise _fresh(exc) from exc.__cause__

    def done(self) -> bool:
        """torch's ``done()``; inside a running asyncio loop also True once cancelled,
        as an asyncio future is (``asyncio.wait`` sorts futures by it)."""
        return _c_done(self) or (self._tw_cancelled
                                 and asyncio._get_running_loop() is not None)

    # The torch side completed (a result or an error), cancelled or not: what callbacks
    # and wait() go by.
    _completed = torch._C.Future.done

    def value(self):
        """The value, or raise the error (a copy, as :meth:`wait`)."""
        try:
            return _c_value(self)
        except BaseException as exc:
            raise _fresh(exc) from exc.__cause__


class SyncReply:
    """The reply of a call whose caller waits for it at once (``rpc_sync``, ``to_here``):
    a lock the reader releases, not a :class:`torch.futures.Future`.  With the caches
    cold, as between messages, creating, completing and waiting on a torch future
    costs tens of microseconds of Python wrappers and C++ around what is a lock
    hand-off.  Completed at most once (the agent pops the pending call first).

    The agent sets ``conn`` (the connection the call went on), ``deadline``,
    ``pending`` (its :class:`~.pending.PendingCalls`) and ``lends`` (the calling
    thread may read replies itself: :func:`_may_borrow`) once the call is sent: the
    caller then reads the reply itself if the connection lends its reading
    (``_wire/lending.py``), and its reply, completed by the reader, lends it."""

    __slots__ = ("_lock", "_value", "_error", "_done", "conn", "deadline", "pending",
                 "lends")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._value = self._error = None
        self.conn = self.deadline = self.pending = None
        self.lends = False  # its waiter may read the reply itself (_may_borrow())

    def set_result(self, value) -> None:
        self._value = value
        self._done = True
        self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        self._error = exc
        self._done = True
        self._lock.release()

    def done(self) -> bool:
        return self._done

    def wait(self) -> Any:
        """Block until done; return the value or raise (a copy of) the error, as
        :meth:`Future.wait`."""
        if not self._done:
            conn = self.conn
            if conn is not None and conn.role is not None:
                _read_own_reply(conn, self.lends, self.done, self.deadline, self.pending)
            if not self._done:
                _threads.wait_blocking(self._lock.acquire)
        error = self._error
        if error is not None:
            raise _fresh(error) from error.__cause__
        return self._value


_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_inference_mode = torch.is_inference_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active


def _may_borrow() -> bool:
    """Whether the calling thread may read its reply itself (``_wire/lending.py``):
    not one of torchwire's threads (they wait as always), and in none of torch's
    thread-local modes that would change how the reply is decoded (a
    ``torch.device`` context made its buffers on that device; inference mode,
    inference tensors; a functorch transform), as on the reader."""
    return not (_threads.in_torchwire_thread() or _function_modes() or _dispatch_modes()
                or _inference_mode() or _functorch_active())


def _read_own_reply(conn, may_borrow: bool, done, deadline, pending) -> None:
    """A waiter on ``conn`` (which lends): read the reply here if its reading is lent
    and this thread may (``_wire/lending.py``); a thread that may not gives a lent
    reading back to the reader."""
    role = conn.role
    if may_borrow:
        if role.borrow():
            _reader.read_borrowed(conn, role, done, deadline,
                                  lambda: pending.idle_on(conn))
    elif role.state is _LENT:
        role.reclaim()


def _idle_loop(loop):
    """``(descriptor of its selector, time.monotonic() of its next timer or None)`` of
    an asyncio selector event loop with nothing ready to run, else None.

    While a task waits in the loop's thread on its reply and this descriptor, the
    loop would only have waited on the same descriptor: every event the loop waits
    for (its sockets, wake-ups from other threads and signal handlers, which write
    its self-pipe) makes it readable, and the wait ends at the loop's next timer.
    Other loops (uvloop, Windows' proactor) and debug mode (which times each step)
    are left alone: they wait for the reader.
    """
    try:
        if loop._ready or loop._debug:
            return None
        fd = loop._selector._selector.fileno()
        scheduled = loop._scheduled
    except AttributeError:  # not asyncio's selector loop
        return None
    until = None
    if scheduled:
        until = time.monotonic() + (scheduled[0]._when - loop.time())
    return fd, until


def add_done_callback(fut, callback, prompt: bool = True) -> None:
    """``fut.add_done_callback(callback)`` with torch's semantics even on a thread that
    runs an asyncio loop: torchwire's own callbacks, which code on that thread may
    block waiting for (a blocking ``to_here`` in a coroutine).  ``prompt=False``:
    bookkeeping that may wait for a lent connection's reader (``_wire/lending.py``)."""
    if isinstance(fut, Future):
        fut._add_torch_callback(callback, prompt)
    else:
        fut.add_done_callback(callback)


_queue_lock = threading.Lock()
_allocate_lock = threading.Lock
_main_ident = threading.main_thread().ident
_c_value = torch._C.Future.value
_c_done = torch._C.Future.done


def _drain(fut: Future) -> None:
    """Run ``fut``'s queued callbacks in order, including any added meanwhile."""
    while True:
        with _queue_lock:
            pending = fut._tw_pending
            if not pending:
                fut._tw_pending = None
                return
            run = pending.pop(0)
        run(fut)


_torch_wait_all = torch.futures.wait_all


def wait_all(futures):
    """``torch.futures.wait_all``, stopping at the first error of a torchwire future.

    torch's version stops early only for errors its C++ futures hold; a future
    completed from Python (torchwire's) holds its error as a value, so torch's would
    wait for every future.  This one raises the first error as soon as it is set,
    as torch does for its own futures.  Lists without a torchwire future go to
    torch's unchanged.  torchwire installs it as ``torch.futures.wait_all``.
    """
    if not any(isinstance(f, Future) for f in futures):
        return _torch_wait_all(futures)
    futures = list(futures)
    lock = threading.Lock()
    finished = threading.Event()
    state = {"left": len(futures), "failed": None}

    def one_done(f) -> None:
        try:
            f.value()
            failed = False
        except BaseException:
            failed = True
        with lock:
            state["left"] -= 1
            if failed and state["failed"] is None:
                state["failed"] = f
            if failed or state["left"] == 0:
                finished.set()

    for f in futures:
        torch._C.Future.add_done_callback(f, one_done)  # inline: bookkeeping only
        if isinstance(f, Future):
            f._need_reader()
    if not finished.is_set():
        _threads.wait_blocking(finished.wait)
    failed = state["failed"]
    if failed is not None:
        failed.wait()  # raises its error
    return [f.wait() for f in futures]


def install_wait_all() -> None:
    torch.futures.wait_all = wait_all


def _fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` without a traceback; ``exc`` loses the frames it gained."""
    exc.__traceback__ = None
    try:
        new = copy.copy(exc)
    except Exception:
        return exc
    if type(new) is not type(exc):
        return exc
    new.__traceback__ = None
    return new
