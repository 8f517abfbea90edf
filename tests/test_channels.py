"""Every channel passes the same transfer tests: shared memory, CMA, socket stream.

Shared memory (the default between same-host workers) moves large buffers in
memfd segments whose descriptors cross the Unix socket; CMA (cross-memory
attach) with one ``process_vm_readv``; ``_channels=["socket"]`` forces everything
through the socket.  tests/test_shm.py covers what is particular to shared memory.
"""

from __future__ import annotations

import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._wire import cma, shm
from torchwire._wire.buffers import pool_stats

CHANNELS = {"shm": None, "cma": ["cma"], "socket": ["socket"]}


def echo(x):
    return x


def held_buffers():
    """How many frames' tensors this worker still keeps for peers to read."""
    agent = rpc.api._get_current_rpc_agent()
    conns = list(agent._incoming) + [p.out for p in agent._peers.values() if p.out is not None]
    return (sum(len(getattr(c, "_cma_hold", {})) for c in conns)
            + shm.stats()["leased"])


def out_connection_channel(to):
    agent = rpc.api._get_current_rpc_agent()
    conn = agent._peers[agent.get_worker_info(to).id].out
    return "shm" if conn.shm_send else "cma" if conn.cma_pid is not None else "socket"


def _payloads():
    torch.manual_seed(0)  # called twice: once to send, once to compare
    big = torch.arange(3 << 20, dtype=torch.float32).view(-1, 1024)
    return {
        "1MiB": torch.randn(1 << 18),
        "8MiB float64": torch.randn(1 << 20, dtype=torch.float64),
        "strided view": big[::2, 3:900],
        "mixed": [torch.ones(3), torch.randn(300_000), {"k": torch.arange(70_000)}, 7],
        "bool big": torch.rand(600_000) > 0.5,
        "bf16 big": torch.randn(400_000).to(torch.bfloat16),
    }


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_large_transfers_both_directions(channel):
    if channel == "cma" and not cma.available():
        pytest.skip("process_vm_readv is not available on this platform")
    if channel == "shm" and not shm.available():
        pytest.skip("memfd and descriptor passing are not available on this platform")

    def body(rank, world_size):
        other = f"worker{1 - rank}"
        results = {}
        # both workers send to each other at the same time
        futs = {name: rpc.rpc_async(other, echo, args=(value,))
                for name, value in _payloads().items()}
        for name, fut in futs.items():
            results[name] = _equal(_payloads()[name], fut.wait())
        used = out_connection_channel(other)
        # the peer releases what it read; wait (bounded) until nothing is held
        deadline = time.monotonic() + 10
        while held_buffers() and time.monotonic() < deadline:
            rpc.rpc_sync(other, held_buffers)
        results["held_after"] = held_buffers()
        results["channel"] = used
        return results

    for res in run_world(body, 2, _channels=CHANNELS[channel]):
        assert res.pop("channel") == channel
        assert res.pop("held_after") == 0
        assert all(res.values()), res


@pytest.mark.parametrize("numel, opts", [
    (1 << 20, {"_channels": ["cma"]}),
    # 32 MiB over TCP: split across the connection and a lane, whose reader fills
    # its half of the pooled buffer
    (8 << 20, {"_transports": ["tcp"], "_tcp_lanes": True}),
], ids=["cma", "tcp-lanes"])
def test_receive_buffers_are_recycled(numel, opts):
    def body(rank, world_size):
        if rank == 0:
            # Counted from here: a forked worker inherits the test process's counters.
            before = pool_stats(), rpc.rpc_sync("worker1", pool_stats)
            x = torch.randn(numel)
            for _ in range(6):
                y = rpc.rpc_sync("worker1", echo, args=(x,))
                assert torch.equal(x, y)
                del y
            # The reader may still be returning from completing the last call (its
            # locals hold the value for a moment); once it has completed one more
            # call, it certainly has.
            theirs = rpc.rpc_sync("worker1", pool_stats)  # first: see above
            after = pool_stats(), theirs
            return [dict(a, hits=a["hits"] - b["hits"], misses=a["misses"] - b["misses"])
                    for a, b in zip(after, before)]
        return None

    # The pool serves the CMA and socket channels (shared memory maps the sender's pages).
    mine, theirs = run_world(body, 2, **opts)[0]
    # After warm-up every large receive buffer comes from the pool, not fresh memory:
    # at most two misses per side (one buffer in use while the next arrives).  A
    # reader that kept the last buffer it filled until the next frame came made
    # every receive miss (a fresh, zero-filled gigabyte per call at 1 GiB).
    assert mine["misses"] <= 2 and theirs["misses"] <= 2, (mine, theirs)
    assert mine["hits"] >= 4 and theirs["hits"] >= 4, (mine, theirs)
    assert mine["lent"] == 0  # nothing kept alive once the tensors are gone


@pytest.mark.parametrize("transports, expected", [(None, "unix"), (["tcp"], "tcp")])
def test_transport_choice_and_large_transfer(transports, expected):
    def body(rank, world_size):
        other = f"worker{1 - rank}"
        value = _payloads()
        got = rpc.rpc_sync(other, echo, args=(value,))
        agent = rpc.api._get_current_rpc_agent()
        conn = agent._peers[1 - rank].out
        return (conn.transport, conn.cma_pid is not None, conn.shm_send,
                _equal(value, got))

    for transport, uses_cma, uses_shm, equal in run_world(body, 2, _transports=transports):
        assert transport == expected
        # shared memory and CMA only on a Unix socket to a same-host peer
        assert uses_cma is (expected == "unix" and cma.available())
        assert uses_shm is (expected == "unix" and shm.available())
        assert equal


@pytest.mark.parametrize("lanes", [True, False])
def test_tcp_lanes_split_large_buffers(lanes):
    """Over TCP, buffers of 8 MiB or more travel half on the connection and half on a
    lane (a second connection to the same peer); both workers send at once."""
    def body(rank, world_size):
        other = f"worker{1 - rank}"
        torch.manual_seed(rank)
        value = [torch.randn(5 << 20), torch.arange(3 << 20, dtype=torch.int64)[1::3],
                 torch.ones(7), torch.randn(9 << 20, dtype=torch.float64)]
        futs = [rpc.rpc_async(other, echo, args=(value,)) for _ in range(3)]
        ok = all(_equal(value, f.wait()) for f in futs)
        agent = rpc.api._get_current_rpc_agent()
        return ok, len(agent._lanes_out), agent._peers[1 - rank].out.transport

    for ok, lanes_open, transport in run_world(body, 2, _transports=["tcp"],
                                               _tcp_lanes=lanes):
        assert ok and transport == "tcp"
        assert (lanes_open >= 1) if lanes else (lanes_open == 0)


def lanes_opened():
    return len(rpc.api._get_current_rpc_agent()._lanes_out)


def agent_state():
    return rpc.api._get_current_rpc_agent().state.value


def test_a_draining_worker_replies_over_a_lane():
    """A worker inside shutdown() still serves, and its large replies still split."""
    def body(rank, world_size):
        if rank == 1:
            return None  # run_world's shutdown: worker1 drains while worker0 calls it
        from _cluster import wait_until
        big = torch.randn(6 << 20)
        assert wait_until(lambda: rpc.rpc_sync("worker1", agent_state) == "draining")
        back = rpc.rpc_sync("worker1", echo, args=(big,))
        return torch.equal(back, big), rpc.rpc_sync("worker1", lanes_opened)

    equal, theirs = run_world(body, 2, _transports=["tcp"])[0]
    assert equal
    assert theirs == 1  # worker1 opened a lane for its reply
