"""Lambdas, closures, local functions and classes, and an interactive ``__main__``'s, as
RPC targets and arguments (pickled by value), end to end."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import new_init_method


def apply(fn, *args):
    return fn(*args)


def make_scaler(k):
    return lambda x: x * k


def count_pickled_calls():
    from torchwire.rpc.api import _get_current_rpc_agent
    return _get_current_rpc_agent().counters.received


def body_closures():
    out = {}
    weights = torch.arange(4.0)
    offset = 10

    def affine(x):  # a closure over a tensor and an int
        return weights * x + offset

    out["lambda"] = rpc.rpc_sync("worker1", lambda a, b: a * b, args=(6, 7))
    out["closure_tensor"] = rpc.rpc_sync("worker1", affine, args=(2,)).tolist()
    out["async_closure"] = rpc.rpc_async("worker2", _async_closure(weights)).wait().tolist()
    out["partial"] = rpc.rpc_sync("worker1", functools.partial(lambda a, b, c: a + b - c, 1, 2),
                                  kwargs={"c": 3})
    out["argument"] = rpc.rpc_sync("worker2", apply, args=(lambda s: s.upper(), "abc"))
    out["returned"] = rpc.rpc_sync("worker1", make_scaler, args=(3,))(5)

    class Accumulator:  # a class defined in a function
        def __init__(self, start):
            self.total = start

        def add(self, x):
            self.total = self.total + x
            return self.total

    acc = rpc.remote("worker3", Accumulator, args=(torch.zeros(2),))
    acc.rpc_sync().add(torch.ones(2))
    out["local_class"] = acc.rpc_sync().add(torch.ones(2)).tolist()
    out["instance_back"] = type(rpc.rpc_sync("worker1", lambda a: a,
                                             args=(Accumulator(1),))) is Accumulator
    return out


def _async_closure(t):
    async def run():
        await asyncio.sleep(0)
        return t + 1
    return run


def test_lambdas_closures_partials_and_local_classes_work_as_targets_and_arguments(world):
    out = world.run(0, body_closures)
    assert out["lambda"] == 42
    assert out["closure_tensor"] == [10.0, 12.0, 14.0, 16.0]
    assert out["async_closure"] == [1.0, 2.0, 3.0, 4.0]
    assert out["partial"] == 0
    assert out["argument"] == "ABC"
    assert out["returned"] == 15
    assert out["local_class"] == [2.0, 2.0]
    assert out["instance_back"]  # the same class comes back to where it was defined


def body_unpicklable_capture():
    lock = threading.Lock()
    before = rpc.rpc_sync("worker1", count_pickled_calls)
    try:
        rpc.rpc_async("worker1", lambda: lock.locked())
        error = None
    except torchwire.SerializationError as exc:
        error = str(exc)
    after = rpc.rpc_sync("worker1", count_pickled_calls)
    return error, after - before


def test_what_cannot_be_pickled_even_by_value_fails_on_the_caller_naming_it(world):
    error, arrived = world.run(0, body_unpicklable_capture)
    assert error is not None and "captured variable 'lock'" in error and "_thread.lock" in error
    assert arrived == 1  # only the second probe: nothing of the failed call was sent


_DRIVER = textwrap.dedent("""
    import sys
    import torch
    import torchwire.rpc as rpc

    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def norm2(self):
            return self.x ** 2 + self.y ** 2

    def double(p):
        return Point(p.x * 2, p.y * 2)

    rpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=
                 rpc.TensorPipeRpcBackendOptions(init_method=sys.argv[1], rpc_timeout=30))
    norm = rpc.remote("worker", Point, args=(3, 4)).rpc_sync().norm2()
    p = rpc.rpc_sync("worker", double, args=(Point(1, 2),))
    t = rpc.rpc_sync("worker", lambda t: t * 2, args=(torch.ones(2),))
    print("RESULT", norm, p.x, p.y, isinstance(p, Point), t.tolist())
    rpc.shutdown()
""")

_WORKER = textwrap.dedent("""
    import sys
    import torchwire.rpc as rpc
    rpc.init_rpc("worker", rank=1, world_size=2, rpc_backend_options=
                 rpc.TensorPipeRpcBackendOptions(init_method=sys.argv[1], rpc_timeout=30))
    import __main__
    assert not hasattr(__main__, "Point")
    rpc.shutdown()
    print("WORKER OK")
""")


def _run_processes(argvs, cwd) -> list[str]:
    """Run ``python <argv>`` for each of ``argvs`` at once; their outputs, once all
    ended with status 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
             for argv in argvs]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.timeout(90)
def test_a_class_and_function_of_an_interactive_main_travel_by_value(tmp_path):
    # `python -c`, as a notebook or REPL: nothing of its __main__ can be imported elsewhere
    init = new_init_method()
    outs = _run_processes([["-c", code, init] for code in (_DRIVER, _WORKER)], tmp_path)
    assert "RESULT 25 2 4 True [2.0, 2.0]" in outs[0], outs
    assert "WORKER OK" in outs[1], outs


_FILE_MAIN = textwrap.dedent("""
    import sys
    import torchwire.rpc as rpc

    STORE = {}

    class Point:
        def __init__(self, x):
            self.x = x

    def put(key, value):
        STORE[key] = value
        return len(STORE)

    def stored():
        return dict(STORE)

    def same_class(p):
        return type(p) is Point

    rank, init = int(sys.argv[1]), sys.argv[2]
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=
                 rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=30))
    if rank == 0:
        # a lambda sends the message by value; what it uses of this file does not go
        # with it: the callee runs its own put() on its own STORE, and its own Point
        rpc.rpc_sync("worker1", put, args=("a", 1))
        rpc.rpc_sync("worker1", lambda: put("b", 2))
        print("STORE", sorted(rpc.rpc_sync("worker1", stored).items()))
        print("SAME", rpc.rpc_sync("worker1", lambda p: same_class(p), args=(Point(1),)))
    rpc.shutdown()
""")


@pytest.mark.timeout(90)
def test_a_lambda_beside_a_file_run_mains_functions_and_classes_leaves_them_by_reference(
        tmp_path):
    # as under torchrun: every worker runs the same file, its __main__
    script = tmp_path / "job.py"
    script.write_text(_FILE_MAIN)
    init = new_init_method()
    outs = _run_processes([[str(script), str(rank), init] for rank in (0, 1)], tmp_path)
    assert "STORE [('a', 1), ('b', 2)]" in outs[0], outs
    assert "SAME True" in outs[0], outs
