"""Remote functions that fail in ways an ``except Exception`` misses, and replies that
cannot be built: the caller always gets an error naming the cause, and the callee
keeps serving.

Each case runs in a fresh two-worker job (``run_world``): worker0 calls, worker1
serves.  A call that got no reply would hang until its timeout (``timeout=0``: for
good), which ``run_world`` reports as a child that did not finish.
"""

from __future__ import annotations

import pytest

import torchwire.rpc as rpc
from _cluster import run_world

pytestmark = pytest.mark.timeout(120)


def add(a, b):
    return a + b


def exits(code):
    raise SystemExit(code)


async def exits_async(code):
    raise SystemExit(code)


async def add_async(a, b):
    return a + b


class BadStr(ValueError):
    def __str__(self):
        raise RuntimeError("no text for you")


def raises_bad_str():
    raise BadStr("hidden")


class ExitsWhenPickled:
    def __reduce__(self):
        raise SystemExit(5)


def returns_unpicklable():
    return ExitsWhenPickled()


class BrokenPickle:
    def __reduce__(self):
        raise ValueError("refuses to be pickled")


def returns_broken():
    return [1, BrokenPickle()]


def _call_error(fn, *args) -> BaseException:
    """The error ``rpc_sync`` to worker1 raises (with no deadline: only a reply ends
    it), asserting it raised one."""
    try:
        rpc.rpc_sync("worker1", fn, args=args, timeout=0)
    except BaseException as exc:  # SystemExit must not reach the caller as such
        return exc
    raise AssertionError(f"{fn.__name__} returned instead of failing")


def _cases(rank, world_size):
    if rank != 0:
        return None
    seen = {}
    exc = _call_error(exits, 3)
    seen["exit"] = (type(exc).__name__, str(exc))
    exc = _call_error(exits_async, 4)
    seen["exit_async"] = (type(exc).__name__, str(exc))
    seen["after_async"] = rpc.rpc_sync("worker1", add_async, args=(2, 3), timeout=0)
    exc = _call_error(raises_bad_str)
    # rebuilt as a BadStr (a subclass whose message reads: its own __str__ fails)
    seen["bad_str"] = (type(exc).__name__, str(exc), isinstance(exc, BadStr))
    exc = _call_error(returns_unpicklable)
    seen["exit_pickling"] = (type(exc).__name__, str(exc))
    exc = _call_error(returns_broken)
    seen["broken_pickle"] = (type(exc).__name__, str(exc))
    seen["still_serving"] = rpc.rpc_sync("worker1", add, args=(1, 2), timeout=0)
    return seen


def test_failures_past_except_exception_reach_the_caller_and_the_callee_serves_on():
    seen = run_world(_cases, timeout=90)[0]
    kind, text = seen["exit"]
    assert kind != "SystemExit" and "SystemExit" in text and "3" in text, seen["exit"]
    assert "worker1" in text
    kind, text = seen["exit_async"]
    assert kind != "SystemExit" and "SystemExit" in text and "4" in text, seen["exit_async"]
    assert seen["after_async"] == 5  # the callee's event loop survived
    kind, text, caught = seen["bad_str"]
    assert kind == "BadStr" and caught and "str() raised RuntimeError" in text, seen["bad_str"]
    kind, text = seen["exit_pickling"]
    assert kind != "SystemExit" and "SystemExit" in text, seen["exit_pickling"]
    kind, text = seen["broken_pickle"]
    assert "refuses to be pickled" in text or "BrokenPickle" in text, seen["broken_pickle"]
    assert seen["still_serving"] == 3
