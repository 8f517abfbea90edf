"""Channels: how a tensor buffer travels on a connection.

A frame's buffers follow its payload in the socket stream unless a channel takes
them.  Each channel other than the socket marks its buffers with one bit of the
buffer length (``frame.py``) and puts its own *reference* in the stream instead of
the bytes (or of some of them)::

    channel   bit          takes                          the stream carries
    socket    -            everything else                the bytes
    cma       REMOTE_BIT   >= 256 KiB, same host          address, release token
    shm       SHM_BIT      >= 2 MiB, same host            segment id, size, offset, mode
    lanes     LANE_BIT     >= 8 MiB, TCP                  transfer id, split, first half

A :class:`Channel` is one instance per connection (it holds that link's state: the
peer's pid, the CMA frames held, the lane) and implements each step of a buffer's
life.  Sending: the connection hands a frame whose largest buffer reaches a
channel's ``min_size`` to the first such channel (in the order of
:attr:`ChannelSet.send`); the channel :meth:`~Channel.encode`\\ s each buffer it
takes into the :class:`OutFrame`, the socket carries the rest, and
:meth:`~Channel.ready` / :meth:`~Channel.drop` follow as the frame is queued or
not.  Receiving: the reader hands each buffer whose length has a channel bit to
the channel registered for that bit on the connection (:meth:`~Channel.decode`;
one dict lookup, for such buffers only).  Releasing: a RELEASE frame goes to the
sending channel its flags name (:meth:`~Channel.released`).  Closing:
:meth:`~Channel.close` when the connection closes, :meth:`~Channel.reader_done`
when its reading has ended.

Which channels a link uses is decided per connection from what both ends know
(``link.py``: :meth:`ChannelSet.for_link`).  Small frames never reach this
package: the connection writes their buffers itself, and the reader copies
small buffers it has already read into ``bytearray``\\ s in its own loop.
"""

from __future__ import annotations

from .. import frame as F
from ..buffers import byte_view

NEVER = 1 << 64  # a min_size no buffer reaches
MAX_FDS = 250  # descriptors per frame (the kernel takes at most 253 per sendmsg)
RELEASE_CHANNEL = F.F_SHM  # the flags of a RELEASE frame that name its channel

REGISTRY: dict[int, type[Channel]] = {}
"""Every channel class but the socket, by the buffer-length bit that marks its buffers."""


def register(cls: type[Channel]) -> type[Channel]:
    """Class decorator: enter a channel class in :data:`REGISTRY` under its bit."""
    if not cls.bit or cls.bit & F.LEN_MASK or REGISTRY.get(cls.bit, cls) is not cls:
        raise ValueError(f"channel {cls.name}: bit {cls.bit:#x} is not a free channel bit")
    REGISTRY[cls.bit] = cls
    return cls


class ChannelFailed(Exception):
    """Raised by :meth:`Channel.encode`: this channel cannot carry the frame after all
    (it logged why); the frame is dropped and rebuilt by the next channel."""


class OutFrame:
    """A frame being built: the wire length of each buffer, the stream parts that
    follow the payload, the descriptors that go with the frame, and ``state``: what
    the channel building it keeps per frame (a token, leases to undo), and the
    sender's ``deadline`` (``time.monotonic()``, None: none), which bounds any wait
    of a channel's."""

    __slots__ = ("flags", "tensors", "nbytes", "lens", "parts", "fds", "state", "deadline")

    def __init__(self, flags: int, tensors, deadline: float | None = None,
                 nbytes: int = 0) -> None:
        self.flags = flags
        self.tensors = tensors
        self.nbytes = nbytes  # of all its tensors
        self.deadline = deadline
        self.lens: list[int] = []
        self.parts: list = []
        self.fds: list[int] = []
        self.state = None

    def add(self, wire_len: int, *parts) -> None:
        """A buffer marked ``wire_len``, carried by ``parts`` in the stream."""
        self.lens.append(wire_len)
        self.parts.extend(parts)

    def add_inline(self, t, n: int) -> None:
        """A buffer whose ``n`` bytes follow in the stream (the socket channel)."""
        self.lens.append(n)
        if n:
            self.parts.append(byte_view(t, n))


class Channel:
    """How large buffers travel on one connection (one instance per connection).

    Attributes:
        name: the channel's name (``_channels`` option, stats, errors).
        bit: the buffer-length bit that marks its buffers (0: the socket's own).
        min_size: when sending, the smallest buffer it takes.
        release_flag: the flags (of ``RELEASE_CHANNEL``) of the RELEASE frames that
            end what it lent the peer; None if it lends nothing.
        needs_plain_socket: it passes descriptors or opens sockets of its own, which
            a TLS link cannot.
        receives_fds: its buffers arrive with descriptors (``SCM_RIGHTS``): the
            reader takes them from the socket into ``conn.fds``, in arrival order.

    The connection calls the sending methods on the thread that sends the frame, the
    receiving ones on the thread that reads, the others from any thread.
    """

    name = "socket"
    bit = 0
    min_size = NEVER
    release_flag: int | None = None
    needs_plain_socket = False
    receives_fds = False

    # ------------------------------------------------------------ sending

    def begin(self, conn) -> bool:
        """May this channel build a frame now?  (False: the next channel does.)"""
        return True

    def encode(self, conn, frame: OutFrame, t, n: int) -> bool:
        """Add the ``n`` bytes of tensor ``t`` (``n >= min_size``) to ``frame``; False
        to leave them to the socket.

        Raises:
            ChannelFailed: the frame must go by another channel.
            LinkError: the connection is closed.
        """
        raise NotImplementedError

    def ready(self, conn, frame: OutFrame) -> None:
        """``frame`` (built by this channel) was taken by the connection's writer and
        will be written; none of it is yet (called under the writer's lock: it must
        not block).  A frame that does not go after all (refused for a queue full
        until the deadline or a closed connection, or its write failed) gets
        :meth:`drop`."""

    def drop(self, conn, frame: OutFrame) -> None:
        """``frame`` (built by this channel) will not be sent: undo what ``encode``
        did.  Its descriptors are the connection's to close."""

    # ------------------------------------------------------------ receiving

    def decode(self, conn, rx, n: int):
        """Read one buffer of ``n`` bytes (its channel bit cleared) from ``rx`` (the
        reader's :class:`~torchwire._wire.reader.Stream`).

        Returns:
            A ``uint8`` tensor, or a ``bytearray``, of ``n`` bytes.

        Raises:
            ProtocolError: the peer's reference is malformed or names nothing.
        """
        raise NotImplementedError

    # ------------------------------------------------------------ releasing, closing

    def released(self, conn, token: int, flags: int) -> None:
        """The peer's RELEASE of ``token``: it no longer needs what we lent it."""

    def holding(self, conn) -> int:
        """How many things this side still keeps for the peer of ``conn`` (frames or
        leases awaiting its RELEASE)."""
        return 0

    def close(self, conn) -> None:
        """The connection is closed: nothing more is lent, and what the peer held
        ends (it may still read it: never reused)."""

    def reader_done(self, conn, exc: BaseException) -> None:
        """The connection's reading has ended for good (``exc``: why): fail what the
        peer was still sending."""
