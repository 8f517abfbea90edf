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
the value or raises the error, as :meth:`Future.wait` would.  Cancelling the
awaiting task stops the wait at once; the call itself goes on and its late reply
completes the future, which nothing reads.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import weakref
from typing import Any

import torch

from .._base import threads as _threads
from .._base.errors import CallbackError, RpcStateError
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


class Future(torch.futures.Future):
    """A :class:`torch.futures.Future` whose callbacks stay off I/O threads."""

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

    def add_done_callback(self, callback) -> None:
        if not callable(callback):
            raise TypeError(f"add_done_callback(): incompatible function arguments: callback "
                            f"must be callable, got {type(callback).__name__}")

        def run(fut):
            try:
                callback(fut)
            except Exception as exc:  # as torch: logged, and the other callbacks still run
                log.error("Got the following error when running the callback: %s: %s",
                          type(exc).__name__, exc)
        self._queue(run)

    def _queue(self, run) -> None:
        """Run ``run(self)`` once done, after the callbacks added before it (torch runs a
        future's callbacks in the order they were added; code relies on it, e.g. a
        ``then`` added after an ``add_done_callback`` to wait for it)."""
        with _queue_lock:
            pending = self.__dict__.get("_tw_pending")
            if pending is not None:  # earlier callbacks not run yet: run after them
                pending.append(run)
                return
            arm = not self.done()
            if arm:
                self._tw_pending = [run]
        if arm:  # outside the lock: a future completing meanwhile drains inline
            super().add_done_callback(lambda _f: _run_off_io(_drain, self))
        else:
            run(self)  # done and nothing pending: inline, as torch


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
        """
        try:
            if not self.done():
                return _threads.wait_blocking(super().wait)
            return super().wait()
        except BaseException as exc:
            raise _fresh(exc) from exc.__cause__

    def __await__(self):
        """``await fut``: the value, or raise the error, without blocking the loop."""
        if not self.done():
            yield from _wake_on_done(self).__await__()
        return self.value()

    def value(self):
        """The value, or raise the error (a copy, as :meth:`wait`)."""
        try:
            return super().value()
        except BaseException as exc:
            raise _fresh(exc) from exc.__cause__


class SyncReply:
    """The reply of a call whose caller waits for it at once (``rpc_sync``, ``to_here``):
    a lock the reader releases, not a :class:`torch.futures.Future`.  With the caches
    cold, as between messages, creating, completing and waiting on a torch future
    costs tens of microseconds of Python wrappers and C++ around what is a lock
    hand-off.  Completed at most once (the agent pops the pending call first)."""

    __slots__ = ("_lock", "_value", "_error", "_done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._value = self._error = None

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
            _threads.wait_blocking(self._lock.acquire)
        error = self._error
        if error is not None:
            raise _fresh(error) from error.__cause__
        return self._value


_queue_lock = threading.Lock()


def _wake_on_done(fut: Future) -> asyncio.Future:
    """An asyncio future of the running loop, set when ``fut`` is done.

    The torch future's callback runs on whichever thread completes it (a reader,
    the timer): it only queues the wake-up for the loop, which never blocks.
    """
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    waker = _wakers.get(loop)
    if waker is None:
        waker = _wakers.setdefault(loop, _LoopWaker(loop))
    fut._add_inline_callback(lambda _f: waker.wake(waiter))
    return waiter


class _LoopWaker:
    """Wakes one loop's waiters from other threads, many with one ``call_soon_threadsafe``.

    Every ``call_soon_threadsafe`` writes to the loop's self-pipe: with thousands of
    calls awaited at once, replies arriving while a wake-up is already queued join it
    instead (one system call and one loop turn for the lot).
    """

    __slots__ = ("_loop", "_lock", "_ready", "_armed", "__weakref__")

    def __init__(self, loop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list = []
        self._armed = False

    def wake(self, waiter: asyncio.Future) -> None:
        with self._lock:
            self._ready.append(waiter)
            if self._armed:
                return
            self._armed = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing waits any more
            pass

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._armed = False
        for waiter in ready:
            if not waiter.done():  # a cancelled waiter stays cancelled
                waiter.set_result(None)


_wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
