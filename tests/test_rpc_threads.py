"""Threads: nested calls back to the caller on the default pool, async_execution
holding no pool thread, a reader running a lone request in place without starving
the next, a thread-safe API, a slow function not stalling its connection, and
torch's intra-op thread pool in forked workers (no race on first use, each worker's
share of the host's CPUs)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world, wait_until
from test_rpc import add


# ---------------------------------------------------------------- threading

def nested_back(to, depth):
    if depth == 0:
        return rpc.get_worker_info().name
    return rpc.rpc_sync(to, nested_back, args=(rpc.get_worker_info().name, depth - 1))


def body_nested():
    # worker0 -> worker1 -> worker0 -> worker1 ..., 48 chains at once: 3x the pool size
    futs = [rpc.rpc_async("worker1", nested_back, args=("worker0", 4)) for _ in range(48)]
    return torch.futures.wait_all(futs)


def test_nested_calls_back_to_caller_with_default_pool(world):
    assert world.run(0, body_nested, timeout=90) == ["worker1"] * 48


_events: dict = {}


@rpc.functions.async_execution
def async_wait_for_release(key):
    fut = torch.futures.Future()
    _events.setdefault(key, []).append(fut)
    return fut


def release(key, value):
    futs = _events.pop(key, [])
    for f in futs:
        f.set_result(value)
    return len(futs)


def pool_threads():
    """Pool threads, and how many connections this worker reads (a reader may be one)."""
    agent = rpc.api._get_current_rpc_agent()
    connections = len(agent.links.all())
    return sum(t.name.startswith("torchwire-worker") for t in threading.enumerate()), connections


def parked(key):
    return len(_events.get(key, []))


def body_async_holds_no_thread():
    n = 64  # four times the pool size: would deadlock if each held a pool thread
    before = rpc.rpc_sync("worker3", pool_threads)  # earlier tests may have left idle ones
    futs = [rpc.rpc_async("worker3", async_wait_for_release, args=("k",)) for _ in range(n)]
    # an ordinary call still gets served while 64 async calls are parked
    assert rpc.rpc_sync("worker3", add, args=(1, 1)) == 2
    threads = rpc.rpc_sync("worker3", pool_threads)
    # the pool runs requests concurrently: a parking call may start after these two
    assert wait_until(lambda: rpc.rpc_sync("worker3", parked, args=("k",)) == n, 30)
    released = rpc.rpc_sync("worker3", release, args=("k", 7))
    return released, torch.futures.wait_all(futs), before, threads


def test_async_execution_holds_no_pool_thread(world):
    released, values, before, threads = world.run(0, body_async_holds_no_thread)
    assert released == 64 and values == [7] * 64, (released, values)
    (before, _), (threads, connections) = before, threads
    # not one per parked call: the pool's 16 (or what it already had), a reader per link
    assert threads <= max(before, 16) + connections, (before, threads, connections)


_gates: dict = {}
_waiting: set = set()


def wait_for_gate(key):
    """Blocks on a plain threading.Event (nothing torchwire knows of) until
    ``open_gate(key)`` runs, at most 20 s; True if it was opened."""
    gate = _gates.setdefault(key, threading.Event())
    _waiting.add(key)
    return gate.wait(20)


def waits_at_gate(key):
    return key in _waiting


def open_gate(key):
    _gates.setdefault(key, threading.Event()).set()
    return True


def inline_stats():
    from torchwire._agent.inline import inline_stats
    return inline_stats()


def body_reader_runs_requests_in_place():
    # A lone request runs on the reader thread that read it (no thread wake-up).
    # Meanwhile nobody reads that connection, so a request that blocks where
    # torchwire cannot see it must still let the next request in: the watchdog
    # hands the reading to another thread.  Without it, open_gate would only be
    # read after wait_for_gate gave up 20 s later, and it would return False.
    before = rpc.rpc_sync("worker1", inline_stats)
    for _ in range(200):
        rpc.rpc_sync("worker1", add, args=(1, 1))
        time.sleep(0.002)  # pacing: each call then finds the watchdog between runs
    quick = rpc.rpc_sync("worker1", inline_stats)
    waiting = rpc.rpc_async("worker1", wait_for_gate, args=("g1",))
    # it runs in place (alone on the connection): asking whether it started is the
    # next request, which the watchdog's hand-off lets in
    assert wait_until(lambda: rpc.rpc_sync("worker1", waits_at_gate, args=("g1",)), 30)
    opened = rpc.rpc_sync("worker1", open_gate, args=("g1",))
    return before, quick, opened, waiting.wait(), rpc.rpc_sync("worker1", inline_stats)


def test_a_reader_runs_a_lone_request_in_place_and_never_starves_the_next(world):
    before, quick, opened, gate_seen, after = world.run(0, body_reader_runs_requests_in_place)
    runs = quick["runs"] - before["runs"]
    handed = quick["handed_off"] - before["handed_off"]
    assert runs >= 150, (before, quick)  # most of the 200 calls ran in place ...
    assert handed <= runs // 4, (before, quick)  # ... and finished without a hand-off
    # Once the connection's runs proved quick, they stop waking the watchdog thread
    # (a thread switch and a GIL hand-over per call): the blocked request below is
    # then caught by its slow poll, and still handed off.
    woke = quick["woke_watchdog"] - before["woke_watchdog"]
    assert woke <= runs // 2, (before, quick)  # 16 runs to earn trust; ~all without it
    assert opened and gate_seen, "a request blocked in place kept the next one from running"
    assert after["handed_off"] > quick["handed_off"], (quick, after)


def body_many_threads():
    errors, results = [], []
    lock = threading.Lock()

    def user(tid):
        try:
            for i in range(150):
                to = f"worker{1 + (tid + i) % 3}"
                if i % 2:
                    v = rpc.rpc_sync(to, add, args=(tid, i))
                else:
                    v = rpc.rpc_async(to, add, args=(tid, i)).wait()
                assert v == tid + i
            with lock:
                results.append(tid)
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=user, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return sorted(results), errors


def test_api_is_thread_safe(world):
    results, errors = world.run(0, body_many_threads)
    assert errors == []
    assert results == list(range(8))


def body_slow_call_does_not_stall_connection():
    slow = rpc.rpc_async("worker2", wait_for_gate, args=("slow",))
    # asking whether it blocks is itself a call on the same connection
    assert wait_until(
        lambda: rpc.rpc_sync("worker2", waits_at_gate, args=("slow",), timeout=10), 15)
    # a stalled connection fails these at their timeout (the gate holds up to 20 s)
    fast = [rpc.rpc_sync("worker2", add, args=(i, 1), timeout=10) for i in range(20)]
    blocked = not slow.done()
    rpc.rpc_sync("worker2", open_gate, args=("slow",), timeout=10)
    return fast, blocked, slow.wait()


def test_slow_function_does_not_stall_its_connection(world):
    # the slow call arrives alone on the connection, so it runs on the thread that read
    # it; reading must already have moved to another thread
    fast, blocked, opened = world.run(0, body_slow_call_does_not_stall_connection)
    assert fast == [i + 1 for i in range(20)]
    assert blocked  # all 20 answered while the slow call still waited at its gate
    assert opened


# ---------------------------------------------------------------------------
# torch's intra-op thread pool in a forked worker

_fork = __import__("multiprocessing").get_context("fork")


def _first_parallel_ops_together(q, init):
    # A forked child of a process that set torch's thread count (conftest does): torch
    # marked its pthreadpool as one to replace, and each thread's first parallel op
    # replaces it; threads doing so at once race.  Threads that ran
    # _intraop.init_thread() when they started (as torchwire's do) do not: with it
    # made a no-op, this test failed in 4 runs of 4 ("pool INTERNAL ASSERT FAILED ...
    # Invalid thread pool!"), the end-to-end one below in 3 of 4, and ./run compat
    # in 2 of ~24 runs (torch's reinforcement-learning example).
    from torchwire._base import intraop as _intraop
    errors = []
    start = threading.Barrier(6)

    def first_op():
        if init:
            _intraop.init_thread()
        start.wait()
        try:
            torch.randn(64, 100).softmax(1)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(repr(exc))
    threads = [threading.Thread(target=first_op) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put(errors)


def test_threads_that_init_at_start_never_race_for_torchs_thread_pool_after_fork():
    q = _fork.Queue()
    failures = []
    for _ in range(100):
        p = _fork.Process(target=_first_parallel_ops_together, args=(q, True))
        p.start()
        failures += q.get(timeout=30)
        p.join(30)
        assert p.exitcode == 0
    assert failures == []


_together = {}


def parallel_op_together(n):
    # n requests meet here, each on its own thread of the worker, then each runs its
    # thread's first parallel op at the same moment
    barrier = _together.setdefault(n, threading.Barrier(n, timeout=20))
    barrier.wait()
    return float(torch.randn(64, 100).softmax(1).sum())


def test_concurrent_first_parallel_ops_on_a_forked_workers_threads_succeed():
    # End to end: each of torchwire's threads does torch's per-thread set-up as it
    # starts, so requests' first parallel ops on a forked worker never race for it.
    def body(rank, world_size):
        if rank != 0:
            return None
        futs = [rpc.rpc_async("worker1", parallel_op_together, args=(6,)) for _ in range(6)]
        return [f.wait() for f in futs]
    for _ in range(3):  # a fresh job each time: fresh threads
        sums = run_world(body, 2)[0]
        assert sums == pytest.approx([64.0] * 6)


def served_thread_settings():
    """The intra-op threads a request may use on the thread that serves it (torch's count,
    MKL's), and a parallel op's result there."""
    from test_autograd_engine import _mkl_threads
    return (torch.get_num_threads(), _mkl_threads(),
            float(torch.ones(64, 1000).softmax(1).sum()))


def served_thread_settings_with(t):
    """:func:`served_thread_settings` in a request that carries ``t``."""
    return served_thread_settings()[:2], t.numel()


def test_requests_use_this_workers_share_of_the_hosts_cpus():
    # Two workers on this host, torch set to 2 intra-op threads in each: the threads
    # that serve requests use at most CPUs // 2 (as torch's launcher sets
    # OMP_NUM_THREADS=1 for several processes per host); the user's thread keeps 2.
    def body(rank, world_size, init_method):
        import os

        from _cluster import options
        from torchwire._base import intraop as _intraop
        torch.set_num_threads(2)  # this process's setting, before torchwire's threads
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        try:
            if rank != 0:
                return None
            served = [rpc.rpc_sync("worker1", served_thread_settings) for _ in range(3)]
            # at once: some wait for the pool (a reader runs a few in place)
            futs = [rpc.rpc_async("worker1", served_thread_settings) for _ in range(12)]
            served += [f.wait() for f in futs]
            # a request that carries 4 MiB of tensors runs with torch's count; the next
            # small one is back at the share
            large = rpc.rpc_sync("worker1", served_thread_settings_with,
                                 args=(torch.ones(1 << 20),))
            served.append(rpc.rpc_sync("worker1", served_thread_settings))
            return (served, large, torch.get_num_threads(), _intraop._omp is not None,
                    len(os.sched_getaffinity(0)))
        finally:
            rpc.shutdown()

    served, large, main_threads, omp, cpus = run_world(body, 2, init=False)[0]
    assert main_threads == 2  # the user's thread: torch's setting, untouched
    assert all(total == pytest.approx(64.0) for _, _, total in served)
    if not omp:
        pytest.skip("torch's intra-op threads are not OpenMP threads here")
    share = min(2, max(1, cpus // 2))
    mkl = torch.backends.mkl.is_available()
    assert {(n, m) for n, m, _ in served} == {(share, share if mkl else None)}, served
    assert large == ((2, 2 if mkl else None), 1 << 20)


def served_settings_and_result(large):
    """The served thread's (torch, MKL) intra-op counts, and a fresh result of 4 MiB
    (``large``) or of 4 bytes."""
    return served_thread_settings()[:2], torch.zeros((1 << 20) if large else 1)


class _Holder:
    """An object served through RRef proxies: each method's calls are learned apart."""

    def big(self):
        return served_settings_and_result(True)

    def small(self):
        return served_settings_and_result(False)


def _large_result():
    return served_settings_and_result(True)


def _small_result():
    return served_settings_and_result(False)


def _call(fn, *args):
    """A dispatcher, as the RPC tutorials' ``call_method(method, rref, *args)``."""
    return fn(*args)


def test_a_function_whose_last_reply_was_large_runs_with_torchs_count():
    # The request is small, but the work that makes a large reply is not (a parameter
    # server's pull): once a function replied with 4 MiB or more, its next calls run
    # with torch's count; once it replied small again, they are back at the share.
    def body(rank, world_size, init_method):
        import os

        from _cluster import options
        from torchwire._base import intraop as _intraop
        cpus = len(os.sched_getaffinity(0))
        torch.set_num_threads(cpus)  # more than a share of the host's CPUs (cpus // 2)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        try:
            if rank != 0:
                return None
            seen = []
            for large in (True, True, True, False, False):
                settings, result = rpc.rpc_sync("worker1", served_settings_and_result,
                                                args=(large,))
                assert result.numel() == ((1 << 20) if large else 1)
                seen.append(settings[0])
            # through an RRef proxy, each method by its own last reply
            holder = rpc.remote("worker1", _Holder)
            proxied = [getattr(holder.rpc_sync(), m)()[0][0]
                       for m in ("big", "big", "small", "big", "small")]
            # through a dispatcher, each function it calls by its own last reply
            dispatched = [rpc.rpc_sync("worker1", _call, args=(fn,))[0][0]
                          for fn in (_large_result, _large_result, _small_result,
                                     _large_result, _small_result)]
            return seen, proxied, dispatched, cpus, _intraop._omp is not None
        finally:
            rpc.shutdown()

    seen, proxied, dispatched, cpus, omp = run_world(body, 2, init=False)[0]
    if not omp or cpus < 2:
        pytest.skip("needs OpenMP intra-op threads and 2 CPUs")
    share = cpus // 2
    # first call at the share; then torch's count while the last reply was large
    assert seen == [share, cpus, cpus, cpus, share], seen
    assert proxied == [share, cpus, share, cpus, share], proxied
    assert dispatched == [share, cpus, share, cpus, share], dispatched
