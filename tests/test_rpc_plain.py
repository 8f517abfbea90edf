"""Plain messages: which requests and replies travel without pickling (None and plain
tensors as replies; simple arguments to a function reachable by name as requests),
that the function sees the same arguments either way, and that a malformed plain
request or reply, or one naming a function the callee lacks, fails its own call while
both workers keep serving."""

from __future__ import annotations

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from test_rpc import add, count_plain_calls, count_plain_replies


# ---------------------------------------------------------------- replies

def identity(x):
    return x


def body_plain_replies():
    """Which return values come back without pickling, and that each arrives as it
    left: (value, went plain)."""
    out = []
    values = [None, torch.arange(6.0).reshape(2, 3), torch.empty(0, 4, dtype=torch.int64),
              torch.tensor(True), torch.arange(12).reshape(3, 4).t(),  # not contiguous
              [torch.ones(2)], 7, torch.nn.Parameter(torch.ones(2)),
              torch.ones(3, requires_grad=True)]
    for v in values:
        before = count_plain_replies()
        got = rpc.rpc_sync("worker1", identity, args=(v,))
        plain = count_plain_replies() - before
        if isinstance(v, torch.Tensor):
            assert type(got) is type(v) and got.dtype == v.dtype and torch.equal(got, v)
            assert got.requires_grad == v.requires_grad
        elif isinstance(v, list):
            assert torch.equal(got[0], v[0])
        else:
            assert got == v
        out.append(plain)
    return out


def test_none_and_plain_tensors_are_replied_without_pickling(world):
    assert world.run(0, body_plain_replies) == [1, 1, 1, 1, 0, 0, 0, 0, 0]


def break_plain_replies(on: bool):
    from torchwire import _serialization as ser
    if on:
        break_plain_replies.saved = ser.plain_reply
        ser.plain_reply = lambda value: (bytes([99]), []) if value is None else None
    else:
        ser.plain_reply = break_plain_replies.saved
    return on  # (not None: this reply is pickled, the broken encoder leaves it alone)


def body_malformed_plain_reply():
    rpc.rpc_sync("worker1", break_plain_replies, args=(True,))
    try:
        with pytest.raises(torchwire.SerializationError,
                           match="cannot decode the reply from worker1: unknown plain reply"):
            rpc.rpc_sync("worker1", identity, args=(None,))
        return rpc.rpc_sync("worker1", add, args=(20, 22))
    finally:
        rpc.rpc_sync("worker1", break_plain_replies, args=(False,))


def test_a_malformed_plain_reply_fails_its_call_and_the_caller_keeps_serving(world):
    assert world.run(0, body_malformed_plain_reply) == 42


# ---------------------------------------------------------------- requests

def describe(*args, **kwargs):
    return [(type(a).__name__, a.tolist() if isinstance(a, torch.Tensor) else
             a.to_here().tolist() if isinstance(a, rpc.RRef) else a,
             a.requires_grad if isinstance(a, torch.Tensor) else None) for a in args], \
        sorted(kwargs)


def make_value():
    return torch.arange(3.0)


def body_plain_calls():
    """Which requests go without pickling, and that the function sees the same
    arguments either way: (went plain, what the function saw)."""
    import os
    mine = rpc.RRef(torch.ones(2))
    theirs = rpc.remote("worker1", make_value)
    theirs.to_here()
    elsewhere = rpc.remote("worker2", make_value)
    local_fn = lambda x: x  # noqa: E731 - not picklable by reference: pickled by value
    cases = [
        ((), {}),
        ((None, True, -7, 2 ** 70, 1.5, "s"), {}),
        ((torch.ones(2, 3), torch.empty(0, dtype=torch.int8)), {}),
        ((theirs,), {}),  # an RRef to its owner
        ((torch.ones(2),), {"k": 1}),  # keyword arguments
        ((torch.arange(6.0).reshape(2, 3).t(),), {}),  # not contiguous
        ((torch.ones(2, requires_grad=True),), {}),  # requires grad, no context
        (([1, 2],), {}),
        ((mine,), {}),  # an RRef this worker owns
        ((elsewhere,), {}),  # an RRef owned by a third worker
    ]
    out = []
    for args, kwargs in cases:
        before = rpc.rpc_sync("worker1", count_plain_calls)
        got = rpc.rpc_sync("worker1", describe, args=args, kwargs=kwargs)
        plain = rpc.rpc_sync("worker1", count_plain_calls) - before - 1  # (its own probe)
        assert got == describe(*args, **kwargs), (got, args)
        out.append(plain)
    # builtins and functions not reachable by name are pickled as before
    before = rpc.rpc_sync("worker1", count_plain_calls)
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).tolist() == [2.0]
    assert rpc.rpc_sync("worker1", os.getpid) != os.getpid()
    assert rpc.rpc_sync("worker1", local_fn, args=(1,)) == 1
    out.append(rpc.rpc_sync("worker1", count_plain_calls) - before - 1)
    return out


def test_simple_calls_go_plain_and_others_pickled(world):
    assert world.run(0, body_plain_calls) == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def body_plain_call_to_a_function_the_callee_lacks():
    """A plain call naming a function the callee cannot import fails like a pickled
    one, and the callee keeps serving."""
    import sys
    import types
    mod = types.ModuleType("only_on_worker0")
    exec("def here():\n    return 1\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        with pytest.raises(torchwire.SerializationError, match="only_on_worker0.*importable"):
            rpc.rpc_sync("worker1", mod.here)
    finally:
        del sys.modules[mod.__name__]
    return rpc.rpc_sync("worker1", add, args=(20, 22))


def test_a_plain_call_to_a_missing_function_is_a_clear_error(world):
    assert world.run(0, body_plain_call_to_a_function_the_callee_lacks) == 42


def body_malformed_plain_calls():
    import marshal

    from torchwire import _serialization as ser
    from torchwire._autograd.kinds import AutogradKind
    saved = ser.plain_call
    errors = []
    call = bytes([ser.PlainKind.CALL])
    for payload, tensors in (
            (call + b"junk", []),
            (call + marshal.dumps(("os", "system", None, [(2, "true")])), []),
            (call + marshal.dumps(("test_rpc", "add", None, [(0, 0, (5,))])),
             [torch.ones(2)]),
            (bytes([AutogradKind.REPORT]), [])):
        ser.plain_call = lambda *a, _p=payload, _t=tensors: (_p, _t, None)
        try:
            rpc.rpc_sync("worker1", add, args=(1, 2))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            ser.plain_call = saved
    return errors, rpc.rpc_sync("worker1", add, args=(20, 22))


def test_malformed_plain_calls_fail_their_call_and_the_callee_keeps_serving(world):
    errors, still = world.run(0, body_malformed_plain_calls)
    assert still == 42
    assert len(errors) == 4, errors
    assert "malformed plain message" in errors[0], errors
    assert "os.system, not a function" in errors[1], errors
    assert "malformed tensor" in errors[2], errors
    assert "malformed plain request" in errors[3], errors
