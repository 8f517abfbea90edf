"""One timer thread for every call's deadline.

Deadlines are grouped in buckets of ``GRANULARITY`` seconds, so registering and
cancelling are O(1) set operations and completed calls leave nothing behind
(a plain heap of deadlines would keep one stale entry per finished call until
its deadline passed).  A call expires at most one bucket late.  A bucket emptied by
cancels is dropped at once (the one made last when the next is made: calls made
within its 50 ms reuse it); its tick stays in the heap, which is rebuilt from the
live buckets once stale ticks outnumber them, so what is kept is bounded by the
calls in flight, not by the timeout (a one-hour ``rpc_timeout`` kept one empty
bucket per 50 ms that saw a call: 72 000 after an hour).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time

from .._base import threads as _threads

log = logging.getLogger("torchwire")

GRANULARITY = 0.05
_STALE_SLACK = 64  # stale heap ticks tolerated beyond twice the live buckets


class DeadlineTimer:
    """Calls ``on_expire(keys)`` from its own thread when deadlines pass."""

    def __init__(self, on_expire, name: str = "torchwire-timer") -> None:
        self._on_expire = on_expire
        # One lock; `with self._lock` (C) on the hot paths, the condition only to wait
        # and notify (Condition.__enter__ is a Python-level call).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._buckets: dict[int, set] = {}
        self._heap: list[int] = []
        self._newest = -1  # the tick of the bucket made last
        self._sleep_until = math.inf
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, key, deadline: float) -> int:
        """Register ``key`` to expire at monotonic time ``deadline``; returns its bucket."""
        tick = math.ceil(deadline / GRANULARITY)
        with self._lock:
            buckets = self._buckets
            bucket = buckets.get(tick)
            if bucket is None:
                # the bucket made last, kept while empty for the calls of its 50 ms
                # (no push per call), goes now if nothing is in it
                newest = buckets.get(self._newest)
                if newest is not None and not newest:
                    del buckets[self._newest]
                bucket = buckets[tick] = set()
                self._newest = tick
                heapq.heappush(self._heap, tick)
                if tick * GRANULARITY < self._sleep_until:
                    self._cond.notify()
            bucket.add(key)
        return tick

    def cancel(self, key, tick: int) -> None:
        with self._lock:
            buckets = self._buckets
            bucket = buckets.get(tick)
            if bucket is not None:
                bucket.discard(key)
                if not bucket and tick != self._newest:
                    del buckets[tick]
                    if len(self._heap) > 2 * len(buckets) + _STALE_SLACK:
                        self._heap = list(buckets)  # the live ticks only
                        heapq.heapify(self._heap)

    def sizes(self) -> tuple[int, int]:
        """(buckets, heap entries) held: for tests and debugging."""
        with self._lock:
            return len(self._buckets), len(self._heap)

    def __len__(self) -> int:
        with self._cond:
            return sum(len(b) for b in self._buckets.values())

    def _run(self) -> None:
        _threads.mark_io_thread()
        cond = self._cond
        while True:
            with cond:
                if self._stopped:
                    return
                now = time.monotonic()
                expired: list = []
                heap = self._heap
                while heap and heap[0] * GRANULARITY <= now:
                    bucket = self._buckets.pop(heapq.heappop(heap), None)
                    if bucket:
                        expired.extend(bucket)
                if not expired:
                    wait = heap[0] * GRANULARITY - now if heap else 1.0
                    self._sleep_until = now + wait
                    cond.wait(wait)
                    self._sleep_until = math.inf
                    continue
            try:
                self._on_expire(expired)
            except Exception:
                log.exception("torchwire: error while expiring calls")

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
