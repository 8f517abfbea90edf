"""Timeouts and futures: per-call, zero and default timeouts, one timer for all
calls, wait_all raising the first error at once, callbacks run once and in the order
they were added, and rpc_sync's reply (its value, a fresh copy of its error, its
timeout)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world, wait_until
from test_rpc import add, raise_value_error, sleep_then


# ---------------------------------------------------------------- timeouts

_finished: dict = {}


def sleep_then_count(seconds, value, key):
    """:func:`sleep_then`, then count ``key`` as finished (its reply goes next)."""
    time.sleep(seconds)
    _finished[key] = _finished.get(key, 0) + 1
    return value


def finished(key):
    return _finished.get(key, 0)


def body_timeouts():
    out = {}
    t0 = time.monotonic()
    try:
        rpc.rpc_sync("worker1", sleep_then_count, args=(3, "late", "late1"), timeout=0.5)
    except RuntimeError as exc:
        out["sync"] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    t0 = time.monotonic()
    fut = rpc.rpc_async("worker2", sleep_then_count, args=(3, "late", "late2"), timeout=0.3)
    try:
        fut.wait()
    except RuntimeError as exc:
        out["async"] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # 0 = no limit, even when the default would have expired
    out["zero"] = rpc.rpc_sync("worker3", sleep_then, args=(0.2, "ok"), timeout=0)
    # once the late calls finished, a reply on the same connection comes after theirs:
    # the late replies were dropped and the workers still serve
    out["finished"], out["after"] = [], []
    for r in (1, 2):
        to, key = f"worker{r}", f"late{r}"
        out["finished"].append(
            wait_until(lambda to=to, key=key: rpc.rpc_sync(to, finished, args=(key,)) == 1, 10))
        out["after"].append(rpc.rpc_sync(to, add, args=(r, 1)))
    return out


def test_timeouts(world):
    out = world.run(0, body_timeouts)
    name, msg, elapsed = out["sync"]
    assert name == "RpcTimeoutError"
    assert "RPC ran for more than set timeout" in msg and "worker1" in msg
    assert 0.5 <= elapsed < 1.0
    name, msg, elapsed = out["async"]
    assert name == "RpcTimeoutError" and 0.3 <= elapsed < 0.8
    assert out["zero"] == "ok"
    assert out["finished"] == [True, True] and out["after"] == [2, 3]


def test_default_rpc_timeout_applies():
    def body(rank, world_size):
        if rank == 0:
            t0 = time.monotonic()
            with pytest.raises(torchwire.RpcTimeoutError, match="1000 ms"):
                rpc.rpc_sync("worker1", sleep_then, args=(2, None))
            return time.monotonic() - t0
        return None

    elapsed = run_world(body, 2, rpc_timeout=1, init_timeout=60)[0]
    assert 1.0 <= elapsed < 1.5


def body_one_timer():
    before = threading.active_count()
    futs = [rpc.rpc_async("worker1", sleep_then, args=(0.02, i), timeout=20) for i in range(200)]
    during = threading.active_count()
    values = torch.futures.wait_all(futs)
    return before, during, values


def test_one_timer_for_all_calls(world):
    before, during, values = world.run(0, body_one_timer)
    assert values == list(range(200))
    assert during - before <= 2  # at most a new connection's reader, never a thread per call


def body_wait_all_with_an_error():
    futs = [rpc.rpc_async("worker1", add, args=(1, 1)),
            rpc.rpc_async("worker1", raise_value_error, args=("second failed",)),
            rpc.rpc_async("worker1", sleep_then, args=(3.0, 3))]
    try:
        torch.futures.wait_all(futs)
    except ValueError as exc:
        done = [f.done() for f in futs]
        return str(exc).splitlines()[1], done, futs[2].wait()
    return None


def test_wait_all_raises_the_first_error_without_waiting_for_the_rest(world):
    # as torch's wait_all does for its own futures: the error is raised at once
    message, done, last = world.run(0, body_wait_all_with_an_error)
    assert message == "ValueError(second failed)"
    assert done == [True, True, False] and last == 3


def ordered_callbacks():
    order = []
    fut = rpc.rpc_async("worker1", sleep_then, args=(0.2, 5))
    fut.add_done_callback(lambda f: (time.sleep(0.05), order.append("first")))
    then = fut.then(lambda f: order.append("then") or f.wait())
    fut.add_done_callback(lambda f: 1 / 0)  # logged; the callbacks after it still run
    last = threading.Event()
    fut.add_done_callback(lambda f: (order.append("last"), last.set()))
    assert then.wait() == 5 and last.wait(10)
    late = []
    fut.add_done_callback(lambda f: late.append(f.wait()))  # done: runs at once
    return order, late, torch.futures.wait_all([rpc.rpc_async("worker1", add, args=(1, 2))])


def test_a_future_completing_while_a_callback_is_added_runs_it_once_without_deadlock():
    from torchwire._agent.future import Future

    class CompletesRightAfterTheCheck(Future):
        """Completes between the check that it is not done and the callback's
        registration."""

        def _completed(self):
            was = super()._completed()
            if not was:
                self.set_result(7)
            return was

    hits, finished = [], threading.Event()

    def add():
        fut = CompletesRightAfterTheCheck()
        fut.add_done_callback(lambda f: hits.append(f.wait()))
        fut.then(lambda f: hits.append(-f.wait()))
        finished.set()

    threading.Thread(target=add, daemon=True).start()
    assert finished.wait(10), "add_done_callback deadlocked on a future completing meanwhile"
    assert hits == [7, -7]


def test_callbacks_run_in_the_order_they_were_added(world):
    # completed on the reader thread, the callbacks move to the pool: still in order
    order, late, plain = world.run(0, ordered_callbacks)
    assert order == ["first", "then", "last"] and late == [5] and plain == [3]


# ---------------------------------------------------------------- rpc_sync's reply

def test_a_sync_reply_hands_over_its_value_or_a_fresh_copy_of_its_error():
    # rpc_sync's reply object (a lock the reader releases, not a torch future)
    from torchwire._agent.future import SyncReply
    ok = SyncReply()
    assert not ok.done()
    threading.Timer(0.05, ok.set_result, args=([1, 2],)).start()
    assert ok.wait() == [1, 2] and ok.done()
    assert ok.wait() == [1, 2]  # again: still the value

    bad = SyncReply()
    stored = ValueError("boom")
    stored.__cause__ = KeyError("why")
    bad.set_exception(stored)
    raised = []
    for _ in range(2):
        with pytest.raises(ValueError, match="^boom$") as info:
            bad.wait()
        raised.append(info.value)
    # a copy each time, chained to the cause; the stored error never gains the
    # waiter's frames (which would keep their locals alive through a cycle)
    assert raised[0] is not stored and raised[1] is not stored
    assert isinstance(raised[0].__cause__, KeyError)
    assert stored.__traceback__ is None


def body_sync_errors():
    out = []
    for _ in range(2):
        try:
            rpc.rpc_sync("worker1", raise_value_error, args=("nope",))
        except ValueError as exc:
            out.append(str(exc))
    try:
        rpc.rpc_sync("worker1", sleep_then, args=(2, "late"), timeout=0.2)
    except torchwire.RpcTimeoutError as exc:
        out.append(type(exc).__name__)
    out.append(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist())
    return out


def test_rpc_sync_raises_the_remote_error_and_times_out(world):
    out = world.run(0, body_sync_errors)
    assert len(out) == 4 and all("ValueError(nope)" in m for m in out[:2]), out
    assert out[2:] == ["RpcTimeoutError", [2.0, 2.0]]
