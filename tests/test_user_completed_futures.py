"""A caller may complete an ``rpc_async`` future itself (torch's futures allow
``set_result``): the call's late reply, or its deadline, then has nowhere to go and
is dropped, without breaking the connection or the timer's other expiries.

Fresh two-worker jobs (``run_world``): worker0 calls, worker1 serves.  The calls on
worker1 wait at a gate that worker0 opens once its futures are completed, so each
reply comes after the caller's ``set_result``.
"""

from __future__ import annotations

import threading

import pytest

import torchwire.rpc as rpc
from _cluster import run_world

pytestmark = pytest.mark.timeout(120)

_gate = threading.Event()


def behind_gate(value):
    if not _gate.wait(60):
        raise TimeoutError("the gate was never opened")
    return value


def open_gate():
    _gate.set()


def add(a, b):
    return a + b


def _late_reply(rank, world_size):
    if rank != 0:
        return None
    mine = rpc.rpc_async("worker1", behind_gate, args=(1,))
    other = rpc.rpc_async("worker1", behind_gate, args=(2,))
    mine.set_result("set by the caller")
    rpc.rpc_sync("worker1", open_gate)
    # the reply to `mine` came first, or meanwhile: `other`, on the same connection,
    # still gets its own
    got = (other.wait(), mine.wait(), rpc.rpc_sync("worker1", add, args=(1, 2)))
    return got


def test_a_reply_to_a_future_the_caller_completed_is_dropped_quietly():
    assert run_world(_late_reply, timeout=60)[0] == (2, "set by the caller", 3)


def _deadline_after_set_result(rank, world_size):
    if rank != 0:
        return None
    # back to back: one expiry of the timer takes both
    mine = rpc.rpc_async("worker1", behind_gate, args=(1,), timeout=0.5)
    other = rpc.rpc_async("worker1", behind_gate, args=(2,), timeout=0.5)
    mine.set_result("set by the caller")
    try:
        other.wait()
        outcome = "returned"
    except RuntimeError as exc:
        outcome = type(exc).__name__
    rpc.rpc_sync("worker1", open_gate)
    return outcome, mine.wait(), rpc.rpc_sync("worker1", add, args=(1, 2))


def test_a_deadline_of_a_future_the_caller_completed_spares_the_others():
    outcome, mine, after = run_world(_deadline_after_set_result, timeout=60)[0]
    assert outcome == "RpcTimeoutError"
    assert mine == "set by the caller" and after == 3
