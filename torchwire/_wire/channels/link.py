"""Which channels one link uses: decided per connection from what both ends know.

Each worker publishes at rendezvous what it offers (:func:`local_offer`: its CMA
probe record, whether it maps shared-memory segments).  A connection's
:class:`ChannelSet` is then built from the link's facts (:meth:`ChannelSet.for_link`):

* **shm** on a Unix socket to a peer on this host, when this worker allows it: we
  always accept segments then, and send through them when the peer offers them too;
* **cma** on such a link, when this worker allows it and the probe reads the peer's
  token back from its memory;
* **lanes** on TCP: every connection accepts split buffers; one that sends requests
  (not a lane itself) splits its own when lanes are on;
* the socket always, for everything else.

Preference when sending: lanes, shm, cma (each from its own ``min_size``).
"""

from __future__ import annotations

from ..._base.errors import ProtocolError
from .. import frame as F
from . import NEVER, RELEASE_CHANNEL, REGISTRY, Channel
from . import cma as _cma
from . import segments
from .cma import MIN_SIZE as CMA_MIN, CmaChannel
from .lanes import LaneChannel, LaneRegistry
from .shm import MIN_SIZE as SHM_MIN, ShmChannel


def local_offer(shm: bool) -> dict:
    """What this worker publishes for same-host peers to choose channels by.

    Args:
        shm: this worker allows the shared-memory channel.
    """
    return {"cma": _cma.probe_record(), "shm": bool(shm) and segments.available()}


class ChannelSet:
    """The channels of one connection: those it sends large buffers with, in order of
    preference, and those it accepts, by bit.  Built once per connection.

    Args:
        cma_pid: the peer's pid when large buffers may go by cross-memory attach.
        shm_send, shm_recv: send through / accept shared-memory segments.
        lanes: the agent's registry of split buffers being received (None: refused).
        open_lane: how to open a lane to the peer (None: buffers are not split).
        threshold: buffers of at least this size leave the socket for a same-host
            channel (None: each channel's default).
    """

    def __init__(self, *, cma_pid: int | None = None, shm_send: bool = False,
                 shm_recv: bool = False, lanes: LaneRegistry | None = None, open_lane=None,
                 threshold: int | None = None) -> None:
        send: list[Channel] = []
        receive: list[Channel] = []
        if lanes is not None:
            lane = LaneChannel(lanes, open_lane)
            receive.append(lane)
            if open_lane is not None:
                send.append(lane)
        if (shm_send or shm_recv) and segments.available():
            shm = ShmChannel(SHM_MIN if threshold is None else threshold)
            if shm_send:
                send.append(shm)
            if shm_recv:
                receive.append(shm)
        if cma_pid is not None:
            cma = CmaChannel(cma_pid, CMA_MIN if threshold is None else threshold)
            send.append(cma)
            receive.append(cma)
        self._build(send, receive)

    def _build(self, send: list[Channel], receive: list[Channel]) -> None:
        self.send = tuple(send)
        self.receive = {ch.bit: ch for ch in receive}
        self.all = tuple(dict.fromkeys(send + receive))
        self.large_min = min((ch.min_size for ch in send), default=NEVER)
        self.fd_passing = any(ch.receives_fds for ch in receive)
        self._release = {ch.release_flag: ch for ch in self.all if ch.release_flag is not None}

    @classmethod
    def for_link(cls, transport: str, *, same_host: bool, peer_cma: dict | None,
                 peer_shm: bool, cma: bool, shm: bool, lanes: LaneRegistry | None,
                 open_lane=None, threshold: int | None = None) -> ChannelSet:
        """The channels of a new connection.

        Args:
            transport: ``"unix"`` or ``"tcp"``.
            same_host: the peer shares this kernel and network namespace.
            peer_cma, peer_shm: what the peer published (:func:`local_offer`).
            cma, shm: this worker allows the channel.
            lanes, open_lane, threshold: as for the constructor; ``open_lane`` counts
                on TCP only.
        """
        local = transport == "unix" and same_host
        cma_pid = None
        if local and cma and _cma.can_read(peer_cma):
            cma_pid = peer_cma["pid"]
        shm_recv = local and shm and segments.available()
        return cls(cma_pid=cma_pid, shm_recv=shm_recv, shm_send=shm_recv and bool(peer_shm),
                   lanes=lanes, open_lane=open_lane if transport == "tcp" else None,
                   threshold=threshold)

    def on_socket(self, plain: bool) -> ChannelSet:
        """This set as a socket of that kind can carry it: a TLS link (``plain``
        False) passes no descriptors and opens no lanes."""
        if plain or not any(ch.needs_plain_socket for ch in self.all):
            return self
        narrowed = ChannelSet.__new__(ChannelSet)
        narrowed._build([ch for ch in self.send if not ch.needs_plain_socket],
                        [ch for ch in self.receive.values() if not ch.needs_plain_socket])
        return narrowed

    def __repr__(self) -> str:
        receive = sorted(ch.name for ch in self.receive.values())
        return f"<ChannelSet send={'+'.join(self.send_names())} receive={'+'.join(receive)}>"

    def send_names(self) -> list[str]:
        """The channels large buffers leave by, in order of preference, then the socket."""
        return [ch.name for ch in self.send] + ["socket"]

    def sends(self, name: str) -> bool:
        """Do large buffers leave by channel ``name``?"""
        return any(ch.name == name for ch in self.send)

    def receives(self, name: str) -> bool:
        """Does this connection accept buffers of channel ``name``?"""
        return any(ch.name == name for ch in self.receive.values())

    # ------------------------------------------------------------ the reader's

    def unknown(self, bits: int) -> ProtocolError:
        """The error of a buffer marked ``bits`` that no channel here accepts."""
        cls = REGISTRY.get(bits)
        what = f"a {cls.name}" if cls is not None else f"a {bits:#x}-marked"
        return ProtocolError(f"peer sent {what} buffer on a connection without that channel")

    def read_data(self, conn, rx, tid: int, lens, payload) -> None:
        """A DATA frame: the second part of a split buffer (see ``lanes.py``)."""
        lane = self.receive.get(F.LANE_BIT)
        if lane is None:
            raise ProtocolError("unexpected DATA frame")
        lane.read_data(conn, rx, tid, lens, payload)

    def released(self, conn, token: int, flags: int) -> None:
        """A RELEASE frame: to the channel its flags name (none here: ignored, as a
        late RELEASE after a close is)."""
        ch = self._release.get(flags & RELEASE_CHANNEL)
        if ch is not None:
            ch.released(conn, token, flags)

    def holding(self, conn) -> int:
        return sum(ch.holding(conn) for ch in self.all)

    def close(self, conn) -> None:
        for ch in self.all:
            ch.close(conn)

    def reader_done(self, conn, exc: BaseException) -> None:
        for ch in self.all:
            ch.reader_done(conn, exc)
