"""Frame codec.

Every message on a torchwire connection is one frame::

    +-------+---------+------+-------+------------+-------------+-------+----------+
    | magic | version | kind | flags | request id | payload len | nbufs | reserved |
    |  2 B  |   1 B   | 1 B  |  4 B  |    8 B     |     8 B     |  4 B  |   4 B    |
    +-------+---------+------+-------+------------+-------------+-------+----------+
    | nbufs x 8 B buffer lengths | payload | buffer 0 | buffer 1 | ...

All integers are little-endian; the reserved field is sent as zero and ignored.
The payload is, unless the frame has the PLAIN flag, the pickle stream with every
tensor lifted out of it (the payload + tensor-table split TensorPipe uses); the
buffers are the raw bytes of those tensors, in table order, so the receiver can
read each one straight into freshly allocated tensor storage.

A buffer length with one of the channel bits set (``REMOTE_BIT``, ``SHM_BIT``,
``LANE_BIT``) is a buffer that does not follow in the stream, or not whole: the
stream carries that channel's reference instead (see ``channels/``).

The PLAIN flag (the plain codec, torchwire/_serialization/plain.py) marks a payload
that is no pickle stream but a fixed layout whose first byte names its kind.  It
has three uses:

* a REQUEST with request id 0: an internal one-way message, handed to the handler
  the layer above registered for its kind;
* a REQUEST with a request id: a call, in plain form (a module-level function and
  simple positional arguments);
* a RESPONSE: a reply of None, of a plain tensor, or of a tensor of an autograd
  context.

Lengths are checked against limits before anything is allocated, so a peer
cannot make us reserve memory it never sends.
"""

from __future__ import annotations

import enum
import functools
import struct

from .._base.errors import ProtocolError
from .._base.options import DEFAULT_MAX_MESSAGE_SIZE

MAGIC = b"TW"
# 2: the handshake became an HMAC challenge-response (CHALLENGE frame, see auth.py).
# 3: CONTROL frames carry the heartbeat (PING / PONG, see _agent/liveness.py).
# 4: shared-memory buffers (SHM_BIT, SHM_REF; RELEASE with the SHM flag); TCP lanes
#    (LANE_BIT, LANE_REF, DATA frames).
# 5: PLAIN requests (internal one-way messages in a fixed layout, not pickled).
# 6: PLAIN also marks RESPONSEs (None, a plain tensor, a tensor of an autograd
#    context) and REQUESTs with a request id (calls).  Both came under version 5,
#    so two version 5 peers could disagree on them; version 6 names the set.
# 7: RELEASE with the FORGET flag (a segment's owner closed it: unmap what you cache).
VERSION = 7

# The reserved field is padding: packed as zeros, skipped when unpacked.
HEADER = struct.Struct("<2sBBIQQI4x")
HEADER_SIZE = HEADER.size  # 32

# pack_header(kind, flags, request_id, payload_len, nbufs) -> the 32-byte header.
# A partial of the struct's C pack: building a header costs no Python-level call.
pack_header = functools.partial(HEADER.pack, MAGIC, VERSION)

# Buffers one frame may carry: bounds the length table a reader allocates.
MAX_BUFFERS = 1 << 20


class Kind(enum.IntEnum):
    """What a frame carries.  Values are part of the wire format."""

    HELLO = 1  # client's proof of the job key, answering a CHALLENGE (see auth.py)
    HELLO_ACK = 2  # server's proof (or, with the ERROR flag, its refusal)
    REQUEST = 3  # run a function; a reply is expected unless the request id is 0
    RESPONSE = 4  # reply to REQUEST with the same request id
    GOODBYE = 5  # orderly close: the sender will send nothing more
    CONTROL = 6  # wire-level liveness: the request id is a ControlOp (PING or PONG)
    RELEASE = 7  # wire level: the receiver has read the CMA buffers of token <request id>,
    #              or (SHM flag) has unmapped one lease of shared-memory segment <request id>
    CHALLENGE = 8  # connection opening, server first: its rank and a fresh nonce
    DATA = 9  # on a lane: the second part of a large buffer of a frame sent on another
    #           connection to the same peer; request id = transfer id (see LANE_BIT)


class ControlOp(enum.IntEnum):
    """What a CONTROL frame asks (carried in its request id).  Part of the wire format."""

    PING = 1  # are you there?  (sent only on a connection that has been idle)
    PONG = 2  # the answer to PING


class Flags(enum.IntFlag):
    NONE = 0
    ERROR = 1  # RESPONSE carries an exception description, not a value
    CMA = 2  # some buffers stay in the sender's memory: see REMOTE_BIT
    SHM = 4  # RELEASE: of a shared-memory segment, not of a CMA token
    RETIRE = 8  # RELEASE (SHM): a process the receiver forked may still map the segment
    PLAIN = 16  # REQUEST or RESPONSE: the payload is in the plain codec's fixed layout,
    #             not a pickle stream (see the module docstring for its three uses)
    FORGET = 32  # RELEASE (SHM), from a segment's owner: it closed the segment; the
    #              receiver unmaps the mapping it kept of it (channels/mappings.py)


# Plain ints for the hot path (enum attribute access costs a dict lookup).
K_HELLO = int(Kind.HELLO)
K_HELLO_ACK = int(Kind.HELLO_ACK)
K_REQUEST = int(Kind.REQUEST)
K_RESPONSE = int(Kind.RESPONSE)
K_GOODBYE = int(Kind.GOODBYE)
K_CONTROL = int(Kind.CONTROL)
K_RELEASE = int(Kind.RELEASE)
K_CHALLENGE = int(Kind.CHALLENGE)
K_DATA = int(Kind.DATA)
CTRL_PING = int(ControlOp.PING)
CTRL_PONG = int(ControlOp.PONG)
F_ERROR = int(Flags.ERROR)
F_CMA = int(Flags.CMA)
F_SHM = int(Flags.SHM)
F_RETIRE = int(Flags.RETIRE)
F_PLAIN = int(Flags.PLAIN)
F_FORGET = int(Flags.FORGET)
# In a CMA frame, a buffer length with this bit set is a buffer the receiver reads
# from the sender's memory; the stream then carries 16 bytes instead of the
# buffer: its address and the frame's release token (both u64).
REMOTE_BIT = 1 << 63
REMOTE_REF = struct.Struct("<QQ")
# A buffer length with this bit set is a buffer in a shared-memory segment (see
# channels/shm.py); the stream carries SHM_REF instead: segment id, segment size,
# offset of the buffer in it, and how it travels (1: the segment's descriptor
# rides with the frame, SCM_RIGHTS; 2: a segment of the receiver's own).
SHM_BIT = 1 << 62
SHM_REF = struct.Struct("<QQQQ")
# A buffer length with this bit set is a large buffer split over two TCP
# connections: the stream carries LANE_REF (transfer id, split) and then the
# first ``split`` bytes; the rest arrives on a lane in a DATA frame whose
# payload is LANE_DATA (total length, split) and whose one buffer is the rest.
LANE_BIT = 1 << 61
LANE_REF = struct.Struct("<QQ")
LANE_DATA = struct.Struct("<QQ")
CHANNEL_BITS = REMOTE_BIT | SHM_BIT | LANE_BIT
LEN_MASK = ~CHANNEL_BITS
_KINDS = frozenset(int(k) for k in Kind)


def encode_header(kind: int, flags: int, request_id: int, payload_len: int,
                  buffer_lens: list[int]) -> bytes:
    """Return header + buffer-length table as one bytes object."""
    head = pack_header(kind, flags, request_id, payload_len, len(buffer_lens))
    if not buffer_lens:
        return head
    return head + struct.pack(f"<{len(buffer_lens)}Q", *buffer_lens)


def encode_frame(kind: int, flags: int, request_id: int, payload: bytes = b"") -> bytes:
    """A whole frame without buffers (control, release, a small reply), as one bytes
    object."""
    return pack_header(kind, flags, request_id, len(payload), 0) + payload


def decode_header(data, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
                  ) -> tuple[int, int, int, int, int]:
    """Parse the fixed header.

    Returns:
        ``(kind, flags, request_id, payload_len, nbufs)``.

    Raises:
        ProtocolError: wrong magic or version, unknown kind, absurd lengths.
    """
    magic, version, kind, flags, rid, plen, nbufs = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a torchwire peer?)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if plen > max_message_size:
        raise ProtocolError(f"payload of {plen} bytes exceeds max message size {max_message_size}")
    if nbufs > MAX_BUFFERS:
        raise ProtocolError(f"{nbufs} buffers in one frame exceeds the limit {MAX_BUFFERS}")
    return kind, flags, rid, plen, nbufs


def decode_buffer_lens(data, nbufs: int, payload_len: int,
                       max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> list[int]:
    """Parse the buffer-length table and check the frame's total size."""
    lens = list(struct.unpack_from(f"<{nbufs}Q", data)) if nbufs else []
    total = payload_len
    for n in lens:  # (no generator: this runs for every frame with tensors)
        total += n & LEN_MASK
    if total > max_message_size:
        raise ProtocolError(f"frame of {total} bytes exceeds max message size {max_message_size}")
    return lens
