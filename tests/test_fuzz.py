"""Property-based fuzzing of the frame decoder and the unpickling boundary (hypothesis).

A short budget runs in ``./run test`` (100 examples per property);
``TORCHWIRE_FUZZ_EXAMPLES`` sets another: ``./run reliability --soak`` runs these
properties with 100 000 (``TORCHWIRE_FUZZ_EXAMPLES=20000 ./run test tests/test_fuzz.py``
for a long run by hand).  The properties: whatever bytes
arrive, the reader either delivers well-formed frames or drops the connection
with a ``ProtocolError`` / ``LinkError`` (never another exception, never a hang,
never an allocation beyond ``max_message_size``); whatever payload arrives, the
decoder raises ``SerializationError`` (never another exception), and the plain
(not pickled) messages' decoders ``ProtocolError`` or ``SerializationError``.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import pickle
import resource
import socket
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchwire
from torchwire import _serialization as ser
from torchwire._wire import frame as F
from torchwire._wire.connection import Connection

EXAMPLES = int(os.environ.get("TORCHWIRE_FUZZ_EXAMPLES", "100"))
MAX = 1 << 16  # the readers' max_message_size: nothing larger may be allocated

fuzz = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# A frame with each header field either valid or garbage: reaches past the first check.
headers = st.builds(
    lambda magic, version, kind, flags, rid, plen, nbufs, res: struct.pack(
        "<2sBBIQQII", magic, version, kind, flags, rid, plen, nbufs, res),
    st.sampled_from([F.MAGIC, b"XY", b"\x00\x00"]),
    st.sampled_from([F.VERSION, 0, 255]),
    st.integers(0, 255),
    st.integers(0, 2 ** 32 - 1),
    st.integers(0, 2 ** 64 - 1),
    st.one_of(st.integers(0, 64), st.integers(0, 2 ** 64 - 1)),
    st.one_of(st.integers(0, 4), st.integers(0, 2 ** 32 - 1)),
    st.integers(0, 2 ** 32 - 1),
)
streams = st.lists(st.one_of(headers, st.binary(max_size=64),
                             st.lists(st.integers(0, 2 ** 64 - 1), max_size=4).map(
                                 lambda xs: struct.pack(f"<{len(xs)}Q", *xs))),
                   max_size=6).map(b"".join)


class _Sink:
    def __init__(self) -> None:
        self.frames: list = []
        self.exc = None
        self.closed = threading.Event()

    def on_frames(self, conn, frames, at_rest=False):
        self.frames.extend(frames)
        return False

    def on_close(self, conn, exc):
        self.exc = exc
        self.closed.set()


def _reader():
    """A Connection reading one end of a socket pair; returns it, the other end, its sink."""
    a, b = socket.socketpair()
    sink = _Sink()
    conn = Connection(a, 1, sink.on_frames, sink.on_close, max_message_size=MAX,
                      initiated=False, transport="unix")
    conn.start()
    return conn, b, sink


@fuzz
@given(data=streams)
def test_frame_decoder_accepts_or_rejects_cleanly(data):
    kinds = {int(k) for k in F.Kind}
    try:
        kind, flags, rid, plen, nbufs = F.decode_header(data.ljust(F.HEADER_SIZE, b"\0"), MAX)
    except torchwire.ProtocolError:
        return
    assert kind in kinds and plen <= MAX and nbufs <= F.MAX_BUFFERS
    table = data[F.HEADER_SIZE:F.HEADER_SIZE + 8 * nbufs]
    if len(table) == 8 * nbufs:
        try:
            lens = F.decode_buffer_lens(table, nbufs, plen, MAX)
        except torchwire.ProtocolError:
            return
        assert plen + sum(n & ~F.REMOTE_BIT for n in lens) <= MAX


@fuzz
@given(data=streams)
def test_connection_reader_survives_any_bytes(data):
    conn, b, sink = _reader()
    try:
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)  # then EOF: a truncated frame must not hang the reader
        assert sink.closed.wait(10), "the reader hung"
        # only torchwire's errors: the socket's end of stream is a ConnectionBrokenError
        assert sink.exc is None or isinstance(
            sink.exc, (torchwire.ProtocolError, torchwire.LinkError)), repr(sink.exc)
        for _kind, _flags, _rid, payload, tensors in sink.frames:
            assert len(payload) + sum(t.numel() for t in tensors) <= MAX
    finally:
        conn.close()
        b.close()


def _valid_payload() -> bytes:
    payload, _tensors = ser.dumps((len, ([1, 2.5, "x", None], {"k": (True, b"b")}), None))
    return payload


@fuzz
@given(data=st.one_of(
    st.binary(max_size=200),
    st.tuples(st.integers(0, 200), st.binary(min_size=1, max_size=8)).map(
        lambda t: bytearray(_valid_payload()[:t[0]]) + t[1] + _valid_payload()[t[0]:]),
    st.tuples(st.integers(0, 200), st.integers(0, 255)).map(
        lambda t: _flip(_valid_payload(), *t)),
    st.integers(0, 200).map(lambda n: _valid_payload()[:n]),
))
def test_unpickling_boundary_raises_only_serialization_errors(data):
    # A flipped byte can turn a MEMOIZE into LONG_BINPUT whose 4-byte index is the
    # next bytes of the stream (~10**9): CPython's unpickler then grows its memo array
    # to twice that and zero-fills it (about 20 GB; the test runner was OOM-killed).
    # Under a cap on this process's address space that allocation fails at once, and
    # the boundary must still report it as a SerializationError.
    with _address_space_capped(4 << 30):
        try:
            ser.loads(bytes(data), [])
        except torchwire.SerializationError:
            pass


@contextlib.contextmanager
def _address_space_capped(headroom: int):
    """This process may map at most ``headroom`` bytes more than it has mapped now."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _flip(payload: bytes, at: int, byte: int) -> bytes:
    buf = bytearray(payload)
    buf[at % len(buf)] = byte
    return bytes(buf)


@pytest.mark.parametrize("claim", [MAX + 1, 2 ** 63, 2 ** 64 - 1])
def test_absurd_lengths_are_refused_before_anything_is_allocated(claim):
    for raw in (F.pack_header(F.K_REQUEST, 0, 1, claim, 0),
                F.encode_header(F.K_REQUEST, 0, 1, 0, [1, max(MAX + 1, claim & ~F.REMOTE_BIT)])):
        conn, b, sink = _reader()
        try:
            b.sendall(raw)  # and nothing more: the reader must refuse, not wait for it
            assert sink.closed.wait(10)
            assert isinstance(sink.exc, torchwire.ProtocolError)
            assert "max message size" in str(sink.exc)
        finally:
            conn.close()
            b.close()


def test_the_valid_payload_used_above_does_decode():
    assert ser.loads(_valid_payload(), [])[0] is len
    assert pickle.loads(_valid_payload())[0] is len


def _valid_plain_call() -> bytes:
    return bytes([ser.PlainKind.CALL]) + marshal.dumps(
        ("os.path", "join", None, [(2, "a"), (0, 0, (2,)), (2, 3)]))


# Plain messages (not pickled): their decoders raise ProtocolError or SerializationError
# (RpcStateError for the forms that need an RPC agent, absent in this process), never
# another exception, whatever the bytes after the kind and whatever buffers come along.
@fuzz
@given(st.one_of(
    st.binary(max_size=120),
    st.tuples(st.integers(0, 120), st.integers(0, 255)).map(
        lambda t: _flip(_valid_plain_call(), *t)[1:]),
    st.integers(0, 120).map(lambda n: _valid_plain_call()[1:n])),
    st.sampled_from([ser.PlainKind.NONE, ser.PlainKind.TENSOR, ser.PlainKind.CALL, 0, 99]),
    st.lists(st.binary(max_size=16).map(bytearray), max_size=3))
def test_plain_decoders_raise_only_protocol_errors(body, kind, buffers):
    payload = bytes([kind]) + body
    try:
        if kind == ser.PlainKind.CALL:
            func, args, kwargs = ser.plain_call_decode(payload, buffers)
            assert callable(func) and isinstance(args, tuple) and kwargs is None
        else:
            ser.plain_value(payload, buffers)
    except (torchwire.ProtocolError, torchwire.SerializationError, torchwire.RpcStateError):
        pass


def test_the_valid_plain_call_used_above_does_decode():
    func, args, kwargs = ser.plain_call_decode(_valid_plain_call(), [bytearray(8)])
    assert func is os.path.join and args[0] == "a" and args[2] == 3
    assert args[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("body", [b"(\x00\x00\x00(",  # a tuple of 671 M items: 5 GB
                                  b"[\xff\xff\xff\x7f", b"s\xff\xff\xff\x00abc",
                                  b")\x05N", b"l\xff\xff\xff\x7f"])
def test_plain_bodies_claiming_more_than_they_hold_are_refused_before_allocating(body):
    for kind in (ser.PlainKind.CALL, ser.PlainKind.TENSOR):
        with pytest.raises(torchwire.ProtocolError, match="malformed plain message"):
            if kind == ser.PlainKind.CALL:
                ser.plain_call_decode(bytes([kind]) + body, [])
            else:
                ser.plain_value(bytes([kind]) + body, [])
