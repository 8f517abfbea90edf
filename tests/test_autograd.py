"""Distributed autograd: contexts, send/recv recording, the distributed backward pass.

Gradients are checked against the same computation run in one process.
"""

from __future__ import annotations

import logging
import marshal
import threading
import time
import traceback

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


def _messages():
    """(backward messages sent, replies sent): not calls_sent, which also counts the
    release a worker forwards when the previous context ends, at any time."""
    return dist_autograd._debug_info()["num_backward_messages_sent"], \
        rpc.stats()["replies_sent"]


def body_cycle_messages(n):
    """A cycle A -> B -> A, backward n times: what each pass sends, per worker, and how
    many of each worker's incoming backward messages it served without unpickling."""
    a = torch.rand(4, requires_grad=True)
    w = torch.rand(4, requires_grad=True)
    sent, served = [], []
    for _ in range(n):
        with dist_autograd.context() as cid:
            z = rpc.rpc_sync("worker1", call_back, args=("worker0", a * 2, w))
            loss = (z * z).sum()
            plain_before = _plain_served()
            before = _messages(), rpc.rpc_sync("worker1", _messages)
            dist_autograd.backward(cid, [loss])
            after = _messages(), rpc.rpc_sync("worker1", _messages)
            plain_after = _plain_served()
            got = dist_autograd.get_gradients(cid)
        # the probes: one reply from B
        sent.append(((after[0][0] - before[0][0], after[0][1] - before[0][1]),
                     (after[1][0] - before[1][0], after[1][1] - before[1][1] - 1)))
        served.append((plain_after[0] - plain_before[0], plain_after[1] - plain_before[1]))
        y = a.detach() * 2
        expect = (torch.sin(y) * w.detach() * y) * 2 * y
        torch.testing.assert_close(got[w], expect * torch.sin(y))
    return sent, served


def test_a_pass_sends_one_message_per_hop_and_no_replies(world):
    # The pass crosses A -> B -> A -> B -> A (z's, mul's result's, y's and x's, w's
    # gradients).  Each hop is one one-way message; B's reports to A ride on its
    # gradients, and A's own part ends here: no reply, no separate report.  (Waiting
    # for replies would add four, written as the chain unwinds.)  Each of those
    # messages is plain: marshalled ints and raw tensor buffers, no pickle.
    sent, served = world.run(0, body_cycle_messages, 3)
    assert sent == [((2, 0), (2, 0))] * 3, sent
    assert served == [(2, 2)] * 3, served


def count_plain_backward_messages():
    """From now on, count the plain gradients and report messages this worker serves
    (wrapping their handlers); returns the count so far."""
    from torchwire import _serialization as ser
    from torchwire._autograd.kinds import AutogradKind
    if not hasattr(count_plain_backward_messages, "n"):
        count_plain_backward_messages.n = 0
        for kind in (AutogradKind.GRADS, AutogradKind.REPORT):
            inner = ser.hooks.plain_handler(kind)

            def counted(src, payload, tensors, _inner=inner):
                count_plain_backward_messages.n += 1
                return _inner(src, payload, tensors)
            ser.hooks.register_plain(kind, handler=counted)
    return count_plain_backward_messages.n


def _plain_served():
    return count_plain_backward_messages(), rpc.rpc_sync("worker1",
                                                         count_plain_backward_messages)


def body_context_reply_plain():
    """Tensors that require grad go plain both ways (request and reply), through
    recv nodes."""
    from test_rpc import count_plain_calls, count_plain_replies
    a = torch.rand(3, requires_grad=True)
    b = torch.rand(3, requires_grad=True)
    with dist_autograd.context() as cid:
        before = count_plain_replies(), rpc.rpc_sync("worker1", count_plain_calls)
        z = rpc.rpc_sync("worker1", mul, args=(a, b))
        after = count_plain_replies(), rpc.rpc_sync("worker1", count_plain_calls)
        # (less the probe among the calls; its int reply is pickled)
        plain = after[0] - before[0], after[1] - before[1] - 1
        assert z.requires_grad and z.grad_fn is not None
        dist_autograd.backward(cid, [(z * z).sum()])
        grads = dist_autograd.get_gradients(cid)
    torch.testing.assert_close(grads[a], 2 * (a * b).detach() * b.detach())
    torch.testing.assert_close(grads[b], 2 * (a * b).detach() * a.detach())
    return plain


def test_tensors_that_require_grad_travel_plain_both_ways(world):
    assert world.run(0, body_context_reply_plain) == (1, 1)


def sparse_rows(w, idx):
    return torch.nn.functional.embedding(idx, w, sparse=True).sum(0)


def body_sparse_hop():
    """worker1's part sends worker0 a sparse gradient (for ``w``): that message is
    pickled; the dense one to worker1 is plain.  Gradients as in one process."""
    w = torch.randn(10, 3, requires_grad=True)
    idx = torch.tensor([1, 2, 2, 7])
    scale = torch.tensor([1.0, -2.0, 3.0])
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", sparse_rows, args=(w, idx))
        before = _plain_served()
        dist_autograd.backward(cid, [(out * scale).sum()])
        after = _plain_served()
        got = dist_autograd.get_gradients(cid)[w]
    local = w.detach().clone().requires_grad_(True)
    (sparse_rows(local, idx) * scale).sum().backward()
    assert got.is_sparse
    torch.testing.assert_close(got.to_dense(), local.grad.to_dense())
    return after[0] - before[0], after[1] - before[1]


def test_a_sparse_gradient_is_pickled_and_arrives_sparse(world):
    assert world.run(0, body_sparse_hop) == (0, 1)


class _Captured(logging.Handler):
    records: list = []

    def emit(self, record):
        _Captured.records.append(record.getMessage() + "\n" + (
            "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else ""))


def capture_torchwire_log(on: bool):
    logger = logging.getLogger("torchwire")
    for h in [h for h in logger.handlers if isinstance(h, _Captured)]:
        logger.removeHandler(h)
    out, _Captured.records = _Captured.records, []
    if on:
        logger.addHandler(_Captured())
    return out


def captured_count() -> int:
    return len(_Captured.records)


def body_malformed_plain_messages():
    """Broken internal messages to worker1 are logged there, and it keeps serving.
    (Their order there is not fixed: a slow log write can hand the reading to another
    thread, and the rest run on the pool.)"""
    from torchwire._autograd.kinds import AutogradKind
    agent = rpc.api._get_current_rpc_agent()
    rpc.rpc_sync("worker1", capture_torchwire_log, args=(True,))
    try:
        agent.notify_plain(1, bytes([250]))  # a kind nobody registered
        agent.notify_plain(1, bytes([AutogradKind.GRADS]) + b"\x00not marshal")
        # a shape that does not fit its buffer
        agent.notify_plain(1, bytes([AutogradKind.GRADS]) + marshal.dumps(
            (1, (0, 1), 1, [(5, 0, (100,))], None)), [torch.zeros(3)])
        agent.notify_plain(1, bytes([AutogradKind.RELEASE]) + marshal.dumps("no id"))
        assert rpc.rpc_sync("worker1", add, args=(torch.ones(2), torch.ones(2))).tolist() \
            == [2.0, 2.0]
        deadline = time.monotonic() + 10
        while rpc.rpc_sync("worker1", captured_count) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        logged = rpc.rpc_sync("worker1", capture_torchwire_log, args=(False,))
    failed = [m for m in logged if "internal message from worker0 failed" in m]
    assert len(failed) == 4, logged
    for why in ("unknown internal message kind 250", "malformed plain message",
                "malformed tensor in an internal message", "malformed context release"):
        assert sum(why in m for m in failed) == 1, (why, failed)


def test_malformed_internal_messages_are_logged_and_the_worker_keeps_serving(world):
    world.run(0, body_malformed_plain_messages)


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


# ---------------------------------------------------------------- release, concurrency

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
