"""The worker's asyncio event loop: where ``async def`` remote functions run.

A request whose function returns a coroutine (an ``async def`` target, a bound
coroutine method of an RRef's value) is not run to completion on the thread that
called the function: the coroutine becomes a task on this worker's one event loop,
and the pool or reader thread is free at once.  The reply is sent when the task
ends.  Thousands of such calls can be in flight while each awaits (a nested
``await rpc.rpc_async(...)``, ``asyncio.sleep``) with no thread held per call.

Lifecycle of the loop::

    idle  --first coroutine: thread started, loop created-->  running
    running  --stop() (agent shut down): tasks cancelled, loop stopped-->  stopped
    stopped  --start() again-->  RpcStateError (the agent is closed)

The loop thread is marked an I/O thread: a torchwire future completed there hands
its user callbacks to the pool, and replies are written from it only when they
cannot block (see ``serving.py``), so no callback can stall the other tasks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from .._base import intraop as _intraop, threads as _threads
from .._base.errors import RemoteCallError, RpcStateError
from .future import Future

log = logging.getLogger("torchwire")


class CoroutineRunner:
    """One asyncio event loop on a dedicated thread, started on first use.

    Args:
        name: the worker's name (for the thread's name and messages).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._tasks: set[asyncio.Task] = set()  # the loop keeps tasks only weakly

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running" if self._loop else "idle"
        return f"<CoroutineRunner of {self._name} {state} tasks={len(self._tasks)}>"

    def start(self, coro, done: Callable[[asyncio.Task], None]) -> None:
        """Run ``coro`` as a task of the loop; ``done(task)`` runs on the loop thread
        when it ends (it must not block).

        Raises:
            RpcStateError: the agent is shut down (``coro`` is closed unrun).
        """
        loop = self._loop
        if loop is None:
            loop = self._start_loop()
        try:
            loop.call_soon_threadsafe(self._create_task, coro, done)
        except RuntimeError:  # closed between the check and the call
            coro.close()
            raise RpcStateError(f"the event loop of {self._name} is shut down") from None

    def future_of(self, coro) -> Future:
        """Run ``coro`` on the loop; a :class:`Future` of its result or error."""
        fut = Future()

        def settle(task: asyncio.Task) -> None:
            if task.cancelled():
                fut.set_exception(self.cancelled_error())
                return
            exc = task.exception()
            if exc is None:
                fut.set_result(task.result())
            else:
                fut.set_exception(exc)
        self.start(coro, settle)
        return fut

    def cancelled_error(self) -> BaseException:
        """Why a task of this loop ended cancelled: the agent's shutdown cancels them
        all; otherwise the coroutine itself ended in ``CancelledError`` (it raised it,
        or let through that of a task it awaited)."""
        if self._stopped:
            return RpcStateError(f"the coroutine was cancelled: {self._name} is shutting down")
        return RemoteCallError(f"the coroutine was cancelled on {self._name}: it ended in "
                               "asyncio.CancelledError (its own, or that of a task it "
                               "awaited), not by torchwire")

    def _create_task(self, coro, done) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            try:
                done(t)
            except Exception:
                log.exception("torchwire: the reply of a coroutine on %s failed", self._name)
        task.add_done_callback(finished)

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._stopped:
                raise RpcStateError(f"the event loop of {self._name} is shut down")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(loop, ready), daemon=True,
                    name=f"torchwire-{self._name}-asyncio")
                self._thread.start()
                ready.wait()  # a loop that runs: call_soon_threadsafe from now on
                self._loop = loop
            return self._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        _intraop.init_thread()
        _threads.mark_io_thread()
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            while True:
                try:
                    loop.run_forever()
                    return  # stopped (stop())
                except (SystemExit, KeyboardInterrupt) as exc:
                    # asyncio ends the task with it, then raises it out of the loop: the
                    # task's callbacks (its reply) are queued, and the loop serves on
                    log.warning("torchwire: a coroutine raised %s; the loop goes on",
                                type(exc).__name__)
        finally:
            loop.close()

    def stop(self, timeout: float) -> None:
        """Cancel the tasks still running, stop the loop and its thread (bounded)."""
        with self._lock:
            self._stopped = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        def cancel_all() -> None:
            for task in list(self._tasks):
                task.cancel()
            # one more turn: the cancelled tasks run their finally blocks
            loop.call_soon(loop.stop)
        try:
            loop.call_soon_threadsafe(cancel_all)
        except RuntimeError:
            return  # already closed
        if thread is not threading.current_thread():
            thread.join(timeout)

