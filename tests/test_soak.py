"""Load and soak (issue 6, item 6).

The load test runs by default.  The soak runs on demand (it takes minutes):

    TORCHWIRE_SOAK=1 ./run test tests/test_soak.py -s

``./run reliability --soak`` runs the same soak (:func:`soak`) and writes its
samples into RELIABILITY.md, with the long fuzzing of ``tests/test_fuzz.py``.
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


def _rrefs_held() -> int:
    """Values this worker owns plus forks and user RRefs it still counts."""
    info = rpc.api._rref_context_get_debug_info()
    return sum(int(info[k]) for k in ("num_live_values", "num_forks", "num_user_rrefs"))


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


def soak(calls: int = 1_000_000, cycles: int = 100_000, samples: int = 10,
         timeout: float = 3600) -> dict:
    """The soak on a fresh 3-worker job: ``calls`` small calls from worker0 (batches of
    1 000 ``rpc_async``, alternating worker1 and worker2), then ``cycles`` RRef
    create/delete cycles (``remote()`` on one peer, ``to_here()`` from the other, then
    ``del``).  Every worker's (RSS bytes, open fds) is sampled ``samples`` times per
    phase, the first at the end of the warm-up (the first 1/``samples``).

    Returns ``{"calls": [(done, [(rss, fds)] * 3), ...], "rrefs": [...],
    "t_calls": s, "t_rrefs": s}``.  ``bench/reliability.py --soak`` runs it too.
    """

    def body(rank, world_size):
        if rank != 0:
            return None
        peers = ["worker1", "worker2"]
        marks: dict = {"calls": [], "rrefs": []}

        def checkpoint(phase, done):
            marks[phase].append((done, [_usage()] + [rpc.rpc_sync(p, _usage) for p in peers]))

        step = max(1000, calls // samples // 1000 * 1000)
        t0 = time.monotonic()
        done = 0
        while done < calls:
            futs = [rpc.rpc_async(peers[i % 2], add, args=(i, 1)) for i in range(1000)]
            torch.futures.wait_all(futs)
            done += len(futs)
            if done % step == 0 or done >= calls:
                checkpoint("calls", done)
        marks["t_calls"] = time.monotonic() - t0
        step = max(1, cycles // samples)
        t0 = time.monotonic()
        for i in range(cycles):
            rref = rpc.remote(peers[i % 2], add, args=(i, 1))
            assert rpc.rpc_sync(peers[(i + 1) % 2], relay, args=(rref, None)) == i + 1
            del rref
            if (i + 1) % step == 0 and i + 1 < cycles:
                checkpoint("rrefs", i + 1)
        deadline = time.monotonic() + 30  # the last deletions reach their owners
        while _rrefs_held() + sum(rpc.rpc_sync(p, _rrefs_held) for p in peers):
            assert time.monotonic() < deadline, "RRef deletions did not settle in 30 s"
            time.sleep(0.01)
        checkpoint("rrefs", cycles)
        marks["t_rrefs"] = time.monotonic() - t0
        return marks

    return run_world(body, 3, timeout=timeout)[0]


def growth(marks: dict) -> list[tuple]:
    """``(phase, worker, (rss_warm, fds_warm), (rss_end, fds_end), ok)``: ok when RSS and
    open fds each grew by less than 5 % from the end of the warm-up to the end."""
    out = []
    for phase in ("calls", "rrefs"):
        warm, end = marks[phase][0][1], marks[phase][-1][1]
        for worker, (w, e) in enumerate(zip(warm, end)):
            ok = e[0] < w[0] * 1.05 and e[1] < w[1] * 1.05
            out.append((phase, worker, w, e, ok))
    return out


@pytest.mark.skipif(not SOAK, reason="soak runs on demand: TORCHWIRE_SOAK=1")
@pytest.mark.timeout(3600)
def test_soak_small_calls_and_rref_cycles_keep_memory_and_fds_flat():
    calls, cycles = 1_000_000, 100_000
    marks = soak(calls, cycles)
    print(f"\n{calls} calls in {marks['t_calls']:.0f} s, {cycles} RRef cycles in "
          f"{marks['t_rrefs']:.0f} s")
    for phase, worker, (rss0, fds0), (rss1, fds1), ok in growth(marks):
        print(f"{phase} worker{worker}: RSS {rss0 >> 20} -> {rss1 >> 20} MiB, "
              f"fds {fds0} -> {fds1}")
        assert ok, f"{phase}: worker{worker} RSS or fds grew by 5% or more after the warm-up"
