"""Shutdown: a graceful shutdown waits for outstanding work and is bounded by its
timeout; a non-graceful one is immediate and local, and calls to the worker that left
then fail rather than hang."""

from __future__ import annotations

import threading
import time

import pytest

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world
from test_rpc import add, sleep_then


# ---------------------------------------------------------------- shutdown

def test_graceful_shutdown_waits_for_outstanding_work():
    def body(rank, world_size):
        if rank == 0:
            # issued just before shutdown: worker1 is already in shutdown, still serves it
            fut = rpc.rpc_async("worker1", sleep_then, args=(0.5, "finished"))
            rpc.shutdown()
            return fut.wait()
        if rank == 1:
            rpc.shutdown()
            return "served"
        rpc.shutdown()
        return "idle"

    def wrapper(rank, world_size, init_method):
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        return body(rank, world_size)

    assert run_world(wrapper, 3, init=False, timeout=60) == ["finished", "served", "idle"]


_flag = threading.Event()


def set_flag():
    _flag.set()
    return True


def test_shutdown_non_graceful_is_immediate_and_local():
    def body(rank, world_size, init_method):
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        if rank == 1:
            assert _flag.wait(30)
            t0 = time.monotonic()
            rpc.shutdown(graceful=False)
            return time.monotonic() - t0
        try:
            assert rpc.rpc_sync("worker1", set_flag)
        except torchwire.WorkerUnavailableError:
            pass  # worker1 woke and closed before its reply went out: it waits for nobody
        # worker1 leaves without waiting for anyone; calls to it then fail, never hang
        t0 = time.monotonic()
        while True:
            try:
                rpc.rpc_sync("worker1", add, args=(1, 1), timeout=5)
            except torchwire.WorkerUnavailableError as exc:
                assert "worker1" in str(exc)
                break
            assert time.monotonic() - t0 < 10
        rpc.shutdown(graceful=False)
        return time.monotonic() - t0

    elapsed = run_world(body, 2, init=False)
    assert elapsed[1] < 3.0


def test_graceful_shutdown_bounded_by_timeout():
    def body(rank, world_size, init_method):
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        if rank == 0:
            t0 = time.monotonic()
            with pytest.raises(torchwire.RpcTimeoutError, match="shutdown"):
                rpc.shutdown(timeout=1.0)  # worker1 is still busy and has not called shutdown
            return time.monotonic() - t0
        time.sleep(3)
        rpc.shutdown(graceful=False)
        return None

    assert run_world(body, 2, init=False)[0] < 2.5
