"""Distributed autograd: contexts, send/recv recording, the distributed backward pass.

Gradients are checked against the same computation run in one process: simple graphs,
chains and cycles, fan-out, async_execution, retained graphs, remote() with proxies
and RRef.backward, model-parallel stages, and a remote backward error.  The remote
functions and modules here are shared with the test_autograd_*.py files and
test_optim.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from torchwire.rpc import RRef


# ---------------------------------------------------------------- remote functions

def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def ret_requires_grad():
    return _SHARED


_SHARED = torch.ones(3, 3, requires_grad=True)


def nested_mul(to, a, b):
    """Runs on one worker, multiplies on the next (A -> B -> C)."""
    return rpc.rpc_sync(to, mul, args=(a * 2, b))


def call_back(to, x, w):
    """A -> B -> A: B computes, then asks the caller for more."""
    y = torch.sin(x) * w
    return rpc.rpc_sync(to, mul, args=(y, x))


@rpc.functions.async_execution
def async_chain(to, x, y):
    return rpc.rpc_async(to, torch.mul, args=(x, y)).then(lambda f: f.wait() + x)


class SimulateBackwardError(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        raise ValueError("Simulate error on backward pass")


def failing_udf(x):
    return SimulateBackwardError.apply(x * 3)


# ---------------------------------------------------------------- modules on workers

class Stage(nn.Module):
    def __init__(self, d_in, d_out, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(d_out, d_in, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(d_out, generator=g) * 0.1)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def module_grads(rref, ctx):
    grads = dist_autograd.get_gradients(ctx)
    return [grads[p] for p in rref.local_value().parameters()]


def module_params(rref):
    return [p.detach().clone() for p in rref.local_value().parameters()]


def stage_forward(rref, x):
    return rref.local_value()(x)


def nested_forward(rrefs, x):
    y = rrefs[0].local_value()(x)
    if len(rrefs) > 1:
        y = rpc.rpc_sync(rrefs[1].owner(), nested_forward, args=(rrefs[1:], y))
    return y


def local_copy(rref, d_in, d_out):
    m = Stage(d_in, d_out, 0)
    with torch.no_grad():
        for p, v in zip(m.parameters(), rpc.rpc_sync(rref.owner(), module_params, (rref,))):
            p.copy_(v)
    return m


# ---------------------------------------------------------------- contexts

def body_context_ids():
    ids = []
    for _ in range(50):
        with dist_autograd.context() as cid:
            assert dist_autograd._retrieve_context(cid)._context_id() == cid
            assert cid >> 48 == 1
            ids.append(cid)
    assert len(set(ids)) == 50
    assert dist_autograd._get_max_id() == (1 << 48) - 1 + (1 << 48)
    for cid in ids:
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
            dist_autograd._retrieve_context(cid)
    with dist_autograd.context():
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this"):
            with dist_autograd.context():
                pass
    with pytest.raises(RuntimeError, match="doesn't have a valid autograd context"):
        dist_autograd._current_context()


def test_context_ids_unique_and_scoped(world):
    world.run(1, body_context_ids)


def body_invalid_args():
    with dist_autograd.context() as cid:
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(cid, None)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(None, None)
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(cid, [torch.rand(3, 3)])
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(cid, [torch.rand(3, 3, requires_grad=True)])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(cid, [torch.rand(1, requires_grad=True)])
    t1 = torch.rand(3, 3, requires_grad=True)
    res = rpc.rpc_sync("worker1", torch.add, args=(t1, t1))
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        dist_autograd.backward(100, [res.sum()])  # outside any context
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd.backward(cid, [res.sum()])  # a finished one
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
        dist_autograd.get_gradients(cid)


def test_invalid_arguments_and_unknown_contexts(world):
    world.run(0, body_invalid_args)


# ---------------------------------------------------------------- simple graphs

def body_docs_example(dst):
    """torch's docs example: rpc_sync(torch.add) then get_gradients."""
    with dist_autograd.context() as context_id:
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        loss = rpc.rpc_sync(dst, torch.add, args=(t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        assert len(grads) == 2 and t1 in grads and t2 in grads
        assert torch.equal(grads[t1], torch.ones(3, 3))
        assert torch.equal(grads[t2], torch.ones(3, 3))
        assert t1.grad is None and t2.grad is None  # never in .grad


@pytest.mark.parametrize("dst", ["worker1", "worker0"])
def test_torch_docs_example(world, dst):
    world.run(0, body_docs_example, dst)


def body_without_rpc():
    with dist_autograd.context() as cid:
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        dist_autograd.backward(cid, [torch.add(t1, t2).sum()])
        grads = dist_autograd.get_gradients(cid)
        assert len(grads) == 2 and torch.equal(grads[t1], torch.ones(3, 3))


def test_backward_without_rpc(world):
    world.run(2, body_without_rpc)


def body_grad_on_return_value():
    """Only the reply requires grad: the request carried the context anyway."""
    with dist_autograd.context() as cid:
        ret = rpc.rpc_sync("worker1", ret_requires_grad)
        dist_autograd.backward(cid, [(ret * 3).sum()])
        return rpc.rpc_sync("worker1", shared_grad, args=(cid,))


def shared_grad(cid):
    return dist_autograd.get_gradients(cid)[_SHARED]


def test_grad_only_on_return_value(world):
    assert torch.equal(world.run(0, body_grad_on_return_value), torch.full((3, 3), 3.0))


def _jagged(requires_grad=True):
    return torch.nested.nested_tensor([torch.arange(6.0).view(2, 3), torch.ones(5, 3)],
                                      layout=torch.jagged, requires_grad=requires_grad)


def jagged_times_three(nt):
    return nt * 3


def jagged_total(nt):
    return (nt.values() * 5).sum()


def body_jagged_through_autograd():
    """A jagged nested tensor each way: its gradient arrives with offsets of its own,
    which autograd took for another ragged size ("Mismatch in shape")."""
    out = {}
    with dist_autograd.context() as cid:
        nt = _jagged()
        r = rpc.rpc_sync("worker1", jagged_times_three, args=(nt,))
        dist_autograd.backward(cid, [r.values().sum()])
        out["reply"] = dist_autograd.get_gradients(cid)[nt].values().unique().tolist()
    with dist_autograd.context() as cid:
        nt = _jagged()
        dist_autograd.backward(cid, [rpc.rpc_sync("worker1", jagged_total, args=(nt,))])
        out["argument"] = dist_autograd.get_gradients(cid)[nt].values().unique().tolist()
    with dist_autograd.context():
        strided = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                             requires_grad=True)
        try:
            rpc.rpc_sync("worker1", jagged_times_three, args=(strided,))
            out["strided"] = "sent"
        except Exception as exc:
            out["strided"] = f"{type(exc).__name__}: {exc}"
    return out


def test_jagged_nested_tensors_through_distributed_autograd(world):
    out = world.run(0, body_jagged_through_autograd)
    assert out["reply"] == [3.0] and out["argument"] == [5.0]
    assert out["strided"].startswith("SerializationError") and "jagged" in out["strided"]


def body_chain_nested():
    """A -> B -> C nested, and a cycle A -> B -> A."""
    a = torch.rand(4, requires_grad=True)
    b = torch.rand(4, requires_grad=True)
    w = torch.rand(4, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", nested_mul, args=("worker2", a, b))
        z = rpc.rpc_sync("worker2", call_back, args=("worker0", y, w))
        loss = (z * z).sum()
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)
        assert set(got) == {a, b, w}
    y = a * 2 * b
    z = (torch.sin(y) * w) * y
    (z * z).sum().backward()
    for t in (a, b, w):
        torch.testing.assert_close(got[t], t.grad)


def test_chain_and_cycle(world):
    world.run(0, body_chain_nested)


def body_fan_out():
    x = torch.rand(5, requires_grad=True)
    with dist_autograd.context() as cid:
        futs = [rpc.rpc_async(f"worker{r}", mul, args=(x, float(r))) for r in (1, 2, 3)]
        loss = sum((f.wait() ** 2).sum() for f in futs)
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)[x]
    torch.testing.assert_close(got, 2 * x.detach() * (1 + 4 + 9))


def test_fan_out(world):
    world.run(0, body_fan_out)


def body_async_execution():
    x = torch.rand(3, requires_grad=True)
    y = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", async_chain, args=("worker2", x, y))
        dist_autograd.backward(cid, [(out * out).sum()])
        got = dist_autograd.get_gradients(cid)
    ref = x * y + x
    (ref * ref).sum().backward()
    torch.testing.assert_close(got[x], x.grad)
    torch.testing.assert_close(got[y], y.grad)


def test_async_execution_function(world):
    world.run(0, body_async_execution)


def body_retain_graph():
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    with dist_autograd.context() as cid:
        t3 = rpc.rpc_sync("worker1", torch.matmul, args=(t1, t2))
        loss = (t3 * t3).sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss], retain_graph=True)
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)
    ref = torch.matmul(t1, t2)
    (ref * ref).sum().backward()
    torch.testing.assert_close(got[t1], 3 * t1.grad)
    torch.testing.assert_close(got[t2], 3 * t2.grad)


def test_retain_graph_repeated_backward(world):
    world.run(0, body_retain_graph)


def body_unused_send():
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    with dist_autograd.context() as cid:
        rpc.rpc_sync("worker1", torch.add, args=(t1, t2))  # its result is never used
        dist_autograd.backward(cid, [torch.mul(t1, t2).sum()])
        grads = dist_autograd.get_gradients(cid)
        return grads[t1], grads[t2], t1, t2


def test_backward_finishes_when_a_sent_tensor_gets_no_gradient(world):
    # docs/compat.md, deliberate differences: torch's FAST mode waits forever here
    g1, g2, t1, t2 = world.run(0, body_unused_send, timeout=30)
    torch.testing.assert_close(g1, t2)
    torch.testing.assert_close(g2, t1)


# ---------------------------------------------------------------- remote(), proxies, RRef.backward

def make_stage(d_in, d_out, seed):
    return Stage(d_in, d_out, seed)


def body_remote_and_proxies():
    s1 = rpc.remote("worker1", make_stage, args=(4, 6, 1))
    s2 = rpc.remote("worker2", make_stage, args=(6, 3, 2))
    x = torch.randn(2, 4, requires_grad=True)
    with dist_autograd.context() as cid:
        h_rref = rpc.remote("worker1", stage_forward, args=(s1, x))   # remote() ...
        h = h_rref.to_here()                                            # ... + to_here()
        out = s2.rpc_sync().forward(h)                                  # proxy
        out2 = s2.rpc_async().forward(h).wait()
        loss = (out * out2).sum()
        dist_autograd.backward(cid, [loss])
        g1 = rpc.rpc_sync("worker1", module_grads, args=(s1, cid))
        g2 = rpc.rpc_sync("worker2", module_grads, args=(s2, cid))
        gx = dist_autograd.get_gradients(cid)[x]
    m1, m2 = local_copy(s1, 4, 6), local_copy(s2, 6, 3)
    hl = m1(x)
    (m2(hl) * m2(hl)).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    for got, p in zip(g1 + g2, list(m1.parameters()) + list(m2.parameters())):
        torch.testing.assert_close(got, p.grad)


def test_remote_to_here_and_proxies(world):
    world.run(0, body_remote_and_proxies)


def scalar_loss(stage, x):
    return (stage.local_value()(x) ** 2).sum()


def body_rref_backward():
    s1 = rpc.remote("worker1", make_stage, args=(4, 2, 3))
    x = torch.randn(3, 4, requires_grad=True)
    with dist_autograd.context() as cid:
        loss_rref = rpc.remote("worker1", scalar_loss, args=(s1, x))
        loss_rref.backward(cid)
        gx = dist_autograd.get_gradients(cid)[x]
        g1 = rpc.rpc_sync("worker1", module_grads, args=(s1, cid))
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to"):
            loss_rref.backward()
        not_tensor = rpc.remote("worker1", add, args=(1, 2))
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for .backward\(\)"):
            not_tensor.backward(cid)
    m1 = local_copy(s1, 4, 2)
    (m1(x) ** 2).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    for got, p in zip(g1, m1.parameters()):
        torch.testing.assert_close(got, p.grad)
    # local backward on an owner RRef
    w = torch.ones(2, requires_grad=True)
    RRef((w * 3).sum()).backward()
    assert torch.equal(w.grad, torch.full((2,), 3.0))


def test_rref_backward(world):
    world.run(0, body_rref_backward)


# ---------------------------------------------------------------- errors

def body_remote_error():
    t = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(t, 2))
        y = rpc.rpc_sync("worker2", failing_udf, args=(y,))
        y = rpc.rpc_sync("worker3", torch.add, args=(y, 1))
        with pytest.raises(RuntimeError, match="Error on Node 2: Simulate error on backward") \
                as info:
            dist_autograd.backward(cid, [y.sum()])
        assert "worker2" in str(info.value)
        assert isinstance(info.value, rpc.RemoteError)
        assert info.value.worker_name == "worker2"
    # the workers are usable afterwards
    body_docs_example("worker2")


def test_remote_backward_error_names_the_worker(world):
    world.run(0, body_remote_error)


# ---------------------------------------------------------------- correctness: model parallel

@pytest.mark.parametrize("n", [2, 3, 4])
def test_linear_chain_matches_local(world, n):
    world.run(0, body_linear_chain, n)


def body_linear_chain(n):
    dims = [5, 7, 6, 4, 3][:n + 1]
    stages = [rpc.remote(f"worker{r}", make_stage, args=(dims[r], dims[r + 1], 10 + r))
              for r in range(n)]
    x = torch.randn(4, dims[0])
    for nested in (False, True):
        with dist_autograd.context() as cid:
            if nested:
                out = rpc.rpc_sync(stages[0].owner(), nested_forward, args=(stages, x))
            else:
                out = x
                for s in stages:
                    out = rpc.rpc_sync(s.owner(), stage_forward, args=(s, out))
            loss = (out ** 2).mean()
            dist_autograd.backward(cid, [loss])
            grads = [rpc.rpc_sync(s.owner(), module_grads, args=(s, cid)) for s in stages]
        local = [local_copy(s, dims[i], dims[i + 1]) for i, s in enumerate(stages)]
        out = x
        for m in local:
            out = m(out)
        (out ** 2).mean().backward()
        for got, m in zip(grads, local):
            for g, p in zip(got, m.parameters()):
                torch.testing.assert_close(g, p.grad)


def merge(a, b, w):
    return torch.cat([a * w, b], dim=1)


def body_branch_merge():
    s1 = rpc.remote("worker1", make_stage, args=(4, 3, 21))
    s2 = rpc.remote("worker2", make_stage, args=(4, 5, 22))
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    with dist_autograd.context() as cid:
        fa = rpc.rpc_async("worker1", stage_forward, args=(s1, x))
        fb = rpc.rpc_async("worker2", stage_forward, args=(s2, x))
        m = rpc.rpc_sync("worker3", merge, args=(fa.wait(), fb.wait(), w))
        loss = (m.sum(dim=1) ** 2).sum() + (x * x).sum()
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)
        g1 = rpc.rpc_sync("worker1", module_grads, args=(s1, cid))
        g2 = rpc.rpc_sync("worker2", module_grads, args=(s2, cid))
    m1, m2 = local_copy(s1, 4, 3), local_copy(s2, 4, 5)
    ref = merge(m1(x), m2(x), w)
    ((ref.sum(dim=1) ** 2).sum() + (x * x).sum()).backward()
    torch.testing.assert_close(got[x], x.grad)
    torch.testing.assert_close(got[w], w.grad)
    for g, p in zip(g1 + g2, list(m1.parameters()) + list(m2.parameters())):
        torch.testing.assert_close(g, p.grad)


def test_branch_and_merge_matches_local(world):
    world.run(0, body_branch_merge)


def test_public_names_are_exported_and_documented():
    import torchwire.optim as optim
    for module, names in ((dist_autograd, {"context", "backward", "get_gradients",
                                           "is_available"}),
                          (optim, {"DistributedOptimizer"})):
        assert set(module.__all__) == names
        for name in names:
            obj = getattr(module, name)
            assert obj.__doc__, f"{module.__name__}.{name} has no docstring"
            assert obj.__module__ == module.__name__
    assert dist_autograd.is_available() is True
