"""torch's private collectives (``_all_gather``, ``_barrier``, ``_wait_all_workers``)
when a worker dies: the waits end, naming it, instead of hanging; a slow worker that
is alive is still waited for, past the RPC timeout.

Workers are forked from this process (``_cluster``), which kills them with SIGKILL once
the survivors are inside the wait: the leader's round shows the followers' objects.  A
collective runs on a thread of its worker, joined with a bound, so a hang is reported
("hung") instead of stalling the test.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

import torchwire.rpc as rpc
from _cluster import options, wait_until
from test_failures import _reap, _result, _start

_ctx = mp.get_context("fork")

pytestmark = pytest.mark.timeout(90)

_HANG = 20.0  # seconds after which a collective that has not returned counts as hung
_BOUND = 5.0  # seconds within which a wait must end once its worker is lost


def _init(rank, world_size, init_method, **opts):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method, **opts))


def _gathered() -> int:
    """On the leader: how many objects its fullest round holds (its wait has begun for
    the workers that sent theirs)."""
    from torchwire._agent.runtime import current
    rounds = list(current.runtime.collectives.rounds.values())
    return max((len(r.gathered_objects) for r in rounds), default=0)


def _run_bounded(fn, *args) -> tuple:
    """Run ``fn(*args)`` on a thread; ("ok", value, end) or ("err", type name,
    message, worker_name, end) with ``end`` its monotonic end time, or ("hung",)."""
    out: list = []

    def go():
        try:
            value = fn(*args)
            out.append(("ok", value, time.monotonic()))
        except Exception as exc:
            out.append(("err", type(exc).__name__, str(exc), getattr(exc, "worker_name", None),
                        time.monotonic()))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(_HANG)
    return out[0] if out else ("hung",)


def _start_in_thread(fn, *args) -> list:
    """Run ``_run_bounded(fn, *args)`` on a thread; its result lands in the list."""
    out: list = []
    threading.Thread(target=lambda: out.append(_run_bounded(fn, *args)), daemon=True).start()
    return out


def _take_part(rank, waiting, fn, *args) -> tuple:
    """``_run_bounded(fn, *args)`` on this worker; the leader (rank 0) sets ``waiting``
    once it holds two objects (its wait for the third has begun)."""
    result = _start_in_thread(fn, *args)
    if rank == 0:
        assert wait_until(lambda: _gathered() == 2 or bool(result), 30)
        waiting.set()
    assert wait_until(lambda: bool(result), _HANG + 10)
    return result[0]


def _kill(procs, rank, killed_at) -> None:
    killed_at.value = time.monotonic()
    os.kill(procs[rank][0].pid, signal.SIGKILL)


def _assert_ended_naming(result, name: str, since: float) -> None:
    assert result[0] != "hung", f"the wait did not end within {_HANG} s"
    assert result[0] == "err", f"expected an error naming {name}, got {result}"
    _, kind, message, worker_name, end = result
    assert kind == "WorkerUnavailableError", result
    assert worker_name == name and f"{name} was lost" in message, message
    assert message.startswith("_all_gather:"), message
    assert end - since < _BOUND, f"ended {end - since:.2f} s after the loss"


# ---------------------------------------------------------------- a participant dies


@pytest.mark.parametrize("when", ["while_others_wait", "before_it_ever_talked"])
def test_a_participant_lost_before_it_takes_part_ends_all_gather_naming_it(when):
    # worker0 leads, worker1 follows, worker2 never takes part: SIGKILLed while the
    # other two wait, or before they start (and before it ever talked to anyone, so the
    # leader learns of it only by dialling it).
    ready, waiting, killed = _ctx.Barrier(4), _ctx.Event(), _ctx.Event()
    parked = _ctx.Event()
    killed_at = _ctx.Value("d", 0.0)

    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method)
        ready.wait(30)
        if rank == 2:
            # killed meanwhile, once out of the barrier (a process killed while it holds
            # a shared lock leaves the others waiting for it), and not in a wait on a
            # shared event (a process killed in one leaves its condition waiting for it)
            parked.set()
            threading.Event().wait(60)
            return None
        if when == "before_it_ever_talked":
            assert killed.wait(30)
        result = _take_part(rank, waiting, rpc.api._all_gather, rank)
        if result[0] == "hung":
            return result, None  # no shutdown: it would wait for the hung gather
        # the survivors' next round, without the lost worker, completes
        again = rpc.api._all_gather(rank * 10, {"worker0", "worker1"})
        rpc.shutdown()
        return result, again

    procs = _start(body, 3)
    try:
        ready.wait(60)
        if when == "before_it_ever_talked":
            assert parked.wait(60)
            _kill(procs, 2, killed_at)
            killed.set()
        else:
            assert waiting.wait(60)
            _kill(procs, 2, killed_at)
        (leader, again0), (follower, again1) = _result(procs, 0), _result(procs, 1)
    finally:
        _reap(procs)
    _assert_ended_naming(leader, "worker2", killed_at.value)
    _assert_ended_naming(follower, "worker2", killed_at.value)
    assert "before it took part" in leader[2]
    assert "the leader worker0 gave the round up" in follower[2]
    assert again0 == again1 == {"worker0": 0, "worker1": 10}


def test_a_barrier_with_a_lost_participant_returns_and_logs_the_worker():
    # As torch's, _barrier raises nothing: a user sees it return and the error logged.
    ready, waiting = _ctx.Barrier(4), _ctx.Event()
    killed_at = _ctx.Value("d", 0.0)

    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method)
        logged: list = []

        class Keep(logging.Handler):
            def emit(self, record):
                logged.append(self.format(record))

        logging.getLogger("torchwire").addHandler(Keep(logging.ERROR))
        ready.wait(30)
        if rank == 2:
            threading.Event().wait(60)  # killed
            return None
        names = ["worker0", "worker1", "worker2"]
        result = _take_part(rank, waiting, rpc.api._barrier, names)
        if result[0] != "hung":
            rpc.shutdown()
        return result, logged

    procs = _start(body, 3)
    try:
        ready.wait(60)
        assert waiting.wait(60)
        _kill(procs, 2, killed_at)
        results = [_result(procs, r) for r in (0, 1)]
    finally:
        _reap(procs)
    for result, logged in results:
        assert result[0] == "ok", f"_barrier did not return within {_HANG} s: {result}"
        assert result[2] - killed_at.value < _BOUND
        assert any("_barrier failed" in m and "worker2 was lost" in m for m in logged), logged


def test_the_leader_lost_ends_the_followers_wait_naming_it():
    # worker1 and worker2 wait for worker0's result; worker0, which has both objects,
    # is SIGKILLed before it sends it.
    ready, waiting = _ctx.Barrier(4), _ctx.Event()
    killed_at = _ctx.Value("d", 0.0)

    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method)
        ready.wait(30)
        if rank == 0:  # the leader: it never calls _all_gather itself
            assert wait_until(lambda: _gathered() == 2, 30)
            waiting.set()
            threading.Event().wait(60)  # killed
            return None
        result = _run_bounded(rpc.api._all_gather, rank)
        if result[0] != "hung":
            rpc.shutdown(graceful=False)
        return result

    procs = _start(body, 3)
    try:
        ready.wait(60)
        assert waiting.wait(60)
        _kill(procs, 0, killed_at)
        followers = [_result(procs, r) for r in (1, 2)]
    finally:
        _reap(procs)
    for result in followers:
        _assert_ended_naming(result, "worker0", killed_at.value)
        assert "the leader worker0 was lost" in result[2], result


def test_a_participant_that_leaves_a_dynamic_group_ends_all_gather_naming_it():
    # A dynamic group (no world size): worker2 leaves (graceful shutdown) while worker0
    # and worker1 wait for it in a gather over the three.
    ready, waiting = _ctx.Barrier(3), _ctx.Event()
    left_at = _ctx.Value("d", 0.0)

    def body(rank, _world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=options(init_method))
        assert wait_until(lambda: len(rpc._get_current_rpc_agent().get_worker_infos()) == 3,
                          30)
        ready.wait(30)
        if rank == 2:
            assert waiting.wait(30)
            left_at.value = time.monotonic()
            rpc.shutdown()
            return None
        result = _take_part(rank, waiting, rpc.api._all_gather, rank,
                            {"worker0", "worker1", "worker2"})
        if result[0] != "hung":
            rpc.shutdown()
        return result

    procs = _start(body, 3)
    try:
        leader, follower, _ = (_result(procs, r) for r in range(3))
    finally:
        _reap(procs)
    _assert_ended_naming(leader, "worker2", left_at.value)
    _assert_ended_naming(follower, "worker2", left_at.value)
    assert "it left the RPC group" in leader[2] and "it left the RPC group" in follower[2]


# ---------------------------------------------------------------- slow, not lost

_RPC_TIMEOUT = 0.5


@pytest.mark.parametrize("call", ["_all_gather", "_wait_all_workers"])
def test_a_slow_participant_that_arrives_after_the_rpc_timeout_still_completes(call):
    # Without a timeout of its own the wait has no bound (torch's): worker2 arrives
    # three RPC timeouts after the others began to wait, and every one gets the result.
    ready, waiting = _ctx.Barrier(3), _ctx.Event()

    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method, rpc_timeout=_RPC_TIMEOUT, init_timeout=60)
        ready.wait(30)
        if rank == 2:
            assert waiting.wait(30)
            time.sleep(3 * _RPC_TIMEOUT)  # the slowness under test, not a wait for an event
        if call == "_all_gather":
            fn, args = rpc.api._all_gather, (rank,)
        else:
            fn, args = rpc.api._wait_all_workers, ()
        t0 = time.monotonic()
        result = _take_part(rank, waiting, fn, *args)
        if result[0] != "hung":
            rpc.shutdown()
        return result, t0

    procs = _start(body, 3)
    try:
        results = [_result(procs, r) for r in range(3)]
    finally:
        _reap(procs)
    expected = {"worker0": 0, "worker1": 1, "worker2": 2} if call == "_all_gather" else None
    for rank, (result, t0) in enumerate(results):
        assert result[0] == "ok", f"worker{rank}: {result}"
        assert result[1] == expected
        if rank < 2:
            assert result[2] - t0 > 2 * _RPC_TIMEOUT  # it did wait past the RPC timeout
