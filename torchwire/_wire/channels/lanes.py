"""TCP lanes: a large buffer split over two TCP connections to the same peer.

Across hosts (or with TCP forced) one stream is limited by one core's copies in and
out of the kernel.  A TCP connection that sends requests therefore opens, on its
first buffer of ``MIN_SIZE`` or more, a *lane*: a second TCP connection to the same
peer with the same handshake.  Such a buffer travels half on each, written by the
sending thread and a lane-writer thread at once, and read by the two connections'
readers at once.

A transfer (``tid``: unique per sending process; the receiver keys it by the
sender's rank)::

    sender                              receiver (one LaneRegistry per process)
    main stream: LANE_BIT length, LANE_REF (tid, split), the first split bytes
    lane:        DATA frame (request id tid; LANE_DATA (total, split); the rest)

    per transfer, on the receiver:
      ABSENT   --either part's header arrives-->  OPEN (the buffer is allocated)
      OPEN     --its part read-->                 HALF
      HALF     --the other part read-->           DONE: the main reader delivers the frame
      OPEN/HALF --a connection with the peer ends--> FAILED: the main reader drops
                                                     its connection (ProtocolError)

The main reader waits for the other half (in ``_WAIT_S`` steps, checking for close)
after handing on the frames decoded before it.  The sender hands the lane half to
its lane writer only once the main connection's writer has taken the frame
(``ready``, run by ``Writer.enqueue``): a frame refused for a queue full until the
call's deadline sends neither half, so no transfer is left half-received.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from ..._base.errors import ConnectionClosedError, LinkError, ProtocolError
from .. import frame as F
from ..buffers import byte_view, read_faulting, receive_buffer
from . import Channel, OutFrame, register

log = logging.getLogger("torchwire")

MIN_SIZE = 8 << 20  # buffers from this size are split over the connection and a lane
_PENDING_MAX = 256  # split buffers a peer may have half-sent at once
_WAIT_S = 0.5  # the main reader's wait for the other half, between checks for close
_ALIGN = 4096  # the split falls on a page boundary


class _Transfer:
    __slots__ = ("tensor", "fresh", "view", "parts", "error", "done")

    def __init__(self, n: int) -> None:
        self.tensor, self.fresh = receive_buffer(n)
        self.view = byte_view(self.tensor, n)
        self.parts = 0
        self.error: BaseException | None = None
        self.done = threading.Event()


class LaneRegistry:
    """Large buffers being received in two parts, on two connections with the same
    peer.  Whichever part arrives first allocates the buffer; the reader of the main
    part waits for the other.

    One registry per agent, shared by every connection.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], _Transfer] = {}

    def __repr__(self) -> str:
        return f"<LaneRegistry pending={len(self._pending)}>"

    def get(self, peer: int, tid: int, n: int) -> _Transfer:
        """The transfer ``tid`` from ``peer`` of ``n`` bytes, opened if new.

        Raises:
            ProtocolError: too many transfers open, or sizes that disagree.
        """
        with self._lock:
            tr = self._pending.get((peer, tid))
            if tr is None:
                if sum(1 for p, _ in self._pending if p == peer) >= _PENDING_MAX:
                    raise ProtocolError(f"rank {peer} has too many split buffers in flight")
                tr = self._pending[(peer, tid)] = _Transfer(n)
            elif len(tr.view) != n:
                raise ProtocolError(f"split buffer {tid} from rank {peer}: sizes disagree")
            return tr

    def part_done(self, peer: int, tid: int, tr: _Transfer) -> bool:
        """One part is in; True (and forgotten) when both are."""
        with self._lock:
            tr.parts += 1
            if tr.parts < 2:
                return False
            self._pending.pop((peer, tid), None)
        tr.done.set()
        return True

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        """A connection with ``peer`` ended: no split buffer from it can complete."""
        with self._lock:
            gone = [k for k in self._pending if k[0] == peer]
            trs = [self._pending.pop(k) for k in gone]
        for tr in trs:
            tr.error = exc
            tr.done.set()


@register
class LaneChannel(Channel):
    """The lanes of one TCP connection: it receives split buffers (and, on a lane,
    their second parts), and with ``open_lane`` it splits its own.

    Args:
        registry: the agent's split buffers being received.
        open_lane: ``open_lane() -> Connection``: a new lane to the peer (None: this
            connection does not split buffers).
    """

    name = "lanes"
    bit = F.LANE_BIT
    min_size = MIN_SIZE
    needs_plain_socket = True

    def __init__(self, registry: LaneRegistry, open_lane=None) -> None:
        self.registry = registry
        self._open_lane = open_lane
        self._lane = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ sending

    def begin(self, conn) -> bool:
        lane = self._lane
        if lane is not None and not lane.closed:
            return True
        with self._lock:
            if self._lane is None or self._lane.closed:
                if self._open_lane is None:
                    return False
                try:
                    self._lane = self._open_lane()
                except Exception as exc:  # no lane: the whole buffer goes on this connection
                    log.debug("torchwire: no lane to rank %s: %s", conn.peer_rank, exc)
                    self._open_lane = None
                    return False
            return True

    def encode(self, conn, frame: OutFrame, t, n: int) -> bool:
        if frame.state is None:
            frame.state = (self._lane, [])
        tid = next(_transfer_ids)
        split = n // 2 // _ALIGN * _ALIGN
        view = byte_view(t, n)
        frame.add(n | F.LANE_BIT, F.LANE_REF.pack(tid, split), view[:split])
        frame.state[1].append((tid, n, split, view[split:]))
        return True

    def ready(self, conn, frame: OutFrame) -> None:
        # The lane's halves go from a lane-writer thread while this one writes its own;
        # both hold the tensors until written.
        lane, halves = frame.state
        parts = []
        for tid, n, split, rest in halves:
            parts += [F.encode_header(F.K_DATA, 0, tid, F.LANE_DATA.size, [n - split]),
                      F.LANE_DATA.pack(n, split), rest]
        _lane_writer().submit(_write_lane, lane, parts, frame.tensors)

    # ------------------------------------------------------------ receiving

    def decode(self, conn, rx, n: int):
        tid, split = rx.read_ref(F.LANE_REF)
        if split > n:
            raise ProtocolError("malformed split buffer")
        tr = self.registry.get(conn.peer_rank, tid, n)
        read_faulting(rx.read_exact_into, tr.view[:split], tr.fresh)
        if not self.registry.part_done(conn.peer_rank, tid, tr):
            rx.deliver()  # what is complete goes on before this waits
            while not tr.done.wait(_WAIT_S):
                conn.progress_in += 1
                if conn.closed:
                    raise ConnectionClosedError("closed while waiting for a lane")
        if tr.error is not None:
            raise ProtocolError(f"lane from rank {conn.peer_rank} failed: {tr.error}")
        return tr.tensor

    def read_data(self, conn, rx, tid: int, lens, payload) -> None:
        """A DATA frame (this connection is a lane): read the second part of transfer
        ``tid`` into its buffer.

        Raises:
            ProtocolError: malformed.
        """
        if len(lens) != 1 or len(payload) != F.LANE_DATA.size:
            raise ProtocolError("unexpected DATA frame")
        total, split = F.LANE_DATA.unpack(payload)
        if split > total or lens[0] != total - split or total > conn.max_message_size:
            raise ProtocolError("malformed DATA frame")
        tr = self.registry.get(conn.peer_rank, tid, total)
        read_faulting(rx.read_exact_into, tr.view[split:], tr.fresh)
        self.registry.part_done(conn.peer_rank, tid, tr)

    def reader_done(self, conn, exc: BaseException) -> None:
        self.registry.fail_peer(conn.peer_rank, exc)


_transfer_ids = itertools.count(1)  # next() is atomic under the GIL
_lane_pool = None
_lane_pool_lock = threading.Lock()


def _lane_writer() -> ThreadPoolExecutor:
    global _lane_pool
    with _lane_pool_lock:
        if _lane_pool is None:
            _lane_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torchwire-lane")
        return _lane_pool


def _write_lane(lane, parts, tensors) -> None:
    """Write a lane's DATA frames (``tensors`` held until then).  A failed lane
    closes: the peer's reader of the main part then fails the frame."""
    try:
        lane.send_encoded(parts, tensors)
    except LinkError:
        pass
