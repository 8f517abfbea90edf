"""Load and soak (issue 6, item 6).

The load test runs by default.  The soak runs on demand (it takes minutes):

    TORCHWIRE_SOAK=1 ./run test tests/test_soak.py -s
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world

SOAK = os.environ.get("TORCHWIRE_SOAK") == "1"


def add(a, b):
    return a + b


def relay(rref, to):
    if to is None:
        return rref.to_here()
    return rpc.rpc_sync(to, relay, args=(rref, None))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _usage():
    return _rss(), _fds()


def _ten_thousand_outstanding():
    futs: list = []
    lock = threading.Lock()

    def issue(tid):
        mine = [rpc.rpc_async("worker1", add, args=(tid, i)) for i in range(2500)]
        with lock:
            futs.extend((tid, i, f) for i, f in zip(range(2500), mine))

    threads = [threading.Thread(target=issue, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(futs) == 10_000
    torch.futures.wait_all([f for _, _, f in futs])
    return all(f.value() == tid + i for tid, i, f in futs)


def test_ten_thousand_outstanding_calls_from_four_threads_all_complete(world):
    assert world.run(0, _ten_thousand_outstanding, timeout=120)


@pytest.mark.skipif(not SOAK, reason="soak runs on demand: TORCHWIRE_SOAK=1")
@pytest.mark.timeout(3600)
def test_soak_small_calls_and_rref_cycles_keep_memory_and_fds_flat():
    calls, cycles = 1_000_000, 100_000

    def body(rank, world_size):
        if rank != 0:
            return None
        peers = ["worker1", "worker2"]
        marks = {}

        def checkpoint(name):
            marks[name] = [_usage()] + [rpc.rpc_sync(p, _usage) for p in peers]

        t0 = time.monotonic()
        done = 0
        while done < calls:
            futs = [rpc.rpc_async(peers[i % 2], add, args=(i, 1)) for i in range(1000)]
            torch.futures.wait_all(futs)
            done += len(futs)
            if done == calls // 10:
                checkpoint("calls_warm")
        checkpoint("calls_end")
        t_calls = time.monotonic() - t0
        t0 = time.monotonic()
        for i in range(cycles):
            rref = rpc.remote(peers[i % 2], add, args=(i, 1))
            assert rpc.rpc_sync(peers[(i + 1) % 2], relay, args=(rref, None)) == i + 1
            del rref
            if i + 1 == cycles // 10:
                checkpoint("rrefs_warm")
        time.sleep(0.5)
        checkpoint("rrefs_end")
        return marks, t_calls, time.monotonic() - t0

    marks, t_calls, t_rrefs = run_world(body, 3, timeout=3600)[0]
    print(f"\n{calls} calls in {t_calls:.0f} s, {cycles} RRef cycles in {t_rrefs:.0f} s")
    for phase in ("calls", "rrefs"):
        for worker, ((rss0, fds0), (rss1, fds1)) in enumerate(
                zip(marks[f"{phase}_warm"], marks[f"{phase}_end"])):
            print(f"{phase} worker{worker}: RSS {rss0 >> 20} -> {rss1 >> 20} MiB, "
                  f"fds {fds0} -> {fds1}")
            assert rss1 <= rss0 * 1.05, f"{phase}: worker{worker} RSS grew over 5%"
            assert fds1 <= fds0, f"{phase}: worker{worker} file descriptors grew"
