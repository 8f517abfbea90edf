"""Inline runs: a reader runs a few requests itself instead of handing them to the pool.

Lazy leader/follower.  When a read leaves a few requests and an empty buffer, the
agent's ``on_frames`` runs them on the reading thread, in order
(:meth:`InlineScheduler.run`): they skip the reader -> pool hand-off on their way to
execution.  Meanwhile nobody reads the connection, so the reading is handed to a
pool thread (``spawn(conn.read_loop)``: a fresh buffer, as at rest there is no
state to pass; the requests not started yet go to the pool) as soon as the running
request blocks on a torchwire result (``Future.wait``, ``to_here``, ``wait_all``:
``_base.threads.before_blocking``) or has run ``INLINE_MAX_S`` (the watchdog).
Requests that finish first, the usual case, cost no thread wake-up at all; after a
hand-off the reading thread is done reading.

A run takes its first request before the watchdog sees it, and the ``next()`` that
finds no more ends it: two lock rounds per lone request.

The watchdog (one thread per process) polls every ``INLINE_MAX_S / 2`` while some
run is in progress.  Waking it is itself a thread switch and a GIL hand-over on the
call's path, so a connection whose last ``_TRUST_AFTER`` runs each took under
``_FAST_S`` is *trusted*: its runs only register, and the watchdog, polling every
``_IDLE_POLL_S`` between runs (asleep after ``_DEEP_AFTER_S`` without any), still
hands off a trusted run that blocks after all, at most that much later.  One slower
run ends the trust.

States of one run (``_InlineRun``)::

    RUNNING --next() finds no request, or the run raised-->  DONE
    RUNNING --before_blocking() or the watchdog: hand_off()-->  HANDED
                (the rest to the pool, the reading to spawn(conn.read_loop))
    HANDED  --its current request returns-->  DONE (the thread stops reading)
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

from .._base import intraop as _intraop, threads as _threads

log = logging.getLogger("torchwire")

INLINE_MAX_S = 0.002  # a request running in place longer than this hands the reading off
# A connection whose last _TRUST_AFTER inline runs each took under _FAST_S runs the
# next ones without waking the watchdog (see _Watchdog); one slower run ends that.
_FAST_S = INLINE_MAX_S / 2
_TRUST_AFTER = 16
_IDLE_POLL_S = 0.05  # the watchdog's poll between runs (bounds a trusted run's stall)
_DEEP_AFTER_S = 1.0  # without any run this long, the watchdog sleeps until the next


class InlineScheduler:
    """Runs a reader's requests in place; one per agent.

    Args:
        defer: ``defer(fn, *args)`` queues a request on the pool.
        spawn: ``spawn(read_loop)`` goes on reading on a pool thread.
    """

    def __init__(self, defer, spawn) -> None:
        self.defer = defer
        self.spawn = spawn
        self._quick: dict = {}  # connection -> its consecutive quick runs (trust)

    def __repr__(self) -> str:
        return f"<InlineScheduler {inline_stats()}>"

    def run(self, conn, requests) -> bool:
        """Run ``requests`` (``(function, args)``) in order on this reading thread.

        Returns:
            True if the reading was handed off meanwhile: this thread must then stop
            reading ``conn`` (the requests not started by then went to the pool).
        """
        _intraop.share_thread()
        run = _InlineRun(self, conn, requests)
        t0 = run.started
        quick = self._quick
        try:  # this thread reads conn: the count is its own until it hands the reading off
            n_quick = quick[conn]
        except KeyError:  # its first run, or its first since a hand-off
            n_quick = 0
        # the first request is taken before the watchdog sees the run (nobody else can)
        fn, args = run.rest.popleft()
        _watchdog.begin(run, n_quick >= _TRUST_AFTER)
        local = _threads._local  # (set_io / set_inline_run, without two calls each)
        local.io = False
        local.inline = run
        try:
            while fn is not None:
                try:
                    fn(*args)
                except Exception:  # requests report their own errors; this is a bug
                    log.exception("torchwire: request from rank %s failed in place",
                                  conn.peer_rank)
                fn = args = None
                fn, args = run.next()
        finally:
            local.inline = None
            local.io = True
            if not run.done:  # left by an exception: the run is over all the same
                _watchdog.end(run)
        handed = run.handed
        if handed:  # (this thread reads conn no more: it must not re-add conn once closed)
            quick.pop(conn, None)
        else:  # this thread still reads conn: forget() comes after this
            quick[conn] = 0 if time.monotonic() - t0 >= _FAST_S else n_quick + 1
        return handed

    def forget(self, conn) -> None:
        """``conn`` is closed: drop what is known of its runs."""
        self._quick.pop(conn, None)


class _InlineRun:
    """Requests a reader thread runs in place (see the module docstring)."""

    __slots__ = ("sched", "conn", "rest", "started", "handed", "done")

    def __init__(self, sched: InlineScheduler, conn, requests) -> None:
        self.sched = sched
        self.conn = conn
        self.rest = collections.deque(requests)
        self.started = time.monotonic()  # of the request running now
        self.handed = False
        self.done = False

    def next(self) -> tuple:
        """``(function, args)`` of the next request to run here; or ``(None, None)``
        when all are done or the rest were handed off: the run is then over."""
        with _watchdog.lock:
            if self.handed or not self.rest:
                self.done = True
                _watchdog.runs.discard(self)
                return None, None
            self.started = time.monotonic()
            return self.rest.popleft()

    def hand_off(self) -> None:
        """Have another thread go on reading the connection (at most once); the
        requests not started yet go to the pool."""
        with _watchdog.lock:
            if self.handed or self.done:
                return
            self.handed = True
            _watchdog.runs.discard(self)
            _watchdog.handed += 1
            rest, self.rest = list(self.rest), collections.deque()
        try:
            for fn, args in rest:
                self.sched.defer(fn, *args)
            self.sched.spawn(self.conn.read_loop)
        except Exception:  # the pool is shut down: the connection is closing anyway
            log.debug("torchwire: no thread to go on reading rank %s", self.conn.peer_rank,
                      exc_info=True)


class _Watchdog:
    """Hands the reading off for inline runs that take longer than ``INLINE_MAX_S``
    (see the module docstring for when it polls)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.runs: set = set()
        self.idle = False  # between runs, polling slowly: wake it for untrusted runs
        self.deep = False  # asleep until a run begins: wake it for every run
        self.pid = -1
        self.started = 0  # inline runs begun
        self.woken = 0  # of which woke the thread
        self.handed = 0  # of which handed their reading off

    def begin(self, run: _InlineRun, trusted: bool) -> None:
        if self.pid != _pid[0]:
            self._start()
        with self.lock:
            self.started += 1
            self.runs.add(run)
            if self.deep or (self.idle and not trusted):
                self.idle = self.deep = False
                self.woken += 1
                self.cond.notify()

    def end(self, run: _InlineRun) -> bool:
        with self.lock:
            run.done = True
            self.runs.discard(run)
            return run.handed

    def _start(self) -> None:
        with _start_lock:
            if self.pid == _pid[0]:
                return
            self.lock = threading.Lock()  # after a fork: the parent's may be held
            self.cond = threading.Condition(self.lock)
            self.runs = set()
            self.idle = self.deep = False
            threading.Thread(target=self._run, daemon=True, name="torchwire-watchdog").start()
            self.pid = _pid[0]

    def _run(self) -> None:
        _threads.mark_io_thread()
        period = INLINE_MAX_S / 2
        while True:
            with self.lock:
                quiet_since = None
                while not self.runs:
                    now = time.monotonic()
                    if quiet_since is None:
                        quiet_since = now
                    if now - quiet_since >= _DEEP_AFTER_S:
                        self.deep = True
                        self.cond.wait()
                        quiet_since = None
                    else:
                        self.idle = True
                        self.cond.wait(_IDLE_POLL_S)
                    self.idle = self.deep = False
            time.sleep(period)
            now = time.monotonic()
            with self.lock:
                late = [r for r in self.runs if now - r.started >= INLINE_MAX_S]
            for run in late:
                run.hand_off()
            # this thread outlives agents: its locals must not keep the last one alive
            late = run = None


_pid = [os.getpid()]  # this process's pid (os.getpid() is a system call)
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))
_start_lock = threading.Lock()
_watchdog = _Watchdog()


def inline_stats() -> dict:
    """Inline runs (requests run in place by a reader), how many of them woke the
    watchdog, and how many handed the reading off."""
    return {"runs": _watchdog.started, "woke_watchdog": _watchdog.woken,
            "handed_off": _watchdog.handed}
