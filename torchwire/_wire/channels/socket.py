"""The socket channel: a buffer's bytes follow its frame's payload in the stream.

Every frame's fallback, and the only channel of small buffers.  Their hot path is
not here: the connection writes the buffers of a frame without large ones itself,
and the reader copies a small buffer it has already read into a ``bytearray`` in
its own loop; this class carries the rest (a frame another channel builds, a
buffer the reader receives straight into a tensor's storage).
"""

from __future__ import annotations

from ..buffers import byte_view, read_faulting, receive_buffer
from . import Channel


class SocketChannel(Channel):
    """In the stream; stateless, one instance serves every connection."""

    def encode(self, conn, frame, t, n: int) -> bool:
        frame.add_inline(t, n)
        return True

    def decode(self, conn, rx, n: int):
        t, fresh = receive_buffer(n)
        if n:
            read_faulting(rx.read_exact_into, byte_view(t, n), fresh)
        return t


SOCKET = SocketChannel()
