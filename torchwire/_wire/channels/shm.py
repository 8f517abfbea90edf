"""The shared-memory channel: large buffers to a same-host peer in memfd segments.

The segments and their leases are ``segments.py``; this is how a buffer in one
travels.  The stream carries ``SHM_REF`` (segment id, segment size, offset, mode)
for each buffer, in one of two modes::

    HOW_FD    the segment's descriptor rides with the frame (SCM_RIGHTS, attached
              to the sendmsg that starts with the frame's header, so it arrives no
              later than the header); the receiver maps it privately
    HOW_BACK  a segment of the receiver's own, sent back unmodified: it maps it again

A transfer, per buffer::

    sender                                      receiver
    export: lease a segment (copy in, or
      reuse an own or returned one)
    frame (SHM_BIT buffer, descriptor) ->
                                                map the segment (or lend the mapping
                                                kept of it again); lend it to a tensor
                                                ... the last tensor over it dies
                                             <- RELEASE (SHM flag, segment id; RETIRE
                                                if a fork may still map it), sent by
                                                the release thread
    the lease ends (segments.py)
    ... the segment is closed
    RELEASE (SHM + FORGET, segment id) ->       unmap the mapping kept of it

A connection that closes ends its leases: what the peer may still map is never
written again.

Backpressure: a peer that stops reading (frozen) releases nothing, so a sender
would fill memory with segments for it.  Past ``MAX_LEASED`` bytes leased to one
peer (``MAX_LEASED_SILENT`` while the heartbeat hears nothing from it; one buffer
of any size is always let in), buffers go through the socket instead, whose
writer bounds what waits and fails calls at their deadlines (``writer.py``).  A
peer that talks is waited for briefly first (``segments.await_room``): one that
just replied releases what it received right after, and a second large call sent
at once would otherwise take the socket.  It may also hold much more for good (a
parameter server keeping what it received): then, after two vain waits, they stop
for the rest of that connection.
"""

from __future__ import annotations

import logging

from ..._base.errors import ProtocolError
from .. import frame as F
from . import MAX_FDS, Channel, ChannelFailed, OutFrame, register
from . import segments

log = logging.getLogger("torchwire")

MIN_SIZE = 2 << 20  # below this, mapping + unmapping costs more than CMA's copy
MAX_LEASED = 2 << 30  # bytes of segments one peer may hold before the socket is used
MAX_LEASED_SILENT = 128 << 20  # the same while its connection is silent
# A frame of this many bytes of tensors (a state dict) copies each one over 1 MiB on
# every core; a smaller one, only those over 16 MiB (memory.copy): splitting smaller
# copies costs a host whose cores are all busy (BENCHMARKS.md, fifth session).
BULK_BYTES = 64 << 20


@register
class ShmChannel(Channel):
    """The shared-memory channel of one connection (a plain Unix socket).

    Args:
        min_size: the smallest buffer sent this way.
    """

    name = "shm"
    bit = F.SHM_BIT
    release_flag = F.F_SHM
    needs_plain_socket = True
    receives_fds = True

    def __init__(self, min_size: int = MIN_SIZE) -> None:
        self.min_size = max(1, min_size)

    def encode(self, conn, frame: OutFrame, t, n: int) -> bool:
        if len(frame.fds) >= MAX_FDS:
            return False
        leased = segments.leased_bytes(conn)
        if leased and leased + n > (MAX_LEASED_SILENT if conn.silent else MAX_LEASED):
            # a peer that talks releases what it received after its reply: wait for that
            if conn.silent or not segments.await_room(conn, n, MAX_LEASED, frame.deadline):
                return False
        try:
            seg_id, seg_size, offset, how, fd = segments.export(
                t, n, conn, frame.nbytes >= BULK_BYTES)
        except OSError as exc:  # no memory for a segment, descriptors exhausted, ...
            log.warning("torchwire: shared-memory channel to rank %s failed (%s); "
                        "sending through the socket", conn.peer_rank, exc)
            raise ChannelFailed from exc
        if fd is not None:
            frame.fds.append(fd)
            if frame.state is None:
                frame.state = []
            frame.state.append(seg_id)
        frame.add(n | F.SHM_BIT, F.SHM_REF.pack(seg_id, seg_size, offset, how))
        return True

    def drop(self, conn, frame: OutFrame) -> None:
        for seg_id in frame.state or ():
            segments.release(conn, seg_id)

    def decode(self, conn, rx, n: int):
        seg_id, seg_size, offset, how = rx.read_ref(F.SHM_REF)
        if how == segments.HOW_FD:
            if not conn.fds:
                raise ProtocolError("shared-memory buffer arrived without its descriptor")
            return segments.import_fd(conn, conn.fds.popleft(), seg_id, seg_size, offset, n)
        if how == segments.HOW_BACK:
            return segments.import_back(conn, seg_id, offset, n)
        raise ProtocolError(f"unknown shared-memory buffer mode {how}")

    def released(self, conn, token: int, flags: int) -> None:
        if flags & F.F_FORGET:
            segments.forget(conn, token)
        else:
            segments.release(conn, token, bool(flags & F.F_RETIRE))

    def close(self, conn) -> None:
        segments.connection_closed(conn)

    def holding(self, conn) -> int:
        return segments.leased_to(conn)
