"""Cancellation in asyncio, as asyncio means it: a cancelled future is done, a
cancelled await leaves nothing behind, and a coroutine that ends in
``CancelledError`` on the callee is not reported as a shutdown.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world

pytestmark = pytest.mark.timeout(90)


def _slow(x, seconds):
    time.sleep(seconds)
    return x


async def _cancelled_inside():
    inner = asyncio.get_running_loop().create_task(asyncio.sleep(30))
    asyncio.get_running_loop().call_soon(inner.cancel)
    await inner  # its CancelledError ends this coroutine too


class _Holder:
    async def cancelled(self):
        raise asyncio.CancelledError()


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


async def _drain_after_cancel():
    """asyncio.wait, cancel the straggler, then the usual drain loop."""
    fs = [rpc.rpc_async("worker1", _slow, args=(0, 0.0)),
          rpc.rpc_async("worker1", _slow, args=(1, 5.0))]
    done, pending = await asyncio.wait(fs, return_when=asyncio.FIRST_COMPLETED)
    for p in pending:
        p.cancel()
    straggler = next(iter(pending))
    states = (straggler.cancelled(), straggler.done())
    rounds = 0
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        rounds += 1
    # the drain did not wait for the straggler's reply (5 s away): its torch side is
    # still pending
    return states, rounds, not torch._C.Future.done(straggler)


async def _await(fut):
    return await fut


async def _poll(fut, n):
    """Await ``fut`` ``n`` times, each time from a task cancelled at once (a poll that
    gives up); how many awaits stay registered on it."""
    for _ in range(n):
        task = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0)  # the task now awaits fut
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return len(fut._tw_awaited or ())


def test_a_cancelled_future_is_done_and_a_cancelled_await_leaves_nothing():
    def body(rank, world_size):
        if rank == 1:
            return None
        out = {}
        out["drain"] = asyncio.run(_drain_after_cancel())
        slow = rpc.rpc_async("worker1", _slow, args=(7, 2.0))
        out["left"] = asyncio.run(_poll(slow, 300))
        out["value"] = slow.wait()
        # a coroutine that ends in CancelledError on the callee: not a shutdown
        out["coroutine"] = _outcome(rpc.rpc_sync, "worker1", _cancelled_inside)
        holder = rpc.remote("worker1", _Holder)
        out["method"] = _outcome(lambda: holder.rpc_sync().cancelled())
        out["serving"] = rpc.rpc_sync("worker1", _slow, args=(3, 0.0))
        return out

    out = run_world(body, 2, timeout=80)[0]
    (cancelled, done), rounds, before_reply = out["drain"]
    assert cancelled and done, "a cancelled future must be done, as an asyncio future"
    assert rounds == 1 and before_reply, (rounds, before_reply)
    assert out["left"] == 0, f"{out['left']} cancelled awaits are still registered"
    assert out["value"] == 7
    for key in ("coroutine", "method"):
        kind, message = out[key]
        assert kind == "RemoteCallError", out[key]
        assert "CancelledError" in message and "shutting down" not in message, message
    assert out["serving"] == 3
