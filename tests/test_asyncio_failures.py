"""asyncio when a worker dies: awaited calls fail naming it, and the loop runs on."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest

import torchwire
import torchwire.rpc as rpc
from _cluster import options, wait_until
from test_failures import _reap, _result, _start

_ctx = mp.get_context("fork")

pytestmark = pytest.mark.timeout(90)

_arrived = None  # shared counters, set before the workers fork
_ticks = None


def add(a, b):
    return a + b


def arrive_and_nap(seconds):
    with _arrived.get_lock():
        _arrived.value += 1
    time.sleep(seconds)
    return seconds


async def await_on(to):
    """An ``async def`` on the callee that awaits a third worker."""
    return await rpc.rpc_async(to, arrive_and_nap, args=(30,))


def test_awaited_calls_fail_naming_a_killed_worker_and_the_loop_runs_on():
    # worker0 awaits five calls to worker2 and one to worker1 whose async def awaits
    # worker2; worker2 is killed while all six run.  Every await ends with worker2's
    # WorkerUnavailableError soon after, the loop keeps ticking meanwhile, and the
    # survivors still serve each other's awaited calls.
    ready = _ctx.Event()
    killed_at = _ctx.Value("d", 0.0)
    global _arrived, _ticks
    _arrived = _ctx.Value("i", 0)
    _ticks = _ctx.Value("i", 0)  # worker0's loop: turns of a 10 ms ticker

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=30))
        if rank == 2:
            time.sleep(60)  # serves until killed
        if rank == 1:
            assert ready.wait(60)
            rpc.shutdown()
            return None

        async def main():
            async def tick():
                while True:
                    _ticks.value += 1
                    await asyncio.sleep(0.01)
            ticker = asyncio.ensure_future(tick())
            direct = [rpc.rpc_async("worker2", arrive_and_nap, args=(30,))
                      for _ in range(4)]
            nested = rpc.rpc_async("worker1", await_on, args=("worker2",))
            single = rpc.rpc_async("worker2", arrive_and_nap, args=(30,))
            try:
                await single  # the kill comes while this await waits
                single_error = None
            except torchwire.WorkerUnavailableError as exc:
                single_error = exc
            failed_after = time.monotonic() - killed_at.value
            gathered = await asyncio.gather(*direct, nested, return_exceptions=True)
            survivor = await rpc.rpc_async("worker1", add, args=(2, 3))
            ticker.cancel()
            return gathered, single_error, failed_after, survivor

        try:
            return asyncio.run(main())
        finally:
            ready.set()
            rpc.shutdown()

    procs = _start(body, 3)
    try:
        assert wait_until(lambda: _arrived.value == 6, timeout=30), _arrived.value
        # all six calls are in flight, and worker0's loop goes on turning meanwhile
        start = _ticks.value
        assert wait_until(lambda: _ticks.value >= start + 3, timeout=10), _ticks.value
        killed_at.value = time.monotonic()
        os.kill(procs[2][0].pid, signal.SIGKILL)
        gathered, single_error, failed_after, survivor = _result(procs, 0)
        _result(procs, 1)
    finally:
        _reap(procs)
    assert len(gathered) == 5
    for error in gathered[:4]:  # the direct calls: worker2's own error
        assert isinstance(error, torchwire.WorkerUnavailableError), repr(error)
        assert error.worker_name == "worker2"
    # through worker1's coroutine: the error it awaited, naming worker2, as its reply
    assert isinstance(gathered[4], torchwire.WorkerUnavailableError), repr(gathered[4])
    assert "worker2" in str(gathered[4])
    assert single_error is not None and single_error.worker_name == "worker2"
    assert failed_after < 5, failed_after  # the lost connection, not the 30 s timeout
    assert survivor == 5
