"""The asyncio rows: ``await rpc.rpc_async(noop)`` latency, 10 000 concurrent awaits.

torchwire's futures are awaitable.  torch's are not: for torch the same rows measure
what a torch user would write in an asyncio program, ``await
loop.run_in_executor(None, fut.wait)`` (a thread of the default executor blocks per
call).  The report marks the rows torchwire-only for that reason.  The
``fut.wait()`` latency of the same calls, outside any loop, is measured too, so
awaiting can be compared with waiting in one process.
"""

from __future__ import annotations

import asyncio
import time


def _awaitable(fut):
    """``fut`` itself where it can be awaited (torchwire), else its ``wait()`` run in
    the loop's default thread executor (torch)."""
    if hasattr(type(fut), "__await__"):
        return fut
    return asyncio.get_running_loop().run_in_executor(None, fut.wait)


def _median(vals):
    vals = sorted(vals)
    return vals[len(vals) // 2]


def measure(rpc, n: int = 2000, warmup: int = 200, concurrent: int = 10_000,
            reps: int = 3) -> dict:
    """Run the asyncio rows against ``worker1``; ``rpc`` is ``torch.distributed.rpc`` or
    ``torchwire.rpc`` (initialised, this process being ``worker0``).

    Returns:
        ``{"asyncio_wait_noop_median_us": µs, "asyncio_await_noop_median_us": µs,
        "asyncio_await_10k_calls_per_s": calls/s}``.
    """
    from _bench_funcs import noop

    waited = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        rpc.rpc_async("worker1", noop).wait()
        if i >= warmup:
            waited.append((time.perf_counter() - t0) * 1e6)

    async def latency():
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            await _awaitable(rpc.rpc_async("worker1", noop))
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e6)
        return out

    async def throughput():
        await asyncio.gather(*[_awaitable(rpc.rpc_async("worker1", noop))
                               for _ in range(warmup)])
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await asyncio.gather(*[_awaitable(rpc.rpc_async("worker1", noop))
                                   for _ in range(concurrent)])
            rates.append(concurrent / (time.perf_counter() - t0))
        return rates

    awaited = asyncio.run(latency())
    rates = asyncio.run(throughput())
    return {
        "asyncio_wait_noop_median_us": _median(waited),
        "asyncio_await_noop_median_us": _median(awaited),
        "asyncio_await_10k_calls_per_s": _median(rates),
    }
