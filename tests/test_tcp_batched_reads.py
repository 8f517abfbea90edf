"""Long reads over TCP wake once per ``RCVLOWAT`` bytes (``reader._read_batched``).

The kernel wakes a ``recv`` waiting under ``SO_RCVLOWAT`` only when that many bytes
are queued, however many it has copied already, so a read that asks for the whole
rest of a buffer can wait for bytes that never come.  These tests drive the real
function over real loopback sockets with senders that stop short of the mark, then
run whole calls over TCP.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
import types

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._wire import reader

pytestmark = pytest.mark.timeout(120)

L = reader.RCVLOWAT


def _pair(rcvbuf: int | None = 8 << 20):
    """A connected TCP pair on loopback; ``rcvbuf``: the receiver's buffer size (None:
    the kernel's, as a new connection has it)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    if rcvbuf is not None:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return a, b


def _conn():
    return types.SimpleNamespace(peer_rank=1, progress_in=0)


def _read_all(sock, n: int, conn, out: dict) -> None:
    """What ``read_exact_into`` does: the batched part, then the rest as usual."""
    dst = bytearray(n)
    view = memoryview(dst)
    try:
        off = reader._read_batched(sock, view, 0, conn)
        out["batched_to"] = off
        out["lowat_after"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        while off < n:
            got = sock.recv_into(view[off:])
            if not got:
                raise EOFError("closed")
            off += got
        out["data"] = bytes(dst)
    except BaseException as exc:  # reported to the test's thread
        out["error"] = exc


def _run_reader(sock, n, conn):
    out: dict = {}
    t = threading.Thread(target=_read_all, args=(sock, n, conn, out), daemon=True)
    t.start()
    return t, out


def _payload(n: int) -> bytes:
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy())


def _queued(sock) -> int:
    """Bytes the kernel holds unread on ``sock`` (``SIOCINQ``)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def _wait_until(cond, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


class _Staged:
    """A connection stand-in whose first read's progress sends the next stage of the
    buffer before the reader's next ``recv``: that ``recv`` then starts with part of a
    mark queued (``progress_in`` is counted after each one)."""

    def __init__(self, sender, receiver, stage: bytes) -> None:
        self.peer_rank = 1
        self._count = 0
        self._sender, self._receiver, self._stage = sender, receiver, stage

    @property
    def progress_in(self) -> int:
        return self._count

    @progress_in.setter
    def progress_in(self, value: int) -> None:
        if self._count == 0:
            self._sender.sendall(self._stage)
            _wait_until(lambda: _queued(self._receiver) >= len(self._stage),
                        "the stage did not arrive")
        self._count = value


def test_a_read_that_starts_with_part_of_a_mark_queued_does_not_wait_for_more():
    """4 marks: 2.5 arrive first and are read; then 0.6 is queued before the next
    ``recv``, and the last 0.9 comes once that was copied.  A ``recv`` that asked for
    the whole rest would copy the 0.6 and wait for a full mark more, of which only 0.9
    comes: it never returns.  (The first version did; this test hung on it.)"""
    n = 4 * L
    cut1, cut2 = 5 * L // 2, 5 * L // 2 + 3 * L // 5
    a, b = _pair()
    data = _payload(n)
    a.sendall(data[:cut1])
    _wait_until(lambda: _queued(b) >= cut1, "the first part did not arrive")
    conn = _Staged(a, b, data[cut1:cut2])
    t, out = _run_reader(b, n, conn)
    try:
        _wait_until(lambda: conn.progress_in and _queued(b) == 0,
                    "the reader did not take the second part")
        a.sendall(data[cut2:])
        t.join(20)
        assert not t.is_alive(), "the reader waits for bytes the sender will not send"
        assert "error" not in out, out.get("error")
        assert out["data"] == data
        assert out["lowat_after"] == 1  # the mark is put back
    finally:
        a.close()  # (ends a hung reader too)
        b.close()
        t.join(10)


def test_a_buffer_sent_at_once_arrives_whole_and_in_few_wakeups():
    n = 64 << 20
    a, b = _pair()
    conn = _conn()
    data = _payload(n)
    t, out = _run_reader(b, n, conn)
    try:
        a.sendall(data)
        t.join(60)
        assert not t.is_alive()
        assert "error" not in out, out.get("error")
        assert out["data"] == data
        # each recv returned at least a mark's worth (the unbatched loop returns per
        # segment, 64 KiB on loopback at most)
        assert conn.progress_in <= n // L
    finally:
        a.close()
        b.close()


def test_a_new_connection_with_a_small_buffer_reads_as_before():
    """Setting the mark on a connection whose receive buffer is still small would
    clamp its window to the mark: such a read is not batched."""
    a, b = _pair(rcvbuf=None)
    conn = _conn()
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < 4 * L
    n = 4 * L
    t, out = _run_reader(b, n, conn)
    try:
        data = _payload(n)
        a.sendall(data)
        t.join(30)
        assert not t.is_alive()
        assert out["batched_to"] == 0 and out["lowat_after"] == 1
        assert out["data"] == data
    finally:
        a.close()
        b.close()


def test_a_peer_that_closes_mid_buffer_ends_the_read_at_once():
    n = 16 * L
    a, b = _pair()
    conn = _conn()
    t, out = _run_reader(b, n, conn)
    try:
        a.sendall(_payload(3 * L + 7))
        a.close()
        t.join(30)
        assert not t.is_alive(), "the reader hung on a closed connection"
        assert isinstance(out.get("error"), EOFError), out
        assert "rank 1" in str(out["error"])
    finally:
        b.close()


def _times_two(t):
    return t * 2


def test_fresh_tensors_round_trip_over_tcp_across_the_batching_sizes():
    """Whole calls over TCP (``_transports=["tcp"]``): computed replies of sizes
    around where reads are batched and where a buffer is split over a lane, each
    sent several times (the first transfers grow the connection's buffers)."""
    sizes = [(4 << 20) - 4, 4 << 20, (8 << 20) + 4, 40 << 20]

    def body(rank, world_size):
        if rank == 0:
            for n in sizes:
                for i in range(3):
                    t = torch.arange(n // 4, dtype=torch.float32) + i
                    y = rpc.rpc_sync("worker1", _times_two, args=(t,))
                    assert torch.equal(y, t * 2), (n, i)
        return rank

    assert run_world(body, 2, timeout=100, rpc_timeout=60,
                     _transports=["tcp"]) == [0, 1]
