"""Nothing is left behind: file descriptors, shared memory, memory, after many transfers
and after a peer dies in the middle of one."""

from __future__ import annotations

import os
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world

CHANNELS = {"cma": None, "socket": ["socket"]}


def echo(x):
    return x


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _shm() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _state():
    return _fds(), _rss(), _shm()


@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_ten_thousand_transfers_leave_no_fd_segment_or_memory_behind(channel):
    def body(rank, world_size):
        peer = f"worker{1 - rank}"
        sizes = [0, 1, 1000, 300_000, 2_000_000]  # bytes: inline and (>= 256 KiB) CMA
        tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
        for t in tensors:  # warm up: connections, buffer pool
            assert torch.equal(rpc.rpc_sync(peer, echo, args=(t,)), t)
        before = rpc.rpc_sync(peer, _state), _state()
        for i in range(5000):  # 5000 each way at once: 10 000 transfers per worker pair
            t = tensors[i % len(tensors)]
            back = rpc.rpc_sync(peer, echo, args=(t,))
            if i % 997 == 0:
                assert torch.equal(back, t)
            del back
        time.sleep(0.2)
        after = rpc.rpc_sync(peer, _state), _state()
        return before, after

    results = run_world(body, 2, timeout=180, _channels=CHANNELS[channel])
    for before, after in results:
        for (fds0, rss0, shm0), (fds1, rss1, shm1) in zip(before, after):
            assert fds1 <= fds0, f"file descriptors grew: {fds0} -> {fds1}"
            assert shm1 <= shm0, f"new /dev/shm entries: {shm1 - shm0}"
            assert rss1 - rss0 < 64 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"


def test_a_peer_dying_mid_transfer_leaves_the_survivor_clean():
    def body(rank, world_size, init_method):
        from _cluster import die, options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20))
        big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB
        if rank == 1:
            rpc.rpc_sync("worker0", echo, args=(torch.ones(4),))
            inflight = rpc.rpc_async("worker0", echo, args=(big,))  # worker0 reads it
            time.sleep(0.05)
            die(("died", inflight.done()))  # in the middle of the transfer or its reply
        fds0, rss0, shm0 = _state()  # no call of ours: worker1 may already be dying
        time.sleep(2.0)
        with pytest.raises(rpc.WorkerUnavailableError, match="worker1"):
            rpc.rpc_sync("worker1", echo, args=(big,), timeout=10)
        del big
        import gc
        gc.collect()
        time.sleep(0.3)
        fds1, rss1, shm1 = _state()
        rpc.shutdown(graceful=False)
        return fds0, fds1, rss0, rss1, shm0, shm1

    results = run_world(body, 2, init=False, timeout=90)
    assert results[1] == ("died", False)
    fds0, fds1, rss0, rss1, shm0, shm1 = results[0]
    assert fds1 <= fds0, f"file descriptors grew: {fds0} -> {fds1}"
    assert shm1 <= shm0
    assert rss1 - rss0 < 96 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"
