"""Distributed backward passes on torch's engine: leaf and AccumulateGrad hooks, when a
gradient is kept without a copy, sparse gradients over a retained graph, a
tensor-subclass root, a pass inside an RPC, concurrent contexts and their release on
every worker, and the intra-op threads a pass runs with."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from test_autograd import add, mul, nested_mul


# ---------------------------------------------------------------- hooks and copies (torch's engine)

def body_hooks():
    w = torch.ones(3, requires_grad=True)
    w.register_hook(lambda g: g * 2)  # a tensor hook: the context gets the doubled gradient
    u = torch.ones(3, requires_grad=True)
    x = torch.tensor([1.0, 2.0, 3.0])
    calls = []
    with dist_autograd.context() as cid:
        # w travels as is (its send entry is the leaf itself); u goes through a local op
        y = rpc.rpc_sync("worker1", mul, args=(w, x))
        z = rpc.rpc_sync("worker2", mul, args=(u * 3, x))
        loss = (y + z).sum()
        acc_u = (u * 1).grad_fn.next_functions[0][0]  # u's AccumulateGrad (kept alive by z)
        acc_u.register_hook(lambda grads_in, grads_out: calls.append("post"))
        acc_u.register_prehook(lambda grads_out: calls.append("pre") or None)
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        return grads[w], grads[u], calls, w.grad, u.grad


def test_leaf_hooks_and_accumulate_node_hooks_run_and_grad_stays_untouched(world):
    gw, gu, calls, w_grad, u_grad = world.run(0, body_hooks)
    torch.testing.assert_close(gw, torch.tensor([2.0, 4.0, 6.0]))  # the hook doubled it
    torch.testing.assert_close(gu, torch.tensor([3.0, 6.0, 9.0]))
    assert calls == ["pre", "post"]
    assert w_grad is None and u_grad is None


class _Twice(torch.autograd.Function):
    """Hands the same gradient tensor to both inputs."""
    seen = None

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        _Twice.seen = g.data_ptr()
        return g, g


class _Once(torch.autograd.Function):
    seen = None

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        _Once.seen = g.data_ptr()
        return g


class _Expanded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.shape = a.shape
        return a.sum()

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape)  # stride 0: not laid out as the leaf


def body_copies():
    a = torch.randn(4, 5, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)
    out = {}
    with dist_autograd.context() as cid:  # a local graph: the gradient is the engine's own
        dist_autograd.backward(cid, [_Once.apply(a)[1, 2]])
        out["alone"] = dist_autograd.get_gradients(cid)[a].data_ptr() == _Once.seen
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", add, args=(_Twice.apply(a, b), torch.zeros(4, 5)))
        dist_autograd.backward(cid, [y.sum()])
        grads = dist_autograd.get_gradients(cid)
        ptrs = {grads[a].data_ptr(), grads[b].data_ptr(), _Twice.seen}
        out["shared"] = len(ptrs) == 3
        out["values"] = bool(torch.equal(grads[a], torch.ones(4, 5)) and
                             torch.equal(grads[b], torch.ones(4, 5)))
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", add, args=(_Expanded.apply(a), torch.zeros(())))
        dist_autograd.backward(cid, [y])
        g = dist_autograd.get_gradients(cid)[a]
        out["expanded"] = (g.stride() == a.stride(), bool(torch.equal(g, torch.ones(4, 5))))
    return out


def test_a_gradient_is_kept_as_is_only_when_nothing_else_reaches_it(world):
    # torch's AccumulateGrad rules: a gradient no one else holds is kept without a copy;
    # one handed to two leaves, or not laid out as its leaf, is copied
    out = world.run(0, body_copies)
    assert out["alone"] is True
    assert out["shared"] is True and out["values"] is True
    assert out["expanded"] == (True, True)


# ---------------------------------------------------------------- sparse gradients

class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.bag = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
        with torch.no_grad():
            self.bag.weight.copy_(torch.randn(10, 3, generator=g))

    def forward(self, idx, offsets):
        return self.bag(idx, offsets)


def bag_grad(rref, cid):
    return dist_autograd.get_gradients(cid)[rref.local_value().bag.weight]


def body_sparse():
    bag = rpc.remote("worker1", Bag)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4])
    w = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as cid:
        emb = bag.rpc_sync().forward(idx, offsets)
        loss = (emb * w).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss])
        got = rpc.rpc_sync("worker1", bag_grad, args=(bag, cid))
    local = Bag()
    ((local(idx, offsets) * w).sum() * 2).backward()
    assert got.is_sparse
    torch.testing.assert_close(got.to_dense(), local.bag.weight.grad.to_dense())


def test_sparse_gradients_embedding_bag(world):
    world.run(0, body_sparse)


# ---------------------------------------------------------------- subclass roots, nested passes

class Traced(torch.Tensor):
    """A tensor subclass that records the torch functions called on it."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def body_subclass_root():
    """A root that overrides torch functions still gets torch's public backward (its
    override sees it); plain tensors go straight to the engine."""
    x = torch.rand(3, requires_grad=True)
    Traced.calls = []
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", mul, args=(x, 2.0))
        loss = (y.as_subclass(Traced) * 3).sum()
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)[x]
    return got, "backward" in Traced.calls


def test_a_tensor_subclass_root_takes_torchs_backward(world):
    got, overridden = world.run(0, body_subclass_root)
    assert torch.equal(got, torch.full((3,), 6.0))
    assert overridden


def backward_inside(to):
    """On the callee, possibly in place on its reader: a distributed backward whose
    gradients come back on the connection this request came in on."""
    w = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync(to, torch.mul, args=(w, 2.0))
        dist_autograd.backward(cid, [y.sum()])
        return dist_autograd.get_gradients(cid)[w]


def body_backward_inside_rpc(n):
    return [rpc.rpc_sync("worker1", backward_inside, args=("worker0",)) for _ in range(n)]


def test_backward_inside_an_rpc_whose_gradients_come_back_on_the_callers_connection(world):
    # worker1's pass waits for worker0's part, whose gradients (and report) come back
    # on the connection worker1 read the request from: its reader hands the reading off
    # before waiting, as it does for a nested rpc_sync.
    got = world.run(0, body_backward_inside_rpc, 20)
    assert [g.tolist() for g in got] == [[2.0] * 3] * 20


# ---------------------------------------------------------------- release, concurrency

def context_debug():
    import gc
    gc.collect()
    return dist_autograd._debug_info()


def wait_contexts_released(ranks=(0, 1, 2, 3), timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        infos = [rpc.rpc_sync(f"worker{r}", context_debug) for r in ranks]
        if all(i["num_autograd_contexts"] == 0 and i["num_current_backward_passes"] == 0
               for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"autograd contexts were not released: {infos}")
        time.sleep(0.01)


def body_many_contexts(n, threads=4):
    """``n`` contexts from 4 threads; every 50th runs a nested call and a backward."""
    t1 = torch.rand(2, requires_grad=True)
    t2 = torch.rand(2)
    errors = []

    def loop(k):
        try:
            for i in range(k, n, threads):
                with dist_autograd.context() as cid:
                    y = rpc.rpc_sync(f"worker{1 + i % 3}", torch.mul, args=(t1, t2))
                    if i % 50 == 0:
                        y = rpc.rpc_sync("worker1", nested_mul, args=("worker2", y, t2))
                        dist_autograd.backward(cid, [y.sum()])
        except BaseException as exc:  # reported below
            errors.append(exc)
    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(100)
    assert not errors, errors
    return wait_contexts_released()


@pytest.mark.slow
def test_contexts_released_everywhere_no_growth(world):
    infos = world.run(0, body_many_contexts, 10_000, timeout=110)
    assert all(i["num_send_entries"] == 0 and i["num_recv_functions"] == 0 for i in infos)
    assert infos[1]["num_tombstones"] > 0


def shared_param_times(x):
    return _PARAM * x


_PARAM = torch.ones(4, requires_grad=True)


def param_grad(cid):
    return dist_autograd.get_gradients(cid)[_PARAM]


def body_concurrent(base):
    errors = []

    def trainer(k):
        try:
            for _ in range(20):
                x = torch.full((4,), float(base + k))
                with dist_autograd.context() as cid:
                    y = rpc.rpc_sync("worker3", shared_param_times, args=(x,))
                    dist_autograd.backward(cid, [y.sum()])
                    g = rpc.rpc_sync("worker3", param_grad, args=(cid,))
                    assert torch.equal(g, x), (g, x)
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_concurrent_contexts_never_mix(world):
    world.run_all(body_concurrent, 10)
    world.run(0, wait_contexts_released)


# ---------------------------------------------------------------- intra-op threads of small passes

_PROBED: list = []


def _mkl_threads():
    """MKL's own thread count for the calling thread (it keeps one beside OpenMP's and
    torch's), or None without MKL."""
    import ctypes
    import os
    if not torch.backends.mkl.is_available():
        return None
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    return lib.MKL_Get_Max_Threads()


class ThreadProbe(torch.autograd.Function):
    """Identity; its backward notes the intra-op threads its thread may use (torch's
    count, MKL's)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        _PROBED.append((torch.get_num_threads(), _mkl_threads()))
        return g


def square(x):
    return x ** 2


def probed_threads():
    out = list(_PROBED)
    _PROBED.clear()
    return out


def body_thread_probe(numel):
    from torchwire._base import intraop as _intraop
    prev = torch.get_num_threads()
    torch.set_num_threads(2)  # this thread's setting (the suite runs with 1)
    try:
        threads_before = (torch.get_num_threads(), _mkl_threads())
        x = torch.rand(64, requires_grad=True)
        w = torch.rand(numel, requires_grad=True)  # a leaf of the root pass: its size
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", square, args=(x,))
            loss = ThreadProbe.apply(y).sum() + w.sum()
            dist_autograd.backward(cid, [loss])  # the root pass runs on this thread
            grads = dist_autograd.get_gradients(cid)
        threads_after = (torch.get_num_threads(), _mkl_threads())
    finally:
        torch.set_num_threads(prev)
    import os
    return (grads[x], x, grads[w], probed_threads(), threads_before, threads_after,
            _intraop._omp is not None, _intraop._pass_threads, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("small", [True, False])
def test_small_passes_run_single_threaded_and_restore_the_setting(world, small):
    from torchwire._base.intraop import SERIAL_MAX_ELEMENTS
    numel = 64 if small else SERIAL_MAX_ELEMENTS
    gx, x, gw, probed, before, after, omp, share, cpus = world.run(0, body_thread_probe,
                                                                   numel)
    assert share == max(1, cpus // 4)  # this worker's share: the world's 4 run on this host
    torch.testing.assert_close(gx, 2 * x)  # d(x^2)/dx: the pass went through worker1
    torch.testing.assert_close(gw, torch.ones(numel))
    if not omp:
        pytest.skip("torch's intra-op threads are not OpenMP threads here")
    mkl = torch.backends.mkl.is_available()
    # the calling thread's settings are back after its pass (MKL's too: a small mm with a
    # long inner dimension splits over MKL's threads even with OpenMP's count at 1)
    assert before == after == (2, 2 if mkl else None)
    # the root pass ran on the calling thread: alone when small; else with its 2 threads,
    # or its share of the host's CPUs if that is less (1 on a machine of fewer than 8)
    n = 1 if small else min(2, share)
    assert probed == [(n, n if mkl else None)]
