"""asyncio end to end: awaitable futures, ``async def`` remote functions, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import after_gate, open_gate, run_world, wait_until


# ---------------------------------------------------------------- remote functions

def add(a, b):
    return a + b


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


_async_gates: dict[str, asyncio.Event] = {}  # used on the callee's loop only


async def async_after_gate(key, value):
    """``after_gate`` for the callee's loop: ``value`` once ``async_open_gate(key)``
    has run here (30 s at most)."""
    gate = _async_gates.setdefault(key, asyncio.Event())
    try:
        await asyncio.wait_for(gate.wait(), 30)
    except asyncio.TimeoutError:
        raise TimeoutError(f"gate {key!r} was never opened") from None
    return value


async def async_open_gate(key):
    _async_gates.setdefault(key, asyncio.Event()).set()


_in_flight: dict[str, list] = {}  # key -> [calls arrived, asyncio.Event], on the loop


async def async_when_all_in_flight(key, n, value):
    """``value`` once ``n`` calls with ``key`` are awaiting here at the same time
    (20 s at most): it completes only if all ``n`` run concurrently."""
    entry = _in_flight.setdefault(key, [0, asyncio.Event()])
    entry[0] += 1
    if entry[0] == n:
        entry[1].set()
    try:
        await asyncio.wait_for(entry[1].wait(), 20)
    except asyncio.TimeoutError:
        raise TimeoutError(f"only {entry[0]} of {n} calls were ever in flight") from None
    return value


def torch_side_done(fut) -> bool:
    """Has a reply completed ``fut``?  (In a running loop ``fut.done()`` is also True
    once the asyncio side is cancelled.)"""
    return torch.futures.Future.done(fut)


def raise_value_error(msg):
    raise ValueError(msg)


async def async_sleep(seconds, value):
    await asyncio.sleep(seconds)
    return value


async def async_add_via(to, a, b):
    """Awaits another worker: a nested call from the callee's event loop."""
    total = await rpc.rpc_async(to, add, args=(a, b))
    return total * 10


async def async_raise(msg):
    await asyncio.sleep(0)
    raise KeyError(msg)


async def loop_thread_name():
    return threading.current_thread().name


def thread_count():
    return threading.active_count()


def pending_calls():
    return rpc.stats()["pending"]


class Counter:
    def __init__(self, start):
        self.value = start

    async def add_later(self, n):
        await asyncio.sleep(0.01)
        self.value += n
        return self.value


# ---------------------------------------------------------------- awaiting futures

def body_await_futures():
    async def main():
        out = {}
        out["value"] = await rpc.rpc_async("worker1", add, args=(2, 3))
        t = await rpc.rpc_async("worker2", torch.add, args=(torch.ones(2), 1))
        out["tensor"] = t.tolist()
        # the same exception as wait() raises
        fut = rpc.rpc_async("worker1", raise_value_error, args=("nope",))
        with pytest.raises(ValueError) as awaited:
            await fut
        with pytest.raises(ValueError) as waited:
            fut.wait()
        out["same_error"] = (type(awaited.value) is type(waited.value)
                             and str(awaited.value) == str(waited.value))
        out["names_worker"] = "worker1" in str(awaited.value)
        # done before it is awaited: the await returns without suspending (the first
        # step of its generator ends it instead of yielding to the loop)
        done = rpc.rpc_async("worker1", add, args=(1, 1))
        done.wait()
        with pytest.raises(StopIteration) as stopped:
            done.__await__().send(None)
        out["done_first"] = stopped.value.value
        # the loop keeps running while a call is awaited
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        ticker = asyncio.ensure_future(tick())
        out["slow"] = await rpc.rpc_async("worker1", sleep_then, args=(0.3, "slow"))
        ticker.cancel()
        out["ticks"] = ticks
        # fan out with gather
        out["gather"] = await asyncio.gather(
            *[rpc.rpc_async(f"worker{1 + i % 3}", add, args=(i, i)) for i in range(30)])
        return out
    return asyncio.run(main())


def test_await_gives_the_value_or_the_same_error_without_blocking_the_loop(world):
    out = world.run(0, body_await_futures)
    assert out["value"] == 5 and out["tensor"] == [2.0, 2.0]
    assert out["same_error"] and out["names_worker"]
    assert out["done_first"] == 2
    assert out["slow"] == "slow" and out["ticks"] >= 5  # the loop ran while it waited
    assert out["gather"] == [2 * i for i in range(30)]


def body_await_from_several_loops():
    fut = rpc.rpc_async("worker1", sleep_then, args=(0.2, 7))
    results, errors = [], []

    def in_thread():
        async def wait_on_it():
            return await fut
        try:
            results.append(asyncio.run(wait_on_it()))
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=in_thread) for _ in range(4)]
    for t in threads:
        t.start()
    plain = fut.wait()  # and a thread waiting the torch way
    for t in threads:
        t.join(30)
    return results, errors, plain


def test_one_future_awaited_from_several_loops_and_threads(world):
    results, errors, plain = world.run(0, body_await_from_several_loops)
    assert errors == [] and results == [7] * 4 and plain == 7


def body_rrefs_async():
    async def main():
        rref = rpc.remote("worker1", add, args=(torch.ones(2), 2))
        await rref._get_future()  # the creation, awaited
        value = await rref.to_here_async()
        counter = rpc.remote("worker2", Counter, args=(5,))
        via_async_proxy = await counter.rpc_async().add_later(1)
        via_sync_proxy = counter.rpc_sync().add_later(1)
        via_remote_proxy = await counter.remote().add_later(1).to_here_async()
        made_by_coroutine = await rpc.remote("worker3", async_sleep,
                                             args=(0.01, "ok")).to_here_async()
        failing = rpc.remote("worker1", raise_value_error, args=("bad value",))
        with pytest.raises(ValueError, match="bad value"):
            await failing.to_here_async()
        mine = await rpc.RRef("local").to_here_async()
        return (value.tolist(), via_async_proxy, via_sync_proxy, via_remote_proxy,
                made_by_coroutine, mine)
    return asyncio.run(main())


def test_rrefs_to_here_async_and_coroutine_methods_through_proxies(world):
    assert world.run(0, body_rrefs_async) == ([3.0, 3.0], 6, 7, 8, "ok", "local")


# ---------------------------------------------------------------- async def targets

def body_async_def_targets():
    out = {}
    out["sync"] = rpc.rpc_sync("worker1", async_sleep, args=(0.01, "done"))
    out["nested"] = rpc.rpc_sync("worker1", async_add_via, args=("worker2", 1, 2))
    out["nested_to_caller"] = rpc.rpc_async("worker1", async_add_via,
                                            args=("worker0", 3, 4)).wait()
    out["loop_thread"] = rpc.rpc_sync("worker1", loop_thread_name)
    try:
        rpc.rpc_sync("worker1", async_raise, args=("missing",))
    except KeyError as exc:
        out["error"] = str(exc)
    return out


def test_async_def_remote_functions_run_on_the_callee_loop(world):
    out = world.run(0, body_async_def_targets)
    assert out["sync"] == "done"
    assert out["nested"] == 30 and out["nested_to_caller"] == 70
    assert out["loop_thread"] == "torchwire-worker1-asyncio"
    assert "missing" in out["error"] and "async_raise" in out["error"]  # its traceback


def body_thousand_async_calls():
    import uuid
    threads_before = rpc.rpc_sync("worker1", thread_count)
    key = f"thousand-{uuid.uuid4()}"

    async def main():
        return await asyncio.gather(
            *[rpc.rpc_async("worker1", async_when_all_in_flight, args=(key, 1000, i))
              for i in range(1000)])
    values = asyncio.run(main())
    return values, threads_before, rpc.rpc_sync("worker1", thread_count)


def test_a_thousand_async_def_calls_are_in_flight_at_once(world):
    # each call returns only once all 1000 await on the callee together: more than
    # the default pool's 16 threads could hold if a call kept a thread
    values, threads_before, threads_after = world.run(0, body_thousand_async_calls)
    assert values == list(range(1000))
    assert threads_after <= threads_before + 2  # no thread was started per call


# ---------------------------------------------------------------- cancellation, deadlines

def body_cancel_and_deadlines():
    async def main():
        out = {}
        loop = asyncio.get_running_loop()
        loop_errors = []  # what the loop reports (a late reply waking a cancelled task)
        loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
        started = asyncio.Event()

        async def awaiting(fut):
            started.set()
            return await fut
        # a task awaiting the future (ensure_future of the future alone returns it)
        fut = rpc.rpc_async("worker1", after_gate, args=("cancel-task", "late"))
        task = asyncio.ensure_future(awaiting(fut))
        await started.wait()  # the task has gone on into `await fut`, and waits there
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the wait ended with the call still pending: the reply cannot come yet
        out["task_cancelled_while_pending"] = task.cancelled() and not torch_side_done(fut)
        await rpc.rpc_async("worker1", open_gate, args=("cancel-task",))
        out["late"] = await fut  # the call went on; its reply wakes no cancelled task
        # wait_for's timeout ends the wait with the call still pending
        timed = rpc.rpc_async("worker1", async_after_gate, args=("cancel-wait-for", 0))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(timed, 0.1)
        out["timed_out_while_pending"] = timed.cancelled() and not torch_side_done(timed)
        await rpc.rpc_async("worker1", async_open_gate, args=("cancel-wait-for",))
        out["timed_torch_side"] = await loop.run_in_executor(None, timed.wait)
        with pytest.raises(torchwire.RpcTimeoutError):
            await rpc.rpc_async("worker2", async_after_gate, args=("cancel-timeout", 0),
                                timeout=0.1)
        await rpc.rpc_async("worker2", async_open_gate, args=("cancel-timeout",))
        out["after"] = await rpc.rpc_async("worker1", add, args=(1, 2))
        out["loop_errors"] = loop_errors
        return out
    out = asyncio.run(main())
    # the reply that came after its RpcTimeoutError is dropped quietly
    out["settled"] = wait_until(lambda: pending_calls() == 0, 10)
    return out


def test_cancelling_an_await_stops_waiting_and_timeouts_still_apply(world):
    out = world.run(0, body_cancel_and_deadlines)
    assert out["task_cancelled_while_pending"] and out["late"] == "late"
    assert out["timed_out_while_pending"] and out["timed_torch_side"] == 0
    assert out["after"] == 3 and out["settled"]
    assert out["loop_errors"] == []


# ---------------------------------------------------------------- a fresh job

def _async_job(rank, world_size):
    """Shutdown with an async def running on the callee's loop completes."""
    if rank == 0:
        fut = rpc.rpc_async("worker1", async_sleep, args=(0.2, "finished"))
        return fut.wait()
    return None


def test_graceful_shutdown_waits_for_running_coroutines():
    assert run_world(_async_job, 2)[0] == "finished"


# ---------------------------------------------------------------- distributed autograd

async def async_scale_via(to, x):
    """Awaits a nested call in the caller's autograd context, then computes locally."""
    y = await rpc.rpc_async(to, torch.mul, args=(x, 3.0))
    await asyncio.sleep(0)
    return y * 2


def body_async_def_in_autograd_context():
    import torchwire.autograd as dist_autograd
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", async_scale_via, args=("worker2", x))
        dist_autograd.backward(cid, [y.sum()])
        return y.tolist(), dist_autograd.get_gradients(cid)[x].tolist()


def test_an_async_def_runs_in_the_callers_autograd_context(world):
    value, grad = world.run(0, body_async_def_in_autograd_context)
    assert value == [6.0, 6.0] and grad == [6.0, 6.0]


# ---------------------------------------------------------------- asyncio's future interface

def body_futures_are_asyncio_futures():
    outside = asyncio.isfuture(rpc.rpc_async("worker1", add, args=(0, 0)))
    fresh_loop = asyncio.new_event_loop()
    try:  # a loop not yet running wraps it in a task, as before
        by_run_until_complete = fresh_loop.run_until_complete(
            rpc.rpc_async("worker1", add, args=(2, 2)))
    finally:
        fresh_loop.close()

    async def main():
        out = {"outside": outside, "run_until_complete": by_run_until_complete}
        loop_thread = threading.get_ident()
        fast = rpc.rpc_async("worker1", add, args=(1, 1))
        slow = rpc.rpc_async("worker2", sleep_then, args=(0.5, "slow"))
        out["isfuture"] = asyncio.isfuture(fast)
        # gather takes the futures as they are: no task per future
        gathered = asyncio.gather(*[rpc.rpc_async("worker3", add, args=(i, 1))
                                    for i in range(200)])
        out["tasks_while_gathering"] = len(asyncio.all_tasks())
        out["gather"] = await gathered
        done, pending = await asyncio.wait({fast, slow},
                                           return_when=asyncio.FIRST_COMPLETED)
        out["first_completed"] = (done == {fast}, pending == {slow})
        out["shield"] = await asyncio.shield(slow)
        # a callback added on the loop runs on the loop, with the future
        seen = []
        cb_fut = rpc.rpc_async("worker1", add, args=(3, 4))
        ran = asyncio.Event()
        cb_fut.add_done_callback(
            lambda f: (seen.append((threading.get_ident() == loop_thread, f.result())),
                       ran.set()))
        # (asyncio's rule: a callback added once the future is done cannot be
        # removed; this call completes only after the removal)
        removed = rpc.rpc_async("worker1", after_gate, args=("removed", 10))
        never = []

        def never_runs(f):
            never.append(f.result())
        removed.add_done_callback(never_runs)
        out["removed"] = removed.remove_done_callback(never_runs)
        await rpc.rpc_async("worker1", open_gate, args=("removed",))
        await ran.wait()
        await removed
        await asyncio.sleep(0)  # a removed callback that still ran would have by now
        out["callback"] = (seen, never)
        # cancelling a gather cancels its futures: waiting stops with the calls still
        # pending, and their late replies complete the torch side only
        loop = asyncio.get_running_loop()
        loop_errors = []  # what the loop reports (a late reply waking a cancelled wait)
        loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
        late = rpc.rpc_async("worker1", after_gate, args=("gather-1", "late"))
        other = rpc.rpc_async("worker2", after_gate, args=("gather-2", 1))
        gather = asyncio.gather(late, other)
        gather.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gather
        out["gather_cancelled_while_pending"] = not (torch_side_done(late)
                                                     or torch_side_done(other))
        out["late_cancelled"] = late.cancelled() and other.cancelled()
        with pytest.raises(asyncio.CancelledError):
            late.result()
        with pytest.raises(asyncio.CancelledError):
            await late
        # wait_for's timeout cancels the future it was given
        timed = rpc.rpc_async("worker3", after_gate, args=("wait-for-timed", "timed"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(timed, 0.05)
        out["timed_cancelled"] = timed.cancelled() and not torch_side_done(timed)
        for worker, key in (("worker1", "gather-1"), ("worker2", "gather-2"),
                            ("worker3", "wait-for-timed")):
            await rpc.rpc_async(worker, open_gate, args=(key,))
        # the replies come while the loop runs, and nothing broke
        out["late_torch_side"] = await loop.run_in_executor(None, late.wait)
        out["other_torch_side"] = await loop.run_in_executor(None, other.wait)
        out["timed_torch_side"] = await loop.run_in_executor(None, timed.wait)
        out["served_after"] = await rpc.rpc_async("worker1", add, args=(2, 3))
        out["loop_errors"] = loop_errors
        return out
    out = asyncio.run(main())
    out["settled"] = wait_until(lambda: pending_calls() == 0, 10)
    return out


def test_futures_are_asyncio_futures_inside_a_loop(world):
    out = world.run(0, body_futures_are_asyncio_futures)
    assert out["outside"] is False and out["isfuture"] is True
    assert out["run_until_complete"] == 4
    assert out["tasks_while_gathering"] == 1  # the main task only
    assert out["gather"] == [i + 1 for i in range(200)]
    assert out["first_completed"] == (True, True) and out["shield"] == "slow"
    assert out["callback"] == ([(True, 7)], []) and out["removed"] == 1
    assert out["gather_cancelled_while_pending"] and out["late_cancelled"]
    assert out["timed_cancelled"]
    assert out["late_torch_side"] == "late" and out["other_torch_side"] == 1
    assert out["timed_torch_side"] == "timed" and out["served_after"] == 5
    assert out["settled"] and out["loop_errors"] == []


def _open_fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


def body_loops_come_and_go():
    import gc

    async def one(i):
        return await rpc.rpc_async("worker1", add, args=(i, 1))
    asyncio.run(one(0))  # anything created once per process, created
    gc.collect()
    before = _open_fds()
    values = [asyncio.run(one(i)) for i in range(30)]

    def back_to_before():
        gc.collect()  # a loop is freed by the collector (it refers to itself)
        return _open_fds() <= before
    return values, wait_until(back_to_before, 10), before, _open_fds()


def test_each_loop_gets_its_own_waker_and_closing_it_leaks_nothing(world):
    values, settled, before, after = world.run(0, body_loops_come_and_go)
    assert values == [i + 1 for i in range(30)]
    assert settled, (before, after)



def body_blocking_calls_on_a_loop_thread():
    async def main():
        # Blocking calls inside a coroutine (discouraged: they block the loop, but
        # torch-style code does it): torchwire's own waits must not depend on a
        # callback that would run on this very loop.
        t0 = time.monotonic()
        owned_here = rpc.remote("worker0", sleep_then, args=(0.2, 5))
        value = owned_here.to_here(timeout=10)
        elsewhere = rpc.remote("worker1", sleep_then, args=(0.1, 6)).to_here(timeout=10)
        chained = rpc.rpc_async("worker1", add, args=(1, 2)).then(lambda f: f.wait() * 2)
        return value, elsewhere, chained.wait(), time.monotonic() - t0
    return asyncio.run(main())


def test_blocking_calls_inside_a_coroutine_still_return(world):
    value, elsewhere, chained, elapsed = world.run(0, body_blocking_calls_on_a_loop_thread)
    assert (value, elsewhere, chained) == (5, 6, 6)
    assert elapsed < 5, elapsed  # not a timeout of a wait that could never end


# ---------------------------------------------------------------- first calls

def body_first_calls_race_the_import():
    import _slow_import_target as target
    futs = [rpc.rpc_async("worker3", target.triple, args=(i,)) for i in range(16)]
    return [f.wait() for f in futs]


def test_concurrent_first_calls_wait_for_the_module_import(world):
    # worker3 has not imported the module: 16 requests run on its pool at once, and
    # each must wait for the import the first one started (not find it half done)
    assert world.run(0, body_first_calls_race_the_import) == [3 * i for i in range(16)]
