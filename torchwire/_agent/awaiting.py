"""asyncio on torchwire's futures: ``await fut``, and asyncio's future interface.

The reply that completes a future arrives on a reader thread; what waits for it in
asyncio runs on its event loop's thread.  Two costs sit on that path, and this
module keeps both small:

- **The wake-up.**  ``loop.call_soon_threadsafe`` writes to the loop's self-pipe, a
  unix socket pair, and waking a thread asleep in ``epoll_wait`` through a socket
  costs the writer several times what an ``eventfd`` write does.  Each loop gets one
  :class:`LoopWaker` with its own eventfd, watched with ``loop.add_reader``;
  completions that arrive while a wake-up is pending join it (one write, one loop
  turn for thousands).  A loop without ``add_reader`` (Windows' proactor), or a
  platform without eventfd, falls back to ``call_soon_threadsafe``.
- **The resumption.**  An ``asyncio.Future`` as the waiter would take a loop turn to
  be set and another to resume its task.  :class:`Waiter` is what ``await`` yields
  to the task instead: a future-compatible object that keeps the task's wake-up
  callback and calls it when drained, in the same loop turn.
- **Both, skipped.**  A task awaiting a call whose connection lent its reading,
  while its loop has nothing else to do, reads the reply on the loop's thread
  before suspending (``Future._read_idle``, ``_wire/lending.py``), and the await
  returns without a loop turn.

:class:`AsyncioFuture` gives torchwire's future asyncio's interface inside a
running loop, so ``asyncio.gather`` and ``wait`` take it without a task each.

One waiter (``await fut``)::

    PENDING --fut completes, drained on the loop-->  DONE       (task resumed)
    PENDING --fut.cancel(), drained on the loop-->  DONE       (task resumed; the
                                                                 await raises
                                                                 CancelledError)
    PENDING --cancel(): the task is cancelled----->  CANCELLED  (task resumed with
                                                                 CancelledError)

One future, seen from asyncio::

    PENDING --set_result / set_exception-->  DONE       (asyncio callbacks run)
    PENDING --cancel()--------------------->  CANCELLED  (asyncio callbacks run; the
                                                          call goes on, and its reply
                                                          still completes the torch
                                                          side: wait(), value())

Each ends once; a late wake-up of an ended waiter or callback does nothing.  A
loop's eventfd is closed when the loop is collected.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import weakref

import torch

_PENDING, _DONE, _CANCELLED = 0, 1, 2
_HAS_EVENTFD = hasattr(os, "eventfd")


class Waiter:
    """What ``await fut`` yields to the awaiting task while ``fut`` is not done."""

    __slots__ = ("_loop", "waker", "_state", "_callback", "_context", "_msg",
                 "_asyncio_future_blocking")

    def __init__(self, loop, waker) -> None:
        self._loop = loop
        self.waker = waker  # the loop's LoopWaker: it hands wake() to the loop
        self._state = _PENDING
        self._callback = None
        self._context = None
        self._msg = None
        self._asyncio_future_blocking = False

    # the part of asyncio's future interface a task uses
    def get_loop(self):
        return self._loop

    def add_done_callback(self, fn, *, context=None) -> None:
        if self._state != _PENDING or self._callback is not None:
            self._loop.call_soon(fn, self, context=context)
            return
        self._callback, self._context = fn, context

    def remove_done_callback(self, fn) -> int:
        if self._callback is not None and self._callback == fn:
            self._callback = self._context = None
            return 1
        return 0

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def cancel(self, msg=None) -> bool:
        if self._state != _PENDING:
            return False
        self._state, self._msg = _CANCELLED, msg
        self._schedule()
        return True

    def result(self):
        if self._state == _CANCELLED:
            raise asyncio.CancelledError(*(() if self._msg is None else (self._msg,)))
        if self._state != _DONE:
            raise asyncio.InvalidStateError("the awaited future is not done")
        return None

    def exception(self):
        if self._state == _CANCELLED:
            self.result()
        return None

    def _schedule(self) -> None:
        callback = self._callback
        if callback is not None:
            self._callback = None
            self._loop.call_soon(callback, self, context=self._context)

    def wake(self) -> None:
        """On the loop's thread: the future is done; resume the task now."""
        if self._state != _PENDING:
            return  # cancelled meanwhile: the task was resumed by cancel()
        self._state = _DONE
        callback, context = self._callback, self._context
        if callback is None:
            return
        self._callback = self._context = None
        try:
            if context is None:
                callback(self)
            else:
                context.run(callback, self)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # as a loop reports a failed callback
            self._loop.call_exception_handler({
                "message": "torchwire: resuming an awaiting task failed",
                "exception": exc})


class LoopWaker:
    """Wakes one loop's waiters from other threads, many with one wake-up."""

    __slots__ = ("_loop", "_lock", "_ready", "_armed", "_fd", "__weakref__")

    def __init__(self, loop) -> None:
        self._loop = weakref.ref(loop)  # the table of wakers must not keep loops alive
        self._lock = threading.Lock()
        self._ready: list = []
        self._armed = False
        self._fd = -1
        if _HAS_EVENTFD:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                loop.add_reader(fd, self._drain)
            except NotImplementedError:
                os.close(fd)
            else:
                self._fd = fd
                weakref.finalize(loop, self.close)

    def wake(self, waiter: Waiter) -> None:
        """Any thread: resume ``waiter``'s task on its loop."""
        with self._lock:
            self._ready.append(waiter)
            if self._armed:
                return
            self._armed = True
            if self._fd >= 0:  # open until the loop is collected; written under the lock
                os.eventfd_write(self._fd, 1)
                return
        loop = self._loop()
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nothing waits any more
                pass

    def _drain(self) -> None:
        """On the loop: resume every ready waiter's task, those woken meanwhile too.

        The waker stays armed while tasks run (wake-ups only queue); the eventfd is
        read, and the waker disarmed, once nothing is left, under the lock: a wake-up
        after that writes again.  Reading it after the tasks ran keeps the read off
        the path from reply to resumed task.
        """
        while True:
            with self._lock:
                ready, self._ready = self._ready, []
                if not ready:
                    if self._fd >= 0:
                        try:
                            os.eventfd_read(self._fd)
                        except BlockingIOError:
                            pass
                    self._armed = False
                    return
            for waiter in ready:
                waiter.wake()

    def close(self) -> None:
        """Close the eventfd (the loop is closed or gone)."""
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)


_wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def waker_of(loop) -> LoopWaker:
    """The waker of ``loop`` (created on first use, on the loop's thread)."""
    waker = _wakers.get(loop)
    if waker is None:
        with _wakers_lock:
            waker = _wakers.get(loop)
            if waker is None:
                waker = _wakers[loop] = LoopWaker(loop)
    return waker


class _DoneCallback:
    """A callback added the asyncio way (from a running loop, or with ``context``):
    run once, on its loop, with the future."""

    __slots__ = ("waker", "loop", "future", "fn", "context", "fired")

    def __init__(self, waker, loop, future, fn, context) -> None:
        self.waker, self.loop, self.future, self.fn = waker, loop, future, fn
        self.context = contextvars.copy_context() if context is None else context
        self.fired = False

    def wake(self) -> None:
        if self.fired:
            return
        self.fired = True
        try:
            self.context.run(self.fn, self.future)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # as a loop reports a failed callback
            self.loop.call_exception_handler({
                "message": f"Exception in callback {self.fn!r}", "exception": exc,
                "future": self.future})


class AsyncioFuture:
    """asyncio's future interface on torchwire's :class:`~.future.Future`.

    Inside a running loop the future *is* an asyncio future (``asyncio.isfuture``):
    ``asyncio.gather``, ``wait``, ``wait_for`` and ``shield`` take it as it is,
    without wrapping each in a task.  Outside one it is not (a loop not yet running,
    as in ``run_until_complete(fut)``, wraps it in a task as before).

    Cancelling it (``fut.cancel()``, or cancelling what waits on it: a gather, a
    ``wait_for``) ends the asyncio side only: its asyncio callbacks run and see it
    cancelled, ``result()`` and ``await`` raise ``CancelledError``.  The call itself
    goes on; its reply completes the torch side (``wait()``, ``value()``), which
    nothing may read.
    """

    __slots__ = ()
    # Read as class defaults until set: reading ``__dict__`` would create one per future.
    _tw_awaited = None  # [Waiter or _DoneCallback] to wake once it ends
    _tw_cancelled = False
    _tw_cancel_msg = None

    @property
    def _asyncio_future_blocking(self):
        return None if asyncio._get_running_loop() is None else False

    def get_loop(self):
        return asyncio.get_running_loop()

    def __await__(self):
        """``await fut``: the value, or raise the error, without blocking the loop."""
        if self._tw_cancelled:
            raise self._make_cancelled_error()
        if not _c_done(self):
            loop = asyncio.get_running_loop()
            if self._read_idle(loop) and _c_done(self):  # read on this thread
                if self._tw_cancelled:
                    raise self._make_cancelled_error()
                return self.value()
            waiter = Waiter(loop, waker_of(loop))
            awaited = self._awaited()
            awaited.append(waiter)
            # set_result and cancel wake the registered waiters after completing:
            # checked again here, one of the two sees the other
            if not _c_done(self) and not self._tw_cancelled:
                waiter._asyncio_future_blocking = True
                try:
                    yield waiter  # the task resumes here once woken
                finally:
                    if waiter._state != _DONE:  # its task was cancelled, or closed
                        _discard(awaited, waiter)
            if self._tw_cancelled:
                raise self._make_cancelled_error()
        return self.value()

    def _read_idle(self, loop) -> bool:
        """About to wait on ``loop``: read the reply on the loop's thread while it
        has nothing else to do; whether it tried (torchwire's future does)."""
        return False

    def _awaited(self) -> list:
        """The waiters and asyncio callbacks to wake once it ends (made on first use);
        the loop will not read the reply itself (``Future._need_reader``)."""
        awaited = self._tw_awaited
        if awaited is None:
            awaited = self.__dict__.setdefault("_tw_awaited", [])
        self._need_reader()
        return awaited


    def set_result(self, result) -> None:
        """Complete the future (torch's ``set_exception`` ends here too), then wake
        the tasks awaiting it and run its asyncio callbacks."""
        _c_set_result(self, result)
        awaited = self._tw_awaited
        if awaited:
            _wake_all(awaited)

    def _add_asyncio_callback(self, loop, fn, context) -> None:
        """``fn(self)`` on ``loop`` once done or cancelled (``loop`` is running)."""
        entry = _DoneCallback(waker_of(loop), loop, self, fn, context)
        if _c_done(self) or self._tw_cancelled:  # run it on the next loop turn, as asyncio
            entry.waker.wake(entry)
            return
        awaited = self._awaited()
        awaited.append(entry)
        if _c_done(self) or self._tw_cancelled:  # ended meanwhile: who removes it runs it
            try:
                awaited.remove(entry)
            except ValueError:
                return  # the completer took it
            entry.waker.wake(entry)

    def remove_done_callback(self, fn) -> int:
        """Remove the asyncio callbacks ``fn``; their number."""
        removed = 0
        awaited = self._tw_awaited or []
        for entry in list(awaited):
            if isinstance(entry, _DoneCallback) and entry.fn == fn:
                try:
                    awaited.remove(entry)
                except ValueError:
                    continue
                entry.fired = True
                removed += 1
        return removed

    def cancel(self, msg=None) -> bool:
        if _c_done(self) or self._tw_cancelled:
            return False
        self._tw_cancel_msg = msg
        self._tw_cancelled = True
        awaited = self._tw_awaited
        if awaited:
            _wake_all(awaited)
        return True

    def cancelled(self) -> bool:
        return bool(self._tw_cancelled)

    def _make_cancelled_error(self):
        msg = self._tw_cancel_msg
        return asyncio.CancelledError() if msg is None else asyncio.CancelledError(msg)

    def result(self):
        """asyncio's ``result()``: the value, or raise the error."""
        if self._tw_cancelled or not _c_done(self):
            self._not_ready()
        return self.value()

    def exception(self):
        """asyncio's ``exception()``: the error, or None."""
        if self._tw_cancelled or not _c_done(self):
            self._not_ready()
        try:
            self.value()
        except Exception as exc:
            return exc
        return None

    def _not_ready(self):
        if self._tw_cancelled:
            raise self._make_cancelled_error()
        raise asyncio.InvalidStateError("Result is not ready.")


_c_set_result = torch._C.Future.set_result
_c_done = torch._C.Future.done  # the torch side: set_result or set_exception happened


def _wake_all(awaited: list) -> None:
    """Hand each waiter and callback of a future that just ended to its loop, in the
    order they came (each taken once: another thread may take some)."""
    while awaited:
        try:
            entry = awaited.pop(0)
        except IndexError:  # another thread took the last one
            return
        entry.waker.wake(entry)


def _discard(awaited: list, entry) -> None:
    try:
        awaited.remove(entry)
    except ValueError:  # taken by the thread that ended the future
        pass
