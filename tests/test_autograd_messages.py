"""What a distributed backward pass sends: one one-way message per hop and no replies,
tensors that require grad travelling plain (unpickled) both ways, a sparse gradient
pickled and arriving sparse, and malformed internal messages logged on the worker
that keeps serving."""

from __future__ import annotations

import logging
import marshal
import time
import traceback

import torch

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from test_autograd import add, call_back, mul


# ---------------------------------------------------------------- messages of a pass

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
