"""A user's mistakes get a clear error on the caller, never a silent wrong result, and
the workers serve on.

Each case was found comparing torchwire with torch.distributed.rpc on the same
mistake: torch raised (or timed out at once), torchwire ran something else.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.rpc as torch_rpc

import torchwire
import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from _cluster import run_world

pytestmark = pytest.mark.timeout(90)


def _whoami():
    return rpc.get_worker_info().name


def _count(*args):
    return len(args)


def _slow_one(seconds):
    import time
    time.sleep(seconds)
    return 1


def _name_of(f):
    return f.name


class StrBoom(Exception):
    """An exception whose message cannot be read."""

    def __str__(self):
        raise RuntimeError("no message for you")


def _raise_str_boom():
    raise StrBoom()


def _outcome(fn, *args, **kwargs):
    """What ``fn(*args, **kwargs)`` gave: ``("ok", value)`` or ``(type name, message)``."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def test_misused_calls_raise_on_the_caller_and_the_workers_serve_on(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some text\n" * 100)

    def body(rank, world_size):
        if rank == 1:
            return None
        out = {}
        # timeouts: infinity is no limit (as 0); NaN is refused
        out["inf"] = _outcome(rpc.rpc_sync, "worker1", _slow_one, args=(0.2,),
                              timeout=math.inf)
        out["inf_remote"] = _outcome(
            lambda: rpc.remote("worker1", _slow_one, args=(0.2,), timeout=math.inf)
            .to_here(timeout=math.inf))
        out["nan"] = _outcome(rpc.rpc_sync, "worker1", _slow_one, args=(0.2,),
                              timeout=math.nan)
        # a destination of None is a mistake, not this worker
        out["none"] = _outcome(rpc.rpc_sync, None, _whoami)
        out["none_remote"] = _outcome(rpc.remote, None, _whoami)
        # args=(t) for args=(t,): the tensor's rows would become the arguments
        out["tensor_args"] = _outcome(rpc.rpc_sync, "worker1", _count, args=torch.ones(2))
        out["int_args"] = _outcome(rpc.rpc_sync, "worker1", _count, args=5)
        out["list_args"] = _outcome(rpc.rpc_sync, "worker1", _count, args=[1, 2, 3])
        # an open file does not travel (by value, it would be read from the start)
        with open(path) as f:
            out["file"] = _outcome(rpc.rpc_sync, "worker1", _count, args=(f,))
        # a WorkerInfo must name a member: its name as well as its rank
        out["bad_info"] = _outcome(rpc.rpc_sync, rpc.WorkerInfo("nosuch", 1), _whoami)
        out["good_info"] = _outcome(rpc.rpc_sync, rpc.get_worker_info("worker1"), _whoami)
        out["torch_info"] = _outcome(rpc.rpc_sync, torch_rpc.WorkerInfo("worker1", 1), _whoami)
        # an exception whose __str__ fails arrives as one whose message can be read
        try:
            rpc.rpc_sync("worker1", _raise_str_boom)
        except StrBoom as exc:  # still the remote function's exception type
            out["str_boom"] = (type(exc).__name__, str(exc))
        out["serving"] = rpc.rpc_sync("worker1", _whoami, timeout=10)
        return out

    out = run_world(body, 2, timeout=80)[0]
    assert out["inf"] == ("ok", 1) and out["inf_remote"] == ("ok", 1), out
    assert out["nan"][0] == "ValueError" and "nan" in out["nan"][1], out["nan"]
    for key in ("none", "none_remote"):
        assert out[key][0] == "ValueError" and "None" in out[key][1], out[key]
    assert out["tensor_args"][0] == "TypeError" and "args=(t,)" in out["tensor_args"][1], out
    assert out["int_args"] == ("TypeError", "args must be a tuple of arguments, got int"), out
    assert out["list_args"] == ("ok", 3)
    assert out["file"][0] == "SerializationError" and "open file" in out["file"][1], out
    assert out["bad_info"][0] == "UnknownWorkerError" and "nosuch" in out["bad_info"][1], out
    assert out["good_info"] == ("ok", "worker1") and out["torch_info"] == ("ok", "worker1")
    kind, message = out["str_boom"]
    assert kind == "StrBoom" and "worker1" in message, message
    assert out["serving"] == "worker1"


def _double_backward(retain_first: bool):
    """Two backward passes from the same loss, whose graph crosses worker1; what each
    gave, and the gradient of the leaf after them."""
    t = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t, t)).sum()
        first = _outcome(dist_autograd.backward, cid, [loss], retain_graph=retain_first)
        second = _outcome(dist_autograd.backward, cid, [loss])
        third = _outcome(dist_autograd.backward, cid, [loss])
        grad = dist_autograd.get_gradients(cid)[t].tolist()
    return first, second, third, grad


def test_a_second_backward_through_a_freed_graph_raises_torchs_error():
    def body(rank, world_size):
        if rank == 1:
            return None
        return _double_backward(False), _double_backward(True)

    once, retained = run_world(body, 2, timeout=80)[0]
    first, second, third, grad = once
    assert first == ("ok", None), first
    for later in (second, third):
        assert later[0] == "DistAutogradError", later
        assert later[1].startswith("Error on Node 0: Trying to backward through the graph a "
                                   "second time"), later
    assert grad == [2.0, 2.0], "the gradients of a refused pass were added"
    # retain_graph=True keeps the graph for one more pass, which frees it
    first, second, third, grad = retained
    assert first == ("ok", None) and second == ("ok", None), retained
    assert third[0] == "DistAutogradError" and "second time" in third[1], third
    assert grad == [4.0, 4.0]
    assert issubclass(torchwire.DistAutogradError, RuntimeError)
