"""A message over its receiver's ``max_message_size``, from a legitimate peer."""

from __future__ import annotations

import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import after_gate, open_gate, options, run_world

pytestmark = pytest.mark.timeout(90)

_SMALL_LIMIT = 1 << 20


def _echo(x):
    return x


def _make(n):
    return torch.ones(n, dtype=torch.uint8)


def _attempt(call):
    """(error type, message, seconds) of ``call()``, or ("ok", value, seconds)."""
    t0 = time.monotonic()
    try:
        return "ok", call(), time.monotonic() - t0
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0


@pytest.mark.parametrize("link", [{}, {"_transports": ["tcp"]}], ids=["default", "tcp"])
def test_a_message_over_the_receivers_limit_fails_that_call_and_nothing_else(link):
    """worker0 accepts at most 1 MiB, worker1 up to 64 MiB (each publishes its limit):
    worker1's requests to worker0, and worker1's reply to a call of worker0's, are over
    worker0's limit.  The sender refuses them, so the link is never dropped."""
    size = 4 << 20

    def body(rank, world_size, init_method):
        limit = _SMALL_LIMIT if rank == 0 else 64 << 20
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20,
                                                 max_message_size=limit, **link))
        peer = f"worker{1 - rank}"
        inflight = rpc.rpc_async(peer, after_gate, args=("oversize-in-flight", rank))
        if rank == 1:
            big = torch.ones(size, dtype=torch.uint8)
            sent = _attempt(lambda: rpc.rpc_sync(peer, _echo, args=(big,)))
            payload = _attempt(lambda: rpc.rpc_sync(peer, _echo, args=(b"x" * size,)))
        else:  # the reply is over our limit, not the request
            sent = _attempt(lambda: rpc.rpc_sync(peer, _make, args=(size,)))
            payload = None
        after = rpc.rpc_sync(peer, _echo, args=(torch.full((3,), float(rank)),)).tolist()
        assert not inflight.done()  # it was in flight through all of the above
        rpc.rpc_sync(peer, open_gate, args=("oversize-in-flight",))
        kept = inflight.wait()  # the link was never dropped: its other calls go on
        stats = rpc.api._get_current_rpc_agent().stats()
        rpc.shutdown()
        return sent, payload, after, kept, stats

    (reply, _, after0, kept0, _), (request, payload, after1, kept1, _) = run_world(
        body, 2, init=False, timeout=80)
    for what, (name, msg, seconds) in (("a reply", reply), ("a request", request),
                                       ("a request", payload)):
        assert name == "SerializationError", (name, msg)
        assert f"{what} of" in msg and f"max_message_size {_SMALL_LIMIT}" in msg, msg
        assert "worker0" in msg, msg
        assert seconds < 5  # refused at once: not a timeout, not a hang
    assert (after0, after1) == ([0.0] * 3, [1.0] * 3)
    assert (kept0, kept1) == (0, 1)
