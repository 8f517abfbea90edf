"""The frame codec under serialization: the wire format of ``torchwire/_wire/frame.py``
(header layout, limits, protocol errors) and a ``Connection`` reader fed raw bytes
over a socketpair (frames with their tensors, CMA releases written without blocking,
peers that break the protocol, more buffers than its read buffer holds)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

import torchwire
from torchwire._serialization import dumps, loads, tensor_nbytes
from torchwire._wire import frame as F
from torchwire._wire.channels.link import ChannelSet
from torchwire._wire.connection import Connection


@pytest.fixture(scope="module", autouse=True)
def _world_before_local_work(world):
    """Start the shared job before this module runs torch ops in the pytest process:
    a child forked after the parent used torch's intra-op thread pool hangs on its
    first parallel op."""


# ------------------------------------------------------------------ frame codec


@pytest.mark.parametrize("kind", list(F.Kind))
@pytest.mark.parametrize("lens", [[], [0], [1, 2, 3], [2 ** 39, 7]])
def test_header_round_trip(kind, lens):
    rid = 2 ** 64 - 3
    data = F.encode_header(int(kind), F.F_ERROR, rid, 12345, lens)
    assert len(data) == F.HEADER_SIZE + 8 * len(lens)
    assert F.decode_header(data) == (int(kind), F.F_ERROR, rid, 12345, len(lens))
    assert F.decode_buffer_lens(data[F.HEADER_SIZE:], len(lens), 12345) == lens


def test_header_layout_is_little_endian_and_fixed():
    data = F.encode_header(F.K_REQUEST, 0, 0x0102030405060708, 0x11, [0x22])
    assert F.HEADER_SIZE == 32
    assert data[:4] == b"TW\x07\x03"  # magic, version 7, kind REQUEST
    assert struct.unpack_from("<I", data, 4)[0] == 0  # flags
    assert struct.unpack_from("<Q", data, 8)[0] == 0x0102030405060708
    assert struct.unpack_from("<Q", data, 16)[0] == 0x11  # payload length
    assert struct.unpack_from("<I", data, 24)[0] == 1  # number of buffers
    assert struct.unpack_from("<Q", data, 32)[0] == 0x22  # first buffer length
    assert [int(k) for k in F.Kind] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [int(op) for op in F.ControlOp] == [1, 2]
    assert (F.F_ERROR, F.F_CMA, F.F_SHM, F.F_RETIRE, F.F_PLAIN) == (1, 2, 4, 8, 16)


def test_wrong_magic_is_protocol_error():
    data = b"XY" + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[2:]
    with pytest.raises(torchwire.ProtocolError, match="magic"):
        F.decode_header(data)
    with pytest.raises(torchwire.ProtocolError):
        F.decode_header(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 8, 255])
def test_wrong_version_is_protocol_error(version):
    data = bytearray(F.encode_header(F.K_REQUEST, 0, 1, 0, []))
    data[2] = version
    with pytest.raises(torchwire.ProtocolError, match="version"):
        F.decode_header(bytes(data))


@pytest.mark.parametrize("kind", [0, 10, 200, 255])
def test_unknown_kind_is_protocol_error(kind):
    data = F.encode_header(kind, 0, 1, 0, [])
    with pytest.raises(torchwire.ProtocolError, match="kind"):
        F.decode_header(data)


def test_payload_over_max_message_size_is_protocol_error():
    assert F.decode_header(F.encode_header(F.K_REQUEST, 0, 1, 1000, []), 1000)[3] == 1000
    with pytest.raises(torchwire.ProtocolError, match="max message size"):
        F.decode_header(F.encode_header(F.K_REQUEST, 0, 1, 1001, []), 1000)
    with pytest.raises(torchwire.ProtocolError):
        F.decode_header(F.encode_header(F.K_RESPONSE, 0, 1, 2 ** 64 - 1, []))


def test_buffers_over_max_message_size_is_protocol_error():
    lens = [300, 200]
    data = F.encode_header(F.K_REQUEST, 0, 1, 500, lens)
    table = data[F.HEADER_SIZE:]
    assert F.decode_buffer_lens(table, 2, 500, max_message_size=1000) == lens
    with pytest.raises(torchwire.ProtocolError, match="max message size"):
        F.decode_buffer_lens(table, 2, 501, max_message_size=1000)


def test_too_many_buffers_is_protocol_error():
    data = F.pack_header(F.K_REQUEST, 0, 1, 0, F.MAX_BUFFERS + 1)
    with pytest.raises(torchwire.ProtocolError, match="buffers"):
        F.decode_header(data)
    ok = F.pack_header(F.K_REQUEST, 0, 1, 0, F.MAX_BUFFERS)
    assert F.decode_header(ok)[4] == F.MAX_BUFFERS


# ------------------------------------------------------------------ Connection reader


class _Sink:
    """on_frames / on_close callbacks that record what a reader delivers."""

    def __init__(self) -> None:
        self.frames: list = []
        self.arrived = threading.Condition()
        self.closed = threading.Event()
        self.close_exc = None

    def on_frames(self, conn, frames, at_rest=False) -> bool:
        with self.arrived:
            self.frames.extend(frames)
            self.arrived.notify_all()
        return False

    def wait_frames(self, n: int, timeout: float = 10) -> bool:
        """Until ``n`` frames have been delivered (False: not within ``timeout``)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.frames) >= n, timeout)

    def on_close(self, conn, exc) -> None:
        self.close_exc = exc
        self.closed.set()


def _reader(max_message_size=F.DEFAULT_MAX_MESSAGE_SIZE):
    a, b = socket.socketpair()
    sink = _Sink()
    conn = Connection(a, 1, sink.on_frames, sink.on_close, max_message_size=max_message_size,
                      initiated=False, transport="unix")
    conn.start()
    return conn, b, sink


def test_connection_delivers_frames_with_their_tensors():
    conn, peer_sock, sink = _reader()
    sender_sink = _Sink()
    sender = Connection(peer_sock, 0, sender_sink.on_frames, sender_sink.on_close,
                        initiated=True, transport="unix")
    sender.start()
    try:
        # "y" is larger than the reader's 256 KiB buffer: received straight into storage
        value = {"x": torch.arange(10, dtype=torch.int16), "y": torch.randn(300_000)}
        payload, table = dumps(value)
        sender.send_frame(F.K_REQUEST, 0, 42, payload, table)
        sender.send_frame(F.K_GOODBYE, 0, 0, b"")
        sender.close()  # both frames are in the kernel: send_frame flushed them
        assert sink.closed.wait(10)
        assert sink.close_exc is None  # clean EOF after a GOODBYE
        assert [f[:3] for f in sink.frames] == [(F.K_REQUEST, 0, 42), (F.K_GOODBYE, 0, 0)]
        kind, flags, rid, got_payload, tensors = sink.frames[0]
        assert bytes(got_payload) == payload
        # "x" came whole with the frame's first read: handed on as a bytearray (typed
        # by the unpickler, no torch call in the reader); "y" as a uint8 tensor
        assert type(tensors[0]) is bytearray and len(tensors[0]) == 20
        assert tensors[1].dtype == torch.uint8 and tensors[1].numel() == 1_200_000
        got = loads(got_payload, tensors)
        assert torch.equal(got["x"], value["x"])
        # compared with numpy: torch.equal on 300k elements would start torch's thread pool
        assert got["y"].shape == value["y"].shape
        assert got["y"].numpy().tobytes() == value["y"].numpy().tobytes()
    finally:
        sender.close()
        conn.close()


def _cma_frame(rid: int, t: torch.Tensor, token: int) -> bytes:
    """A request whose one buffer stays in this process's memory (CMA)."""
    n = tensor_nbytes(t)
    return (F.encode_header(F.K_REQUEST, F.F_CMA, rid, 3, [n | F.REMOTE_BIT]) + b"abc"
            + F.REMOTE_REF.pack(t.data_ptr(), token))


def test_a_reader_sends_cma_releases_itself_and_never_blocks_on_a_full_socket():
    import os
    a, b = socket.socketpair()
    sink = _Sink()
    deferred: list = []
    ran = threading.Event()

    def defer(fn, *args):  # the pool: record, run on another thread
        deferred.append(fn)
        threading.Thread(target=lambda: (fn(*args), ran.set()), daemon=True).start()

    # This process plays the peer: the reader reads the buffers from our own memory.
    conn = Connection(a, 1, sink.on_frames, sink.on_close, initiated=False, transport="unix",
                      channels=ChannelSet(cma_pid=os.getpid()), defer=defer)
    conn.start()
    src = torch.arange(100_000, dtype=torch.int32)
    try:
        # 1. An idle socket: the reader writes the RELEASE itself, no other thread.
        b.sendall(_cma_frame(11, src, token=7))
        got = b.recv(F.HEADER_SIZE)
        assert F.HEADER.unpack(got)[2:5] == (F.K_RELEASE, 0, 7)
        assert deferred == []
        # the RELEASE may leave before the frame is handed on
        assert sink.wait_frames(1)
        assert sink.frames[0][4][0].view(torch.int32).equal(src)
        # 2. The socket towards the peer is full: the reader must not block on it.
        a.setblocking(False)
        filled = 0
        try:
            while True:
                filled += a.send(b"\0" * 65536)
        except BlockingIOError:
            pass
        a.setblocking(True)
        b.sendall(_cma_frame(12, src, token=8))
        assert sink.wait_frames(2), "the reader blocked on its full socket"
        assert len(deferred) == 1  # the pool writes the RELEASE once there is room
        assert not ran.is_set()
        drained = bytearray()
        b.settimeout(10)
        while len(drained) < filled + F.HEADER_SIZE:
            drained += b.recv(1 << 20)
        assert ran.wait(10)
        assert F.HEADER.unpack(bytes(drained[filled:]))[2:5] == (F.K_RELEASE, 0, 8)
        assert conn.frames_out == 2 and not conn.closed
    finally:
        conn.close()
        b.close()


@pytest.mark.parametrize("raw,match", [
    (b"XY" + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[2:], "magic"),
    (F.encode_header(F.K_REQUEST, 0, 1, 0, [])[:2] + b"\x09"
     + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[3:], "version"),
    (F.encode_header(10, 0, 1, 0, []), "kind"),
    (F.encode_header(F.K_REQUEST, 0, 1, 5000, []), "max message size"),
    (F.encode_header(F.K_REQUEST, 0, 1, 10, [5000]), "max message size"),
], ids=["magic", "version", "kind", "payload_too_big", "buffers_too_big"])
def test_connection_drops_a_peer_that_breaks_the_protocol(raw, match):
    conn, peer_sock, sink = _reader(max_message_size=4096)
    try:
        peer_sock.sendall(raw)
        assert sink.closed.wait(10)
        assert isinstance(sink.close_exc, torchwire.ProtocolError)
        assert match in str(sink.close_exc)
        assert sink.frames == []
        assert conn.closed
    finally:
        conn.close()
        peer_sock.close()


def test_connection_reads_a_frame_with_more_buffers_than_its_read_buffer_holds():
    # 40,000 one-byte buffers: an 8-byte length each is 320,000 bytes of length table,
    # more than the reader's 256 KiB buffer, yet well under frame.MAX_BUFFERS.
    n = 40_000
    conn, peer_sock, sink = _reader()
    try:
        lens = [1] * n
        body = b"payload" + bytes(i % 256 for i in range(n))
        def send():
            try:
                peer_sock.sendall(F.encode_header(F.K_CONTROL, 0, 5, 7, lens) + body)
                peer_sock.shutdown(socket.SHUT_WR)
            except OSError:  # the reader dropped the connection: reported below
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        assert sink.closed.wait(10)
        assert sink.close_exc is None or not isinstance(sink.close_exc, torchwire.ProtocolError), (
            f"frame with {n} buffers refused: {sink.close_exc}")
        assert len(sink.frames) == 1
        kind, _, rid, payload, tensors = sink.frames[0]
        assert (kind, rid, bytes(payload)) == (F.K_CONTROL, 5, b"payload")
        assert len(tensors) == n
        assert [int(t[0]) for t in tensors[:300]] == [i % 256 for i in range(300)]
    finally:
        sender.join(10)
        conn.close()
        peer_sock.close()
