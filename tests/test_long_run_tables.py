"""What a long-running worker keeps stays bounded by what is in flight.

* The pool's record of its threads: extra threads started while pool threads wait
  on nested calls retire when idle, and must leave the record too.
* The deadline timer: a call's deadline bucket, emptied when the call completes,
  must go at once, not when the deadline passes (with a one-hour ``rpc_timeout``
  that was one empty bucket per 50 ms that saw a call).
"""

from __future__ import annotations

import time

import pytest

import torchwire.rpc as rpc
from _cluster import run_world, wait_until
from torchwire._agent import pool as _pool
from torchwire._agent.timer import GRANULARITY, DeadlineTimer

pytestmark = pytest.mark.timeout(120)


def _agent():
    return rpc.api._get_current_rpc_agent()


def _work(seconds):
    time.sleep(seconds)  # the work a nested call waits for
    return seconds


def _nested(seconds):
    return rpc.rpc_sync("worker0", _work, args=(seconds,))


def _pool_record():
    p = _agent().pool
    with p._lock:
        return len(p._all), p._threads


def _fast_retirement():
    _pool._EXTRA_IDLE_S = 0.05  # extra threads retire after 50 ms idle, not 2 s


def test_retired_pool_threads_leave_the_pool():
    def body(rank, world_size):
        if rank != 0:
            return None
        rpc.rpc_sync("worker1", _fast_retirement)
        core = _agent().pool._core
        records = []
        for _ in range(4):
            # 3x the pool: its threads block in nested calls, so extra ones start
            futs = [rpc.rpc_async("worker1", _nested, args=(0.05,)) for _ in range(3 * core)]
            assert [f.wait() for f in futs] == [0.05] * len(futs)
            assert wait_until(lambda: rpc.rpc_sync("worker1", _pool_record)[1] <= core + 1, 10)
            records.append(rpc.rpc_sync("worker1", _pool_record))
        return core, records

    core, records = run_world(body, 2, timeout=90)[0]
    for held, running in records:
        assert held == running <= core + 1, records


def test_a_pool_thread_nested_in_blocking_counts_as_one_blocked_thread():
    # A reader on a pool thread is blocked for its connection's life; when it runs a
    # request in place that waits for a nested call, it is still one blocked thread.
    # Counted twice, threads going idle meanwhile took themselves for core threads.
    import threading
    pool = _pool.WorkerPool(2, name="test-pool")
    seen, done = [], threading.Event()

    def task():
        with pool.blocking():
            seen.append(pool._blocked)
            with pool.blocking():
                seen.append(pool._blocked)
            seen.append(pool._blocked)
        seen.append(pool._blocked)
        done.set()

    try:
        pool.submit(task)
        assert done.wait(10)
    finally:
        pool.shutdown(5)
    assert seen == [1, 1, 1, 0], seen


def _timer_sizes():
    return _agent().pending._timer.sizes()


def test_completed_calls_leave_no_deadline_buckets_with_a_long_timeout():
    def body(rank, world_size):
        if rank != 0:
            return None
        t0 = time.monotonic()
        calls = 0
        while time.monotonic() - t0 < 20 * GRANULARITY or calls < 50:
            rpc.rpc_sync("worker1", _work, args=(0,))
            calls += 1
        return _timer_sizes(), calls

    (buckets, heap), calls = run_world(body, 2, rpc_timeout=3600, timeout=90)[0]
    assert buckets <= 1, (buckets, heap, calls)  # at most the last one made, empty
    assert heap <= 2 * buckets + 64, (buckets, heap)


def test_the_timer_heap_is_rebuilt_when_stale_ticks_outnumber_live_buckets():
    expired = []
    timer = DeadlineTimer(expired.extend, name="test-timer")
    try:
        far = time.monotonic() + 3600
        ticks = [timer.add(("k", i), far + i * GRANULARITY) for i in range(1000)]
        assert timer.sizes() == (1000, 1000)
        for i, tick in enumerate(ticks[:-1]):
            timer.cancel(("k", i), tick)
        buckets, heap = timer.sizes()
        assert buckets == 1 and heap <= 2 + 64, (buckets, heap)
        # the live one still expires: move it to now
        timer.cancel(("k", 999), ticks[-1])
        timer.add("soon", time.monotonic())
        assert wait_until(lambda: expired == ["soon"], 5), expired
    finally:
        timer.stop()
