"""Every channel passes the same transfer tests: shared memory, CMA, socket stream, lanes.

Shared memory (the default between same-host workers) moves large buffers in
memfd segments whose descriptors cross the Unix socket; CMA (cross-memory
attach) with one ``process_vm_readv``; ``_channels=["socket"]`` forces everything
through the socket; over TCP, lanes split large buffers over two connections.  The
same channels are driven between two workers (a job per test) and, at the end, through
the interface alone: two Connections on a socket pair, each built with one channel.
tests/test_shm.py, test_shm_copy_on_write.py and test_shm_malformed.py cover what is
particular to shared memory.
"""

from __future__ import annotations

import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._wire import frame as F
from torchwire._wire.buffers import pool_stats, receive_bytes
from torchwire._wire.channels import REGISTRY, cma
from torchwire._wire.channels import segments as shm

# channel -> the options that make large buffers take it (shm is the default same-host one)
CHANNELS = {"shm": {}, "cma": {"_channels": ["cma"]}, "socket": {"_channels": ["socket"]},
            "lanes": {"_transports": ["tcp"]}}


def test_the_suite_covers_every_channel():
    assert set(CHANNELS) == {cls.name for cls in REGISTRY.values()} | {"socket"}
    assert {cls.bit for cls in REGISTRY.values()} == {F.REMOTE_BIT, F.SHM_BIT, F.LANE_BIT}


def echo(x):
    return x


def held_buffers():
    """How many frames' tensors (or segment leases) this worker still keeps for its
    peers to read: what every channel lends until the peer's RELEASE."""
    agent = rpc.api._get_current_rpc_agent()
    conns = agent.links.all()
    return sum(c.channels.holding(c) for c in conns) + shm.stats()["leased"]


def out_connection_channel(to):
    """The channel large buffers take on the connection to ``to``."""
    agent = rpc.api._get_current_rpc_agent()
    conn = agent.links.connection_to(agent.get_worker_info(to).id)
    return conn.channels.send_names()[0]


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

    for res in run_world(body, 2, **CHANNELS[channel]):
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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_payload_buffer_is_not_touched_until_it_is_received():
    """A pickle larger than the reader's buffer is received into fresh memory that the
    allocation leaves untouched: ``read_faulting`` faults it in by a torch op with the
    GIL released. (``bytearray(n)`` zero-fills it holding the GIL.)"""
    before = _resident_bytes()
    view, fresh = receive_bytes(256 << 20)
    assert fresh and view.nbytes == 256 << 20 and not view.readonly
    assert _resident_bytes() - before < 64 << 20  # not faulted in
    part = view[-5:]
    del view  # a slice keeps the mapping: payload slices may outlive the view
    part[:] = b"abcde"
    assert bytes(part) == b"abcde"


@pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["unix", "tcp"])
def test_large_pickled_payloads_both_ways(transports):
    """Values pickled into the payload itself (no tensors), several MiB each way."""
    def body(rank, world_size):
        values = [list(range(400_000)), "é" * 2_000_000, {i: str(i) for i in range(90_000)}]
        return [rpc.rpc_sync(f"worker{1 - rank}", echo, args=(v,)) == v for v in values]

    opts = {"_transports": transports} if transports else {}
    assert run_world(body, 2, **opts) == [[True] * 3] * 2


@pytest.mark.parametrize("transports, expected", [(None, "unix"), (["tcp"], "tcp")])
def test_transport_choice_and_large_transfer(transports, expected):
    def body(rank, world_size):
        other = f"worker{1 - rank}"
        value = _payloads()
        got = rpc.rpc_sync(other, echo, args=(value,))
        agent = rpc.api._get_current_rpc_agent()
        conn = agent.links.connection_to(1 - rank)
        return (conn.transport, conn.channels.sends("cma"), conn.channels.sends("shm"),
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
        return ok, len(agent.links.lanes_out), agent.links.connection_to(1 - rank).transport

    for ok, lanes_open, transport in run_world(body, 2, _transports=["tcp"],
                                               _tcp_lanes=lanes):
        assert ok and transport == "tcp"
        assert (lanes_open >= 1) if lanes else (lanes_open == 0)


def lanes_opened():
    return len(rpc.api._get_current_rpc_agent().links.lanes_out)


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


# ---------------------------------------------------------------- the interface itself


class _Sink:
    def __init__(self) -> None:
        self.frames: list = []
        self.closed_with: list = []

    def on_frames(self, conn, frames, at_rest=False) -> bool:
        self.frames.extend(frames)
        return False

    def on_close(self, conn, exc) -> None:
        self.closed_with.append(exc)


def _pair(channels_a, channels_b, sink_a, sink_b):
    """Two started Connections on a Unix socket pair: ``a`` (rank 0's end, its peer
    rank 1) and ``b`` (rank 1's end)."""
    import socket

    from torchwire._wire.connection import Connection
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a = Connection(sa, 1, sink_a.on_frames, sink_a.on_close, channels=channels_a,
                   initiated=True, transport="unix")
    b = Connection(sb, 0, sink_b.on_frames, sink_b.on_close, channels=channels_b,
                   initiated=False, transport="unix")
    a.start()
    b.start()
    return a, b


def _channel_sets(channel, lane_conns):
    """The two ends' ChannelSets of a link whose large buffers take ``channel``."""
    import os

    from torchwire._wire.channels.lanes import LaneRegistry
    from torchwire._wire.channels.link import ChannelSet
    if channel == "lanes":
        registry = LaneRegistry()  # one process: both ends share it, keyed by peer rank

        def open_lane():
            a, b = _pair(ChannelSet(lanes=registry), ChannelSet(lanes=registry),
                         _Sink(), _Sink())
            lane_conns.extend([a, b])
            return a

        return ChannelSet(lanes=registry, open_lane=open_lane), ChannelSet(lanes=registry)
    if channel == "cma":  # this process reads its own memory
        return ChannelSet(cma_pid=os.getpid()), ChannelSet(cma_pid=os.getpid())
    if channel == "shm":
        return (ChannelSet(shm_send=True, shm_recv=True),
                ChannelSet(shm_send=True, shm_recv=True))
    return ChannelSet(), ChannelSet()


def _raw(buf) -> bytes:
    return bytes(buf) if isinstance(buf, bytearray) else buf.numpy().tobytes()


def _one_frame_through(channel):
    """A link built with only ``channel`` carries a frame of a small and two large
    buffers; then the sender holds nothing lent, and GOODBYEs close both ends in order."""
    from _cluster import wait_until
    sender, receiver, lane_conns = _Sink(), _Sink(), []
    a, b = _pair(*_channel_sets(channel, lane_conns), sender, receiver)
    big = 9 << 20 if channel == "lanes" else 1 << 20  # from the channel's min_size
    torch.manual_seed(0)
    tensors = [torch.arange(10, dtype=torch.int16), torch.randn(big // 4),
               torch.randint(0, 255, (big + 3,), dtype=torch.uint8)]
    a.send_frame(F.K_REQUEST, 0, 7, b"payload", tensors)
    assert wait_until(lambda: receiver.frames, 10)
    (kind, _flags, rid, payload, got), = receiver.frames
    same = [_raw(g) == t.view(torch.uint8).numpy().tobytes() for g, t in zip(got, tensors)]
    receiver.frames.clear()
    del got  # (shm: the mapping dies, its RELEASE goes back)
    released = wait_until(lambda: a.channels.holding(a) == 0, 10)
    a.send_goodbye()
    b.send_goodbye()
    assert wait_until(lambda: a.goodbye_received and b.goodbye_received, 10)
    a.close()
    b.close()
    assert wait_until(lambda: sender.closed_with and receiver.closed_with, 10)
    for c in lane_conns:
        c.close()
    return ((kind, rid, bytes(payload)), same, a.channels.send_names()[0], released,
            sender.closed_with + receiver.closed_with)


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_every_channel_carries_a_frame_between_two_connections(channel):
    if channel == "cma" and not cma.available():
        pytest.skip("process_vm_readv is not available on this platform")
    if channel == "shm" and not shm.available():
        pytest.skip("memfd and descriptor passing are not available on this platform")

    def body(rank, world_size, init_method):  # in a child: it maps segments, starts threads
        return _one_frame_through(channel)

    frame, same, used, released, closed = run_world(body, 1, init=False)[0]
    assert frame == (F.K_REQUEST, 7, b"payload")
    assert same == [True, True, True]
    assert used == channel
    assert released, "the sender still holds what it lent"
    assert closed == [None, None]  # GOODBYE both ways: closed in order
