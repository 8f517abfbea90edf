"""A call's deadline bounds every wait under it; a frozen peer's link heals.

Frozen peers are real processes stopped with SIGSTOP: the kernel still accepts
connections to their listeners (the backlog), but nothing answers.  Options are
the defaults (heartbeat included) unless a test says otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import freeze, options, run_world
from test_failures import _reap, _result, _start
from torchwire._wire.writer import Writer

_ctx = mp.get_context("fork")

pytestmark = pytest.mark.timeout(90)


def add(a, b):
    return a + b


def total(t):
    return float(t.sum())


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_first_contact_with_a_frozen_peer_fails_at_the_call_deadline_then_heals():
    ready, frozen, thawed = _ctx.Barrier(3), _ctx.Event(), _ctx.Event()
    timed, finish, parked = _ctx.Event(), _ctx.Event(), _ctx.Event()

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        if rank == 1:
            ready.wait(30)
            parked.set()  # out of the barrier: stopped inside it, it would hold its lock
            assert finish.wait(60)
            rpc.shutdown()
            return None
        ready.wait(30)
        assert frozen.wait(30)
        times = []
        for timeout in (2.0, 0.5):  # never connected to worker1: connect + handshake
            t0 = time.monotonic()
            with pytest.raises(torchwire.RpcTimeoutError, match="worker1") as info:
                rpc.rpc_sync("worker1", add, args=(1, 1), timeout=timeout)
            times.append(time.monotonic() - t0)
            assert "connect" in str(info.value)
        fut = rpc.rpc_async("worker1", add, args=(2, 2), timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(torchwire.RpcTimeoutError):
            fut.wait()
        times.append(time.monotonic() - t0)
        timed.set()
        assert thawed.wait(30)
        # thawed: the next call succeeds, no retry
        assert rpc.rpc_sync("worker1", add, args=(3, 3), timeout=10) == 6
        finish.set()
        rpc.shutdown()
        return times

    procs = _start(body, 2)
    try:
        ready.wait(60)
        assert parked.wait(60)
        freeze(procs[1][0].pid)
        frozen.set()
        assert timed.wait(30)
        os.kill(procs[1][0].pid, signal.SIGCONT)
        thawed.set()
        times = _result(procs, 0)
        _result(procs, 1)
    finally:
        _reap(procs)
    print("frozen first contact:", [f"{t:.2f}" for t in times])
    assert 2.0 - 0.05 < times[0] < 2.0 + 0.5
    assert 0.5 - 0.05 < times[1] < 0.5 + 0.5
    assert times[2] < 1.0 + 0.5


def test_a_peer_that_stops_reading_bounds_the_callers_memory_and_spares_others():
    """Over TCP (no shared memory), 32 MiB tensors to a frozen peer: the socket fills,
    then the queue; calls fail at their deadlines, rpc_async returns by then, memory
    stays bounded, and a third worker is served at once throughout."""
    ready, frozen, parked = _ctx.Barrier(4), _ctx.Event(), _ctx.Event()

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, _transports=["tcp"]))
        if rank != 0:
            ready.wait(30)
            if rank == 2:
                parked.set()  # out of the barrier: stopped inside it, it would hold its lock
            time.sleep(60)  # frozen (rank 2) or idle until killed
        assert rpc.rpc_sync("worker2", add, args=(1, 1)) == 2  # connected before
        assert rpc.rpc_sync("worker1", add, args=(1, 1)) == 2
        ready.wait(30)
        assert frozen.wait(30)
        base = _rss_mib()
        futs, issue, bystander, peak = [], [], [], base
        for i in range(8):  # 256 MiB asked for
            t = torch.full((8 << 20,), float(i))
            t0 = time.monotonic()
            futs.append((t0, rpc.rpc_async("worker2", total, args=(t,), timeout=1.0)))
            issue.append(time.monotonic() - t0)
            del t
            t0 = time.monotonic()
            assert rpc.rpc_sync("worker1", add, args=(i, 1), timeout=5) == i + 1
            bystander.append(time.monotonic() - t0)
            peak = max(peak, _rss_mib())
        late = []
        for t0, fut in futs:
            with pytest.raises((torchwire.RpcTimeoutError, torchwire.WorkerUnavailableError)):
                fut.wait()
            late.append(time.monotonic() - t0 - 1.0)
        return issue, bystander, late, peak - base

    procs = _start(body, 3)
    try:
        ready.wait(60)
        assert parked.wait(60)
        freeze(procs[2][0].pid)
        frozen.set()
        issue, bystander, late, grew = _result(procs, 0, 90)
    finally:
        _reap(procs)
    print(f"issue max {max(issue):.2f} s, bystander max {max(bystander):.3f} s, "
          f"RSS grew {grew:.0f} MiB")
    assert max(issue) < 1.0 + 0.5  # backpressure: rpc_async waits, but not past the deadline
    assert max(bystander) < 1.0
    # what the futures' waits add to their deadline: the first ones were waited for late
    assert min(late) < 0.5
    # the socket's buffers, the batch being written and the 64 MiB queue, not 256 MiB
    assert grew < 160, grew


def test_a_write_to_a_full_socket_gives_up_at_the_deadline_and_a_pool_thread_finishes():
    a, b = socket.socketpair()
    a.setblocking(True)
    deferred = []
    w = Writer(a, 1, lambda fn, *args: deferred.append((fn, args)), lambda exc: None,
               max_queued=1 << 20)
    big = bytes(8 << 20)  # far more than a socketpair buffers
    t0 = time.monotonic()
    w.enqueue([big], (), len(big), deadline=time.monotonic() + 0.3)
    took = time.monotonic() - t0
    assert 0.25 < took < 0.8, took
    assert w.flushing and deferred  # the turn is kept; the pool finishes the frame
    assert w.queued > w.max_queued  # the unwritten rest went back to the queue
    # a sender behind the full queue waits for room until its deadline, nothing sent
    with pytest.raises(torchwire.RpcTimeoutError, match="stayed full"):
        w.enqueue([b"x" * 100], (), 100, deadline=time.monotonic() + 0.2)
    frames_before = w.frames_out
    # the reader drains: the pool thread's flush writes everything, in order
    got = bytearray()
    reader = threading.Thread(target=lambda: _drain(b, got, len(big)))
    reader.start()
    fn, args = deferred.pop(0)
    fn(*args)
    reader.join(10)
    assert len(got) == len(big)
    assert not w.flushing and w.queued == 0 and w.frames_out == frames_before
    a.close()
    b.close()


def _drain(sock, into: bytearray, n: int) -> None:
    while len(into) < n:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        into += chunk


def nap(seconds):
    time.sleep(seconds)
    return seconds


def test_dials_cut_short_by_their_callers_deadline_leave_the_peers_other_calls_alone():
    """Calls with a 1 ms timeout to a peer not yet connected give up their dial at the
    deadline, sometimes after the peer's side of the handshake ended: the peer must not
    take that for the caller's loss (it closed the caller's other connections and failed
    the calls on them).  A ring of four, each calling the next (torch's
    test_default_timeout_used)."""
    def body(rank, world_size):
        dst = f"worker{(rank + 1) % world_size}"
        rpc._set_rpc_timeout(0.001)
        for fut in [rpc.rpc_async(dst, nap, args=(0.5,)) for _ in range(10)]:
            with pytest.raises(torchwire.RpcTimeoutError):
                fut.wait()
        rpc._set_rpc_timeout(60)
        slow = rpc.rpc_async(dst, nap, args=(0.5,))
        rpc._set_rpc_timeout(0.001)
        with pytest.raises(torchwire.RpcTimeoutError):
            rpc.rpc_async(dst, nap, args=(0.5,)).wait()
        rpc._set_rpc_timeout(60)
        assert slow.wait() == 0.5
        return True

    assert run_world(body, 4, timeout=60) == [True] * 4
