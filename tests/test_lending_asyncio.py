"""An asyncio task awaiting its reply on a lent connection reads it on the loop's thread
while the loop has nothing else to do (``Future._read_idle``, ``_wire/lending.py``).

Real two-worker jobs: sequential awaits read their own replies; the loop's timers,
other threads' wake-ups and cancellations still come on time while a task reads; a
deadline; Ctrl-C under ``asyncio.run``; loops that must not read (debug mode, a busy
loop) leave the reply to the reader.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import after_gate, open_gate, run_world, wait_until
from test_lending import _blocked_borrowing, _lent, _role, noop, triple
from torchwire._base.errors import RpcTimeoutError

pytestmark = pytest.mark.timeout(90)


def _when_reading(ident: int, action) -> list:
    """On a thread: ``action()`` once thread ``ident`` waits in a borrowed read; the
    list it returns gets True when it did."""
    seen: list = []

    def watch():
        if wait_until(lambda: _blocked_borrowing(ident), 20):
            seen.append(True)
            action()

    threading.Thread(target=watch, daemon=True).start()
    return seen


def _open_and_call(key: str) -> float:
    """Open gate ``key`` on worker1, then one more call there: its value."""
    rpc.rpc_sync("worker1", open_gate, args=(key,))
    return float(rpc.rpc_sync("worker1", triple, args=(torch.ones(1),)))


def test_sequential_awaits_read_their_replies_on_the_loops_thread():
    def body(rank, world_size):
        if rank == 1:
            return None
        conn, role = _lent()
        before = role.borrows

        async def main():
            ok = True
            for k in range(200):
                x = torch.full((64,), float(k))
                ok = ok and torch.equal(await rpc.rpc_async("worker1", triple, args=(x,)),
                                        x * 3)
            return ok

        ok = asyncio.run(main())
        return ok, role.borrows - before, role.lends, conn.closed

    ok, borrowed, lends, closed = run_world(body, 2)[0]
    assert ok and not closed
    assert borrowed == 200 and lends == 1, (borrowed, lends)


def test_awaits_whose_replies_the_reader_read_lend_it_for_the_next():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _role()

        async def main():
            values = [float(await rpc.rpc_async("worker1", triple, args=(torch.ones(1),)))
                      for _ in range(50)]
            return values == [3.0] * 50

        ok = asyncio.run(main())
        return ok, role.lends, role.borrows

    ok, lends, borrows = run_world(body, 2)[0]
    # the job starts with the reader reading; the first awaited reply lends it
    assert ok and lends >= 1 and borrows >= 1, (lends, borrows)


def _held_call_released_by(opener, key: str):
    """In a loop: ``opener(loop, main_ident)`` starts what must open gate ``key`` while
    this task awaits a call held by it (20 s deadline).  Returns (value, seconds
    waited, borrows meanwhile)."""
    _conn, role = _role()

    async def main():
        loop = asyncio.get_running_loop()
        tasks = opener(loop, threading.get_ident())
        await asyncio.sleep(0)  # its tasks wait now: the loop is idle
        before = role.borrows
        started = time.monotonic()
        value = await rpc.rpc_async("worker1", after_gate, args=(key, 7), timeout=20)
        took = time.monotonic() - started
        await asyncio.gather(*tasks)
        return value, took, role.borrows - before

    return asyncio.run(main())


def test_a_reading_task_leaves_the_loop_to_its_timers():
    def body(rank, world_size):
        if rank == 1:
            return None
        _lent()

        def opener(loop, main_ident):
            async def ticker():  # timers due while the other task reads
                for _ in range(5):
                    await asyncio.sleep(0.02)
                await rpc.rpc_async("worker1", open_gate, args=("idle-timer",))
            return [asyncio.ensure_future(ticker())]

        return _held_call_released_by(opener, "idle-timer")

    value, took, borrowed = run_world(body, 2)[0]
    assert value == 7 and took < 15, (value, took)  # not the deadline: the timers ran
    assert borrowed >= 1  # the awaiting task did read while the loop was idle


def test_a_reading_task_leaves_the_loop_to_wake_ups_from_other_threads():
    def body(rank, world_size):
        if rank == 1:
            return None
        _lent()

        def opener(loop, main_ident):
            woken = asyncio.Event()

            async def open_when_woken():
                await woken.wait()
                await rpc.rpc_async("worker1", open_gate, args=("idle-thread",))

            def wake_when_reading():  # no timer is due: only the wake-up can end it
                if wait_until(lambda: _blocked_borrowing(main_ident), 20):
                    loop.call_soon_threadsafe(woken.set)

            threading.Thread(target=wake_when_reading, daemon=True).start()
            return [asyncio.ensure_future(open_when_woken())]

        return _held_call_released_by(opener, "idle-thread")

    value, took, borrowed = run_world(body, 2)[0]
    assert value == 7 and took < 15, (value, took)
    assert borrowed == 1


def test_cancelling_a_reading_task_from_another_thread_stops_it_at_once():
    def body(rank, world_size):
        if rank == 1:
            return None
        conn, role = _lent()

        async def main():
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            _when_reading(threading.get_ident(), lambda: loop.call_soon_threadsafe(task.cancel))
            try:
                await rpc.rpc_async("worker1", after_gate, args=("idle-cancel", 1),
                                    timeout=30)
                return "returned"
            except asyncio.CancelledError:
                return "cancelled"

        started = time.monotonic()
        outcome = asyncio.run(main())
        took = time.monotonic() - started
        return outcome, took, _open_and_call("idle-cancel"), conn.closed

    outcome, took, after, closed = run_world(body, 2)[0]
    assert outcome == "cancelled" and took < 20, (outcome, took)
    assert after == 3.0 and not closed


def test_a_reading_await_ends_at_the_calls_deadline():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()
        before = role.borrows

        async def main():
            try:
                await rpc.rpc_async("worker1", after_gate, args=("idle-deadline", 1),
                                    timeout=0.5)
                return "returned"
            except RpcTimeoutError as exc:
                return str(exc)

        outcome = asyncio.run(main())
        borrowed = role.borrows - before
        return outcome, borrowed, _open_and_call("idle-deadline")

    outcome, borrowed, after = run_world(body, 2)[0]
    assert "RPC ran for more than set timeout (500 ms)" in outcome and "worker1" in outcome
    assert borrowed == 1
    assert after == 3.0


def test_ctrl_c_under_asyncio_run_stops_a_reading_await():
    def body(rank, world_size):
        if rank == 1:
            return None
        conn, _role_ = _lent()
        signal.signal(signal.SIGINT, signal.default_int_handler)

        async def main():
            await rpc.rpc_async("worker1", after_gate, args=("idle-ctrl-c", 1), timeout=30)

        signalled = _when_reading(threading.get_ident(),
                                  lambda: os.kill(os.getpid(), signal.SIGINT))
        started = time.monotonic()
        try:
            asyncio.run(main())
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        took = time.monotonic() - started
        return signalled, outcome, took, _open_and_call("idle-ctrl-c"), conn.closed

    signalled, outcome, took, after, closed = run_world(body, 2)[0]
    assert signalled, "the main thread was never seen reading for its await"
    assert outcome == "KeyboardInterrupt" and took < 20, (outcome, took)
    assert after == 3.0 and not closed


def test_loops_that_must_not_read_leave_the_reply_to_the_reader():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()

        async def awaits(n):
            return [float(await rpc.rpc_async("worker1", triple, args=(torch.ones(1),)))
                    for _ in range(n)]

        async def busy():  # another task always ready to run: the loop is never idle
            stop = False

            async def spin():
                while not stop:
                    await asyncio.sleep(0)

            spinner = asyncio.ensure_future(spin())
            await asyncio.sleep(0)
            values = await awaits(20)
            stop = True
            await spinner
            return values

        out = {}
        for name, run in (("debug", lambda: asyncio.run(awaits(20), debug=True)),
                          ("busy", lambda: asyncio.run(busy()))):
            rpc.rpc_sync("worker1", noop)  # lent again
            assert wait_until(lambda: role.lends and role.state == "lent", 20)
            before = role.borrows
            values = run()
            out[name] = (values == [3.0] * 20, role.borrows - before)
        return out

    out = run_world(body, 2)[0]
    assert out == {"debug": (True, 0), "busy": (True, 0)}, out
