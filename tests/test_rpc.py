"""Remote execution: rpc_sync / rpc_async targets, futures, async_execution, remote
errors, bad destinations and arguments, and the public API surface.  The remote
functions defined here are shared with the other test_rpc_*.py files, and the
plain-message counters at the end with test_rpc_plain.py and test_autograd_messages.py."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world


# ---------------------------------------------------------------- remote functions

def add(a, b):
    return a + b


def noop():
    return None


def echo(x):
    return x


def raise_value_error(msg):
    raise ValueError(msg)


class CustomError(Exception):
    def __init__(self, a, b):  # cannot be rebuilt from one message string
        super().__init__(a, b)


def raise_custom():
    raise CustomError(1, 2)


def return_unpicklable():
    return threading.Lock()


def whoami():
    return rpc.get_worker_info().name


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


@torch.jit.script
def script_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@torch.jit.script
def script_raise(msg: str) -> torch.Tensor:
    raise ValueError(msg)


@rpc.functions.async_execution
def async_add_chained(to, x, y, z):
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(
            lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut


@rpc.functions.async_execution
def async_wrong_type():
    return 42


# ---------------------------------------------------------------- bodies (run on workers)

def body_basic():
    out = {}
    out["name"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
    out["rank"] = rpc.rpc_sync(1, add, args=(2, 3))
    info = rpc.get_worker_info("worker2")
    out["info"] = rpc.rpc_sync(info, whoami)
    out["kwargs"] = rpc.rpc_sync("worker1", add, kwargs={"a": 1, "b": 2})
    out["builtin"] = rpc.rpc_sync("worker1", max, args=(3, 9, 4))
    out["script"] = rpc.rpc_sync("worker3", script_add, args=(torch.ones(2), torch.ones(2)))
    out["self"] = rpc.rpc_sync("worker0", add, args=(1, 1))
    return out


def test_rpc_sync_targets_and_destinations(world):
    out = world.run(0, body_basic)
    assert torch.equal(out["name"], torch.full((2,), 4.0))
    assert out["rank"] == 5
    assert out["info"] == "worker2"
    assert out["kwargs"] == 3
    assert out["builtin"] == 9
    assert torch.equal(out["script"], torch.full((2,), 2.0))
    assert out["self"] == 2


def body_script_error():
    try:
        rpc.rpc_sync("worker1", script_raise, args=("script says no",))
    except Exception as exc:
        return type(exc).__mro__, str(exc), getattr(exc, "remote_type", None)


def test_a_failing_script_function_raises_a_runtime_error_with_its_message(world):
    # as torch's RPC: a RuntimeError (the interpreter's torch.jit.Error is not one)
    mro, message, remote_type = world.run(0, body_script_error)
    assert RuntimeError in mro and torchwire.RemoteError in mro
    assert "script says no" in message and "worker1" in message
    assert remote_type == "torch.jit.Error"


def body_futures():
    fut = rpc.rpc_async("worker1", add, args=(1, 2))
    assert isinstance(fut, torch.futures.Future)
    chained = fut.then(lambda f: f.value() * 10)
    assert fut.wait() == 3
    assert fut.done() and fut.value() == 3
    assert chained.wait() == 30
    seen = []
    done = threading.Event()

    def cb(f):
        seen.append((f.value(), threading.current_thread().name))
        done.set()

    rpc.rpc_async("worker2", sleep_then, args=(0.05, "late")).add_done_callback(cb)
    assert done.wait(10)
    futs = [rpc.rpc_async(f"worker{1 + i % 3}", add, args=(i, i)) for i in range(30)]
    assert torch.futures.wait_all(futs) == [2 * i for i in range(30)]
    collected = torch.futures.collect_all(futs).wait()
    return seen, [f.value() for f in collected]


def test_rpc_async_future_api(world):
    seen, values = world.run(0, body_futures)
    assert seen[0][0] == "late"
    # completed by the reader thread: the callback must have been moved to the pool
    assert "reader" not in seen[0][1]
    assert values == [2 * i for i in range(30)]


def body_async_execution():
    x, y = torch.ones(2), torch.ones(2)
    return [
        rpc.rpc_sync("worker1", async_add_chained, args=("worker2", x, y, 1)),
        rpc.rpc_sync("worker1", AsyncExecutionClass.static_async_add, args=("worker2", x, y, 2)),
        rpc.rpc_sync("worker1", AsyncExecutionClass.class_async_add, args=("worker2", x, y, 3)),
        rpc.rpc_async("worker1", async_add_chained, args=("worker0", x, y, 4)).wait(),
    ]


def test_async_execution_plain_static_class(world):
    res = world.run(0, body_async_execution)
    for value, z in zip(res, (1, 2, 3, 4)):
        assert torch.equal(value, torch.full((2,), 2.0 + z))


def body_async_wrong_type():
    with pytest.raises(RuntimeError, match="must return a torch.futures.Future object"):
        rpc.rpc_sync("worker1", async_wrong_type)
    return rpc.rpc_sync("worker1", add, args=(1, 1))


def test_async_execution_must_return_future(world):
    assert world.run(0, body_async_wrong_type) == 2


# ---------------------------------------------------------------- errors

def body_remote_exception():
    try:
        rpc.rpc_sync("worker1", raise_value_error, args=("Expected error",))
    except ValueError as exc:
        first = str(exc)
    else:
        raise AssertionError("no error")
    fut = rpc.rpc_async("worker2", raise_custom)
    try:
        fut.wait()
    except torchwire.RemoteError as exc:
        second = (str(exc), exc.remote_type)
    return first, second


def test_remote_exception_type_message_worker_traceback(world):
    first, (second, remote_type) = world.run(0, body_remote_exception)
    assert "Expected error" in first
    assert "worker1" in first
    assert "Traceback" in first and "raise_value_error" in first
    assert remote_type.endswith("CustomError")
    assert "worker2" in second


def body_unpicklable_args():
    before = rpc.rpc_sync("worker1", _received_requests)
    with pytest.raises(torchwire.SerializationError):
        rpc.rpc_async("worker1", echo, args=(threading.Lock(),))
    lock = threading.Lock()
    with pytest.raises(torchwire.SerializationError, match="captured variable 'lock'"):
        rpc.rpc_sync("worker1", echo, args=(lambda: lock,))  # not even by value
    after = rpc.rpc_sync("worker1", _received_requests)
    return before, after


def _received_requests():
    from torchwire.rpc.api import _get_current_rpc_agent
    return _get_current_rpc_agent().counters.received


def test_unpicklable_arguments_fail_before_sending(world):
    before, after = world.run(0, body_unpicklable_args)
    assert after == before + 1  # only the second counting call itself arrived


def body_unpicklable_return():
    with pytest.raises(torchwire.SerializationError, match="return value"):
        rpc.rpc_sync("worker1", return_unpicklable)
    return rpc.rpc_sync("worker1", add, args=(20, 22))


def test_unpicklable_return_value_is_an_error_and_callee_keeps_serving(world):
    assert world.run(0, body_unpicklable_return) == 42


def body_bad_calls():
    errors = {}
    for key, call in {
        "unknown_name": lambda: rpc.rpc_sync("nobody", noop),
        "unknown_rank": lambda: rpc.rpc_sync(17, noop),
        "bad_to": lambda: rpc.rpc_sync(1.5, noop),
        "negative_timeout": lambda: rpc.rpc_sync("worker1", noop, timeout=-5),
        "not_callable": lambda: rpc.rpc_sync("worker1", 3),
        "bad_kwargs": lambda: rpc.rpc_sync("worker1", noop, kwargs=[1]),
    }.items():
        try:
            call()
        except Exception as exc:
            errors[key] = (type(exc).__name__, str(exc), isinstance(exc, ValueError),
                           isinstance(exc, TypeError))
    errors["still_serving"] = rpc.rpc_sync("worker1", add, args=(1, 2))
    return errors


def test_bad_destinations_and_arguments_are_clear_errors(world):
    errors = world.run(0, body_bad_calls)
    assert errors["unknown_name"][0] == "UnknownWorkerError"
    assert "nobody" in errors["unknown_name"][1]
    assert errors["unknown_name"][2]  # also a ValueError
    assert "17" in errors["unknown_rank"][1]
    assert errors["bad_to"][2]
    assert errors["negative_timeout"][2] and "timeout" in errors["negative_timeout"][1]
    assert errors["not_callable"][3]
    assert errors["bad_kwargs"][3]
    assert errors["still_serving"] == 3


def test_call_before_init_rpc_is_a_clear_error():
    # torch's phrases, which ported code and torch's own tests match on
    with pytest.raises(torchwire.RpcStateError, match="^RPC has not been initialized.*init_rpc"):
        rpc.rpc_sync("worker1", noop)
    with pytest.raises(torchwire.RpcStateError, match="^Current RPC agent is not set!"):
        rpc._get_current_rpc_agent()
    with pytest.raises(torchwire.RpcStateError, match="init_rpc"):
        rpc.get_worker_info()
    with pytest.raises(RuntimeError):  # torch code catches RuntimeError
        rpc.shutdown()


def test_call_after_shutdown_is_a_clear_error():
    def body(rank, world_size, init_method):
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        rpc.shutdown()
        try:
            rpc.rpc_sync("worker0", noop)
        except torchwire.RpcStateError as exc:
            return str(exc)
        return "no error"

    msgs = run_world(body, 2, init=False)
    assert all(m.startswith("RPC has not been initialized") and "init_rpc" in m for m in msgs), msgs


# ---------------------------------------------------------------- API surface

def test_worker_info_semantics():
    a, b = rpc.WorkerInfo("w", 1), rpc.WorkerInfo("w", 1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert rpc.WorkerInfo("a", 0) < rpc.WorkerInfo("b", 1)
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "WorkerInfo(id=1, name=w)"
    assert (a.name, a.id) == ("w", 1)


def test_public_names_are_exported_and_documented():
    for name in rpc.__all__:
        obj = getattr(rpc, name)
        if callable(obj) and not isinstance(obj, type(rpc.BackendType.TENSORPIPE)):
            assert obj.__doc__, f"torchwire.rpc.{name} has no docstring"
    for name in ("init_rpc", "shutdown", "rpc_sync", "rpc_async", "get_worker_info",
                 "WorkerInfo", "BackendType", "is_available", "TensorPipeRpcBackendOptions",
                 "functions"):
        assert name in rpc.__all__
    assert rpc.functions.async_execution.__doc__
    assert rpc.is_available() is True


def test_worker_info_validates_names_like_torch():
    with pytest.raises(RuntimeError, match="Worker name must match"):
        rpc.WorkerInfo("abc*", 0)
    with pytest.raises(RuntimeError, match="must be non-empty"):
        rpc.WorkerInfo("", 0)
    with pytest.raises(RuntimeError, match="shorter than 128"):
        rpc.WorkerInfo("a" * 500, 0)


def test_future_callback_errors_like_torch():
    fut = rpc.Future()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        fut.then(None)
    child = fut.then(lambda f, extra: None)  # wrong number of arguments
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="Got the following error when running the callback"):
        child.wait()


def body_escaped_message():
    try:
        rpc.rpc_sync("worker1", raise_value_error, args=("first line\nsecond line",))
    except ValueError as exc:
        return str(exc)


def test_remote_error_keeps_real_newlines(world):
    msg = world.run(0, body_escaped_message)
    assert "first line\nsecond line" in msg
    assert msg == msg.encode("utf-8").decode("unicode_escape")  # no escaped sequences


# ---------------------------------------------------------------- counting plain messages

_decoded: dict = {}


def _count_decodes(decoder: str) -> int:
    """From now on, count this worker's calls of ``_serialization.<decoder>`` (wrapping
    it); returns the count so far."""
    from torchwire import _serialization as ser
    if decoder not in _decoded:
        _decoded[decoder] = 0
        inner = getattr(ser, decoder)

        def counted(payload, tensors):
            _decoded[decoder] += 1
            return inner(payload, tensors)
        setattr(ser, decoder, counted)
    return _decoded[decoder]


def count_plain_replies():
    """Plain replies this worker decoded (from the first call of this on)."""
    return _count_decodes("plain_value")


def count_plain_calls():
    """Plain requests this worker decoded (from the first call of this on)."""
    return _count_decodes("plain_call_decode")
