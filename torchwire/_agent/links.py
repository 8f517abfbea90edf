"""Links: the agent's connections to its peers, and their lifecycle.

Every worker listens on TCP and on an abstract Unix socket.  A connection is made
on first use: a Unix socket when the peer's host identity (boot id + network
namespace) equals ours, TCP otherwise.  Each side sends its requests on the
connection it opened (the link's ``conn``) and replies on the connection a request
arrived on (``incoming``), so two workers calling each other at once never race to
share one socket.  A TCP connection may open a second one, a *lane*, for the second
half of large buffers.  Every connection, dialled or accepted, is made by one
factory (:meth:`Links._make`), which also chooses its channels.

One link (this worker's view of one peer), :class:`LinkState`::

    IDLE --a call needs it--> CONNECTING --socket open--> AUTHENTICATING --handshake--> UP
    UP --no traffic for heartbeat_interval: PING sent--> SUSPECT --traffic--> UP
    UP, SUSPECT --connection ended without GOODBYE, or silent for
                 heartbeat_timeout--> DOWN
    CONNECTING, AUTHENTICATING --unreachable, reset, or the attempt's own time
                 (handshake_timeout) ran out--> DOWN
    CONNECTING, AUTHENTICATING --the caller's deadline came first--> IDLE (or DOWN, as
                 it was; nothing is learnt of the peer)
    CONNECTING, AUTHENTICATING --refused by its host, or failed authentication--> DEAD
    DOWN --the next call, once the backoff has passed (at most 1 s), or the monitor's
                 background retry--> CONNECTING
    DOWN --a connection from the peer completed its handshake--> IDLE (reached again)
    UP --GOODBYE (an orderly close)--> IDLE
    any --the peer left the group--> (the link is dropped)

=======================  =====================  =========================================
transition               owner thread           reason in ``WorkerUnavailableError``
=======================  =====================  =========================================
IDLE/DOWN → CONNECTING   the calling thread     —
CONNECTING → DOWN        the calling thread     ``cannot connect: <OS error>``
AUTHENTICATING → DOWN    the calling thread     ``cannot connect: handshake ... timed out``
→ DEAD                   the calling thread     ``its listener refused the connection``
                                                or ``handshake failed: <why>``
UP ↔ SUSPECT             the monitor thread     —
UP/SUSPECT → DOWN        the connection's       ``connection lost (<why>)``
                         reader
UP/SUSPECT → DOWN        the monitor thread     ``no heartbeat for <n> s``
DOWN → IDLE              the handshake thread   —
=======================  =====================  =========================================

The dialling thread holds the link's lock; other callers wait for it until their own
deadlines at most.  A call's deadline bounds connect, handshake and TLS; an attempt
without one (internal messages, ``timeout=0``) is bounded by ``handshake_timeout``.
DOWN and DEAD are remembered in :class:`~.liveness.PeerHealth` (with the backoff),
which the heartbeat and shutdown also read; the other states are the link's own.

Entering DOWN or DEAD is ``RpcAgent.peer_lost``: every call pending on the peer
fails with ``WorkerUnavailableError`` naming it and the reason; the plug-ins hear of
it once (RRefs it owned fail, forks it held are released, distributed autograd
contexts that touched it fail, as ``docs/architecture.md``'s failure model says).
Connections with a member that was dropped from a dynamic group are *retired*:
their end says nothing about a newcomer that took the rank.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
import weakref

import torch

from .._base.errors import (ConnectError, LinkError, RpcStateError, RpcTimeoutError,
                            WorkerUnavailableError)
from .._base.options import channel_allowed
from .._wire.auth import client_handshake, server_handshake
from .._wire.channels import segments
from .._wire.channels.lanes import LaneRegistry
from .._wire.channels.link import ChannelSet
from .._wire.connection import Connection
from .._wire.listener import connect_tcp, connect_unix
from .liveness import PeerState
from .state import AgentState

log = logging.getLogger("torchwire")


_BACKGROUND_ATTEMPT = 1.0  # seconds one background attempt to reach a DOWN peer may take
_LANE_ATTEMPT = 0.5  # seconds opening a lane may take (a healthy peer needs milliseconds)
_CONNECT_TRY = 1.0  # seconds per TCP connect try: a SYN lost in a cut is resent this soon
_UNREACHABLE_PAUSE = 0.1  # seconds between tries that fail at once ("no route to host")


class LinkState(enum.Enum):
    """A link's state (the diagram in the module docstring)."""

    IDLE = "idle"
    CONNECTING = "connecting"
    AUTHENTICATING = "authenticating"
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"
    DEAD = "dead"


class _Link:
    """This worker's link to one peer: the connection it opened (``conn``), the lock
    its dialling holds, and its phase (the states that are not DOWN or DEAD)."""

    __slots__ = ("lock", "conn", "phase")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn = None
        self.phase = LinkState.IDLE


class LoopbackConnection:
    """Calls to oneself: same serialization (copy semantics), no socket."""

    transport = "loopback"
    initiated = True
    closed = False
    role = None  # nothing to read: its reading is never lent

    def __init__(self, on_frames, rank: int) -> None:
        self._on_frames = on_frames
        self.peer_rank = rank

    def __repr__(self) -> str:
        return f"<LoopbackConnection rank={self.peer_rank}>"

    def send_frame(self, kind, flags, request_id, payload, tensors=(), deadline=None) -> None:
        copies = [t.reshape(-1).view(torch.uint8).clone() if t.numel() else
                  torch.empty(0, dtype=torch.uint8) for t in tensors]
        for c in copies:
            if c.is_cuda:  # a CUDA tensor to oneself, cloned on this thread's stream:
                torch.cuda.current_stream(c.device).synchronize()  # done before the callee
        self._on_frames(self, [(kind, flags, request_id, payload, copies)], False)

    def close(self, reason=None) -> None:
        pass

    def send_goodbye(self) -> None:
        pass

    def join(self, timeout) -> None:
        pass


class Links:
    """The connections of one agent (see the module docstring).

    Args:
        agent: the :class:`~torchwire._agent.agent.RpcAgent` (its names, health, pool,
            server, state; ``peer_lost`` when a link tells of a lost peer).
        listener: the listening sockets, whose accepted connections come here.
        job: the job's key (``JobAuth``), proved by every handshake.
        options: the agent's options (transports, channels, lanes).
    """

    def __init__(self, agent, listener, job, options) -> None:
        self._agent = agent
        self.listener = listener
        self.job = job
        self._lock = threading.Lock()
        self._out: dict[int, _Link] = {}
        self.incoming: set = set()
        self.lanes_out: list[Connection] = []
        self._retired: weakref.WeakSet = weakref.WeakSet()
        self._lanes = LaneRegistry()
        self._use_lanes = bool(getattr(options, "_tcp_lanes", True))
        self._use_cma = channel_allowed(options, "cma")
        self._use_shm = channel_allowed(options, "shm") and segments.available()
        if self._use_shm:
            segments.prepare()
        self._threshold = getattr(options, "_channel_threshold", None)
        transports = getattr(options, "_transports", None)
        # torch's names: "shm" is its same-host transport, "uv" its TCP one.
        self._use_unix = transports is None or bool({"uds", "unix", "shm"} & set(transports))

    def __repr__(self) -> str:
        out = sum(o.conn is not None for o in self._out.values())
        return f"<Links out={out} in={len(self.incoming)} lanes={len(self.lanes_out)}>"

    def start(self) -> None:
        self.listener.set_handler(self.on_accept)

    # ------------------------------------------------------------------ outgoing

    def state(self, rank: int) -> LinkState:
        """The state of the link to ``rank`` (the module docstring's machine)."""
        health = self._agent.health
        if health.state(rank) is PeerState.DEAD:
            return LinkState.DEAD
        link = self._out.get(rank)
        phase = link.phase if link is not None else LinkState.IDLE
        if health.is_down(rank) and phase not in (LinkState.CONNECTING,
                                                  LinkState.AUTHENTICATING):
            return LinkState.DOWN
        return phase

    def suspect(self, conn, late: bool) -> None:
        """Monitor thread: the connection we opened to a peer fell silent (``late``)
        or spoke again."""
        link = self._out.get(conn.peer_rank)
        if link is not None and link.conn is conn:
            if late and link.phase is LinkState.UP:
                link.phase = LinkState.SUSPECT
            elif not late and link.phase is LinkState.SUSPECT:
                link.phase = LinkState.UP

    def connection_to(self, rank: int, deadline: float | None = None):
        """The connection requests to ``rank`` go on, made on first use.

        Args:
            deadline: the caller's (``time.monotonic()``); None: none of its own (an
                attempt is bounded by ``handshake_timeout``).

        Raises:
            WorkerUnavailableError: the peer is dead, gone, or cannot be reached now.
            RpcTimeoutError: ``deadline`` passed while connecting.
            RpcStateError: the agent is shut down.
        """
        out = self._out.get(rank)
        if out is not None:
            conn = out.conn
            if conn is not None and not conn.closed:
                return conn
        return self._dial(rank, deadline)

    def _dial(self, rank: int, deadline: float | None):
        agent = self._agent
        member = agent.names.member(rank)
        if member is None:  # it left a dynamic group (a static one checks ranks before)
            raise agent.names.gone_error(rank)
        agent.health.gate(rank, deadline)  # dead: fails at once; down: after the backoff
        with self._lock:
            out = self._out.get(rank)
            if out is None:
                out = self._out[rank] = _Link()
        if not _acquire(out.lock, deadline):
            raise RpcTimeoutError(f"still connecting to {agent.name_of(rank)} (another call "
                                  "is making the connection)")
        try:
            conn = out.conn
            if conn is not None and not conn.closed:
                return conn
            if agent.state is AgentState.CLOSED:
                raise RpcStateError("RPC agent is shut down")
            if rank == agent.rank:
                conn = LoopbackConnection(agent.server.on_frames, rank)
            else:
                agent.health.gate(rank, deadline)  # the dial we waited for may have failed
                conn = self._attempt(out, member, deadline)
            out.conn = conn
            out.phase = LinkState.UP
        finally:
            out.lock.release()
        return conn

    def _attempt(self, out: _Link, member, deadline: float | None) -> Connection:
        """One attempt to reach ``member``, under ``out.lock``: its outcome moves the
        link (and the peer's health) as the state machine says."""
        agent = self._agent
        rank = member.info.id
        out.phase = LinkState.CONNECTING
        try:
            conn = self._connect(member, deadline=deadline, link=out)
        except WorkerUnavailableError as exc:
            out.phase = LinkState.IDLE
            why, dead = agent.health.connect_failed(rank, exc)
            if agent.names.member(rank) is not member:  # it restarted meanwhile
                raise agent.unavailable(rank, f"it restarted while this call connected "
                                              f"to its old process: {why}") from exc.__cause__
            agent.peer_lost(rank, why, dead, member)
            agent.health.attempt_failed(rank)
            raise agent.unavailable(rank, why) from exc.__cause__
        except BaseException:
            out.phase = LinkState.IDLE
            raise
        agent.health.mark_up(rank)
        return conn

    def reconnect(self, rank: int) -> None:
        """Monitor thread: try to reach a DOWN peer in the background (skipped while a
        call is connecting to it).

        Raises:
            WorkerUnavailableError: it is still out of reach.
        """
        agent = self._agent
        member = agent.names.member(rank)
        if member is None:
            return  # it left the group
        with self._lock:
            out = self._out.setdefault(rank, _Link())
        if not out.lock.acquire(blocking=False):
            return  # a call is trying: that attempt counts
        try:
            if agent.state is AgentState.CLOSED:
                return
            if out.conn is None or out.conn.closed:
                # short, so that it never keeps a call made after a heal waiting
                out.conn = self._attempt(out, member, time.monotonic() + _BACKGROUND_ATTEMPT)
                out.phase = LinkState.UP
            else:
                agent.health.mark_up(rank)
        finally:
            out.lock.release()

    def _connect(self, member, lane: bool = False, deadline: float | None = None,
                 link: _Link | None = None) -> Connection:
        """Dial ``member`` and run the handshake: a new, started connection.  The
        attempt ends at ``deadline`` or after ``handshake_timeout``, whichever is first.

        Raises:
            WorkerUnavailableError: it cannot be reached, or the handshake failed.
            RpcTimeoutError: ``deadline`` (sooner than the attempt's own) passed.
        """
        agent = self._agent
        rec, rank = member.record, member.info.id
        own = time.monotonic() + self.job.timeout
        capped = deadline is not None and deadline <= own  # the caller's time is shorter
        limit = deadline if capped else own
        try:
            left = limit - time.monotonic()
            if left <= 0:
                raise ConnectError("no time left to connect", timed_out=True)
            if rec.host == agent.host and rec.unix and self._use_unix and not lane:
                sock = connect_unix(rec.unix, left)
                transport = "unix"
            else:
                sock = _connect_tcp(rec.tcp, limit)
                transport = "tcp"
            if link is not None:
                link.phase = LinkState.AUTHENTICATING
            try:
                sock = client_handshake(sock, agent.rank, self.job, rank,
                                        transport=transport, host=rec.tcp[0], deadline=limit)
            except BaseException:
                sock.close()
                raise
        except LinkError as exc:
            if capped and getattr(exc, "timed_out", False):
                raise RpcTimeoutError(f"could not connect to {agent.name_of(rank)} in time: "
                                      f"{exc}") from exc
            raise agent.unavailable(rank, f"cannot connect: {exc}") from exc
        except Exception as exc:  # AuthenticationError, ProtocolError
            raise agent.unavailable(rank, f"handshake failed: {exc}") from exc
        conn = self._make(sock, member, transport, initiated=True, lane=lane)
        conn.start()
        return conn

    def _make(self, sock, member, transport: str, initiated: bool,
              lane: bool = False) -> Connection:
        """The one connection factory: a connection on an authenticated socket with
        ``member``, with the channels its link allows (``ChannelSet.for_link``):
        shared memory and CMA to a same-host peer on a Unix socket, as the options and
        the peer allow; on TCP, every connection receives split buffers, and one that
        is not a lane itself splits its own over a lane it opens on first need."""
        agent = self._agent
        rec, rank = member.record, member.info.id
        open_lane = None
        if not lane and self._use_lanes:
            def open_lane():
                return self._open_lane(rank)
        channels = ChannelSet.for_link(
            transport, same_host=rec.host == agent.host, peer_cma=rec.cma, peer_shm=rec.shm,
            cma=self._use_cma, shm=self._use_shm, lanes=self._lanes, open_lane=open_lane,
            threshold=self._threshold)
        return Connection(sock, rank, agent.server.on_frames, self.on_close, channels=channels,
                          defer=agent.pool.submit, max_message_size=agent.max_message_size,
                          initiated=initiated, transport=transport, lane=lane,
                          poll_us=agent.poll_us)

    def _open_lane(self, rank: int) -> Connection:
        """A second TCP connection to ``rank`` for the second half of large buffers."""
        agent = self._agent
        if agent.state is AgentState.CLOSED:  # draining still replies: lanes welcome
            raise RpcStateError("RPC agent is shut down")
        member = agent.names.member(rank)
        if member is None:
            raise agent.names.gone_error(rank)
        # A lane opens inside a send, whose deadline the channel does not know: a
        # short bound keeps a frozen peer from holding that send (no lane: the whole
        # buffer goes on the connection).
        conn = self._connect(member, lane=True, deadline=time.monotonic() + _LANE_ATTEMPT)
        with self._lock:
            if agent.state is AgentState.CLOSED:
                conn.close()
            # under the lock on_close takes: a lane that already ended is not listed
            if not conn.closed:
                self.lanes_out.append(conn)
        return conn

    # ------------------------------------------------------------------ incoming

    def on_accept(self, sock: socket.socket, transport: str):
        """Handshake thread: authenticate the peer; returns its reader loop to run next."""
        agent = self._agent
        try:
            sock, rank = server_handshake(sock, agent.rank, self.job, agent.world_size,
                                          transport)
            member = agent.names.member(rank)
            if agent.admission is not None:
                member = agent.admission.admit(rank, member)
        except LinkError as exc:
            sock.close()
            if isinstance(exc, ConnectError):  # silent or slow until the deadline: refused
                log.warning("torchwire: %s refused a %s connection: %s", agent.name,
                            transport, exc)
            return None  # else it left: a liveness probe, or a peer that gave up
        except Exception as exc:
            log.warning("torchwire: %s refused a %s connection: %s", agent.name, transport, exc)
            sock.close()
            return None
        if member is None:  # authenticated, but not (or no longer) a member of the group
            log.warning("torchwire: %s refused a %s connection from rank %d: not a member of "
                        "the group", agent.name, transport, rank)
            sock.close()
            return None
        conn = self._make(sock, member, transport, initiated=False)
        with self._lock:
            if agent.state is AgentState.CLOSED:
                conn.close()
            self.incoming.add(conn)
        agent.health.mark_up(rank)
        return conn.read_loop

    def spawn_reader(self, read_loop) -> None:
        """Run a connection's reading on a pool thread, not counted against the core."""
        pool = self._agent.pool

        def run():
            with pool.blocking():
                read_loop()
        pool.submit(run)

    # ------------------------------------------------------------------ endings

    def on_close(self, conn, exc) -> None:
        """Reader thread, once per connection: fail what depended on it."""
        agent = self._agent
        # before it leaves the tables, so that stats() counts it once (metrics.py)
        agent.pending.metrics.link_closed(conn, lane=conn.lane)
        agent.server.inline.forget(conn)
        with self._lock:
            self.incoming.discard(conn)
            if conn in self.lanes_out:
                self.lanes_out.remove(conn)
        out = self._out.get(conn.peer_rank)
        if out is not None and out.conn is conn:
            # not under its lock: a dial may hold it while this reader must go on
            out.conn = None
            out.phase = LinkState.IDLE
        if conn.initiated:
            why = f"connection lost ({exc})" if exc is not None else "connection closed"
            if agent.state is AgentState.CLOSED:
                err: BaseException = RpcStateError("RPC agent is shut down")
            else:
                err = agent.unavailable(conn.peer_rank, why)
            agent.pending.fail_where(err, conn=conn)
        if conn in self._retired:
            return  # with a member that was dropped: it tells nothing of the rank's newcomer
        if not conn.initiated and not conn.bytes_in and not conn.heartbeats_in:
            # the peer gave up on a connection it opened before using it (a dial cut
            # short by its caller's deadline, after the handshake ended here): that says
            # nothing of the peer, and its other connections stay
            return
        if exc is not None and agent.state is AgentState.RUNNING and not conn.goodbye_received:
            log.warning("torchwire: %s lost its connection to %s: %s", agent.name,
                        agent.name_of(conn.peer_rank), exc)
        if exc is not None and not conn.goodbye_received:
            # Outside an orderly close, a lost connection means a lost peer (DESIGN.md).
            agent.peer_lost(conn.peer_rank, f"connection lost ({exc})")

    def close_peer(self, rank: int, err: BaseException) -> None:
        """Close every connection with ``rank`` (it is lost): their readers end."""
        with self._lock:
            conns = [c for c in list(self.incoming) + self.lanes_out if c.peer_rank == rank]
        out = self._out.get(rank)
        conn = out.conn if out is not None else None  # not under its lock: a dial may hold it
        if conn is not None:
            conns.append(conn)
        for c in conns:
            c.close(err)

    def retire(self, rank: int) -> None:
        """``rank`` left the group or was dropped from it: close the connections we
        opened (it closes those it opened, or they ended with its process), and make
        every connection with it say nothing more of the rank."""
        with self._lock:
            theirs = [c for c in self.incoming if c.peer_rank == rank]
            ours = [c for c in self.lanes_out if c.peer_rank == rank]
            out = self._out.pop(rank, None)
            if out is not None and out.conn is not None:  # not under its lock (a dial)
                ours.append(out.conn)
            self._retired.update(theirs + ours)
        for c in ours:
            c.send_goodbye()
            c.close()

    def open_connections(self) -> list:
        """Every socket connection, in and out, but the retired (for the heartbeat)."""
        with self._lock:
            conns = list(self.incoming)
            if self._retired:
                conns = [c for c in conns if c not in self._retired]
        return conns + [o.conn for o in list(self._out.values())
                        if isinstance(o.conn, Connection)]

    def all(self) -> list:
        """Every socket connection, in and out (for ``stats``)."""
        with self._lock:
            conns = list(self.incoming)
        return conns + [o.conn for o in list(self._out.values())
                        if isinstance(o.conn, Connection)]

    def close_all(self, mark_closed) -> None:
        """Shutdown: ``mark_closed()`` (the agent's state: under the lock ``on_accept``
        takes, so no connection is accepted after this), then say GOODBYE on every
        connection, close it, and wait for its reader."""
        with self._lock:
            mark_closed()
            conns = list(self.incoming) + self.lanes_out
        self.listener.close()
        for out in list(self._out.values()):
            with out.lock:
                if out.conn is not None:
                    conns.append(out.conn)
                    out.conn = None
        for c in conns:
            c.send_goodbye()
            c.close()
        for c in conns:
            c.join(2.0)
        segments.clear()  # released segments; leased ones close when their mappings go


def _acquire(lock: threading.Lock, deadline: float | None) -> bool:
    """Take ``lock`` before ``deadline`` (None: as long as it takes)."""
    if deadline is None:
        return lock.acquire()
    return lock.acquire(timeout=max(0.0, deadline - time.monotonic()))


def _connect_tcp(address, limit: float) -> socket.socket:
    """A TCP connection made before ``limit``, by tries of ``_CONNECT_TRY`` seconds.

    The kernel resends a SYN lost in a cut only after 1, 3, 7 ... s, and after a cut
    it may answer the first try with "no route to host" from what it learnt while
    the link was down: new tries find a healed link within a second.  Only a refusal
    (nothing listens: the process is gone) ends the tries early.

    Raises:
        ConnectError: refused, or ``limit`` passed (``timed_out``; naming the last
            error seen).
    """
    last = None
    while True:
        left = limit - time.monotonic()
        if left <= 0:
            why = f" (last try: {last})" if last is not None else ""
            raise ConnectError(f"connecting to {address[0]}:{address[1]} timed out{why}",
                               timed_out=True)
        try:
            return connect_tcp(address, min(left, _CONNECT_TRY))
        except ConnectError as exc:
            if exc.refused:
                raise
            last = exc
            if not exc.timed_out:  # failed at once: unreachable, reset; pause a little
                time.sleep(min(_UNREACHABLE_PAUSE, max(0.0, limit - time.monotonic())))
