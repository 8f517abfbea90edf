"""The pool of threads that runs user functions and future callbacks.

``num_worker_threads`` threads are the pool's core.  A pool thread that blocks
on an RPC result (a nested ``rpc_sync``, or ``wait()`` on an RPC future) says so
through :meth:`WorkerPool.blocking`; while it waits, the pool may start an extra
thread so queued work keeps running.  That is what lets nested calls (a user
function calling ``rpc_sync`` back to its caller) work with the default pool
without deadlock.  Extra threads exit after a short idle period.

Idle threads wait on a stack, and work wakes the one that went idle last: its
caches, and the OpenMP team torch keeps per calling thread, are warm.  (A
``Condition`` wakes the longest-waiting thread, so a stream of calls would rotate
through every thread of the pool, each with cold caches.)
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

from .._base import intraop as _intraop, threads as _threads
from .._base.errors import RpcStateError

log = logging.getLogger("torchwire")

_EXTRA_LIMIT = 512  # ceiling on compensating threads; each one stands for a blocked thread
_EXTRA_IDLE_S = 2.0


class WorkerPool:
    """A thread pool with a FIFO queue and blocking compensation."""

    def __init__(self, num_threads: int, name: str = "torchwire-pool") -> None:
        if num_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {num_threads}")
        self._core = num_threads
        self._name = name
        self._lock = threading.Lock()  # `with self._lock` on hot paths (C-level enter)
        self._queue: collections.deque = collections.deque()
        self._idle_stack: list = []  # per-thread locks of idle threads, held while idle
        self._threads = 0
        self._blocked = 0
        self._depth = threading.local()  # .n: the calling thread's nesting in blocking()
        self._stopping = False
        self._all: set[threading.Thread] = set()  # running threads (each leaves on exit)
        self._seq = 0

    def __repr__(self) -> str:
        return (f"<WorkerPool {self._name} threads={self._threads} "
                f"idle={len(self._idle_stack)} "
                f"blocked={self._blocked} queued={len(self._queue)}>")

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._stopping and self._threads == 0:
                raise RpcStateError("pool is shut down")
            self._queue.append((fn, args))
            self._wake_locked(1)

    def submit_many(self, items) -> None:
        """Queue ``(fn, args)`` pairs with one lock round-trip."""
        with self._lock:
            self._queue.extend(items)
            self._wake_locked(len(items))

    def _wake_locked(self, n: int) -> None:
        stack = self._idle_stack
        for _ in range(min(n, len(stack))):
            stack.pop().release()  # the most recently idle thread first
        # Start threads while work waits and fewer than `core` threads are runnable.
        while (len(self._queue) > len(stack) and self._threads - self._blocked < self._core
               and self._threads < self._core + _EXTRA_LIMIT):
            self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._threads += 1
        self._seq += 1
        t = threading.Thread(target=self._run, name=f"{self._name}-{self._seq}", daemon=True)
        self._all.add(t)
        t.start()

    @contextlib.contextmanager
    def blocking(self):
        """Declare that the calling pool thread is about to block on a remote result.

        A thread counts once however deep it nests: a reader on a pool thread (blocked
        for the connection's life) that runs a request in place, hands its reading off
        and then waits for a nested call is one blocked thread.  Counted twice, the
        threads going idle meanwhile saw fewer runnable threads than there were, took
        themselves for core threads, and never retired."""
        local = self._depth
        depth = getattr(local, "n", 0)
        local.n = depth + 1
        if depth:
            try:
                yield
            finally:
                local.n = depth
            return
        with self._lock:
            self._blocked += 1
            if self._queue:
                self._wake_locked(0)
        try:
            yield
        finally:
            local.n = 0
            with self._lock:
                self._blocked -= 1

    def _run(self) -> None:
        _intraop.init_thread()
        _threads.set_current_pool(self)
        queue, lock, stack = self._queue, self._lock, self._idle_stack
        share_thread = _intraop.share_thread
        waiter = threading.Lock()
        waiter.acquire()  # held while running; released by whoever wakes us
        while True:
            with lock:
                while not queue:
                    if self._stopping:
                        self._threads -= 1
                        self._all.discard(threading.current_thread())
                        return
                    extra = self._threads - self._blocked > self._core
                    stack.append(waiter)
                    lock.release()
                    try:
                        woken = waiter.acquire(True, _EXTRA_IDLE_S if extra else -1)
                    finally:
                        lock.acquire()
                    if not woken:
                        if waiter in stack:
                            stack.remove(waiter)
                        else:  # popped and released just after the timeout: take it back
                            waiter.acquire()
                    if (not queue and extra and not self._stopping
                            and self._threads - self._blocked > self._core):
                        self._threads -= 1  # an extra thread retires
                        self._all.discard(threading.current_thread())
                        return
                fn, args = queue.popleft()
            share_thread()
            try:
                fn(*args)
            except BaseException:  # a task must never kill a pool thread
                log.exception("torchwire: uncaught error in pool task %r", fn)
            # Drop the task before idling: its arguments may own receive buffers
            # that should go back to the buffer pool now, not at this thread's next task.
            fn = args = None

    def shutdown(self, timeout: float) -> None:
        """Let queued work finish, then stop every thread (bounded by ``timeout``)."""
        with self._lock:
            self._stopping = True
            while self._idle_stack:
                self._idle_stack.pop().release()
            threads = list(self._all)
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
