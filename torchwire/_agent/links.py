"""Links: the agent's connections to its peers, and their lifecycle.

Every worker listens on TCP and on an abstract Unix socket.  A connection is made
on first use: a Unix socket when the peer's host identity (boot id + network
namespace) equals ours, TCP otherwise.  Each side sends its requests on the
connection it opened (``_Out``) and replies on the connection a request arrived on
(``incoming``), so two workers calling each other at once never race to share one
socket.  A TCP connection may open a second one, a *lane*, for the second half of
large buffers.  Every connection, dialled or accepted, is made by one factory
(:meth:`Links._make`), which also chooses its channels.

One outgoing link::

    NONE  --first call: dial, handshake-->  OPEN  --closed or lost-->  NONE
    NONE  --dial or handshake failed-->  NONE (the peer is marked down: calls fail fast)
    (a DOWN peer is redialled by the liveness thread only: ``reconnect``)

A connection that ends without the peer's GOODBYE means the peer is lost
(``RpcAgent.peer_lost``).  Connections with a member that was dropped from a
dynamic group are *retired*: their end says nothing about a newcomer that took the
rank.
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref

import torch

from .._base.errors import ConnectError, LinkError, RpcStateError, WorkerUnavailableError
from .._base.options import channel_allowed
from .._wire.auth import client_handshake, server_handshake
from .._wire.channels import segments
from .._wire.channels.lanes import LaneRegistry
from .._wire.channels.link import ChannelSet
from .._wire.connection import Connection
from .._wire.listener import connect_tcp, connect_unix
from .state import AgentState

log = logging.getLogger("torchwire")


class _Out:
    """The connection this worker opened to one peer (``conn``), and the lock its
    dialling holds."""

    __slots__ = ("lock", "conn")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn = None


class LoopbackConnection:
    """Calls to oneself: same serialization (copy semantics), no socket."""

    transport = "loopback"
    initiated = True
    closed = False

    def __init__(self, on_frames, rank: int) -> None:
        self._on_frames = on_frames
        self.peer_rank = rank

    def __repr__(self) -> str:
        return f"<LoopbackConnection rank={self.peer_rank}>"

    def send_frame(self, kind, flags, request_id, payload, tensors=()) -> None:
        copies = [t.reshape(-1).view(torch.uint8).clone() if t.numel() else
                  torch.empty(0, dtype=torch.uint8) for t in tensors]
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
        self._out: dict[int, _Out] = {}
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

    def connection_to(self, rank: int):
        """The connection requests to ``rank`` go on, made on first use.

        Raises:
            WorkerUnavailableError: the peer is down, gone, or cannot be reached now.
            RpcStateError: the agent is shut down.
        """
        out = self._out.get(rank)
        if out is not None:
            conn = out.conn
            if conn is not None and not conn.closed:
                return conn
        return self._dial(rank)

    def _dial(self, rank: int):
        agent = self._agent
        member = agent.names.member(rank)
        if member is None:  # it left a dynamic group (a static one checks ranks before)
            raise agent.names.gone_error(rank)
        agent.health.check(rank)  # a peer known to be down fails at once, unlocked
        with self._lock:
            out = self._out.get(rank)
            if out is None:
                out = self._out[rank] = _Out()
        with out.lock:
            conn = out.conn
            if conn is not None and not conn.closed:
                return conn
            if agent.state is AgentState.CLOSED:
                raise RpcStateError("RPC agent is shut down")
            if rank == agent.rank:
                conn = LoopbackConnection(agent.server.on_frames, rank)
            else:
                agent.health.check(rank)
                try:
                    conn = self._connect(member)
                except WorkerUnavailableError as exc:
                    agent.peer_lost(rank, *agent.health.connect_failed(rank, exc))
                    raise
            out.conn = conn
        return conn

    def reconnect(self, rank: int) -> None:
        """Liveness thread: try to reach a peer that is down again.

        Raises:
            WorkerUnavailableError: it is still out of reach.
        """
        agent = self._agent
        member = agent.names.member(rank)
        if member is None:
            return  # it left the group
        with self._lock:
            out = self._out.setdefault(rank, _Out())
        with out.lock:  # callers do not wait on it: they see the peer down first
            if agent.state is AgentState.CLOSED:
                return
            if out.conn is None or out.conn.closed:
                out.conn = self._connect(member)
        agent.health.mark_up(rank)

    def _connect(self, member, lane: bool = False) -> Connection:
        """Dial ``member`` and run the handshake: a new, started connection.

        Raises:
            WorkerUnavailableError: it cannot be reached, or the handshake failed.
        """
        agent = self._agent
        rec, rank = member.record, member.info.id
        timeout = min(agent.rpc_timeout, 30.0) if agent.rpc_timeout > 0 else 30.0
        try:
            if rec.host == agent.host and rec.unix and self._use_unix and not lane:
                sock = connect_unix(rec.unix, timeout)
                transport = "unix"
            else:
                sock = connect_tcp(rec.tcp, timeout)
                transport = "tcp"
            try:
                sock = client_handshake(sock, agent.rank, self.job, rank,
                                        transport=transport, host=rec.tcp[0])
            except BaseException:
                sock.close()
                raise
        except LinkError as exc:
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
                          initiated=initiated, transport=transport)

    def _open_lane(self, rank: int) -> Connection:
        """A second TCP connection to ``rank`` for the second half of large buffers."""
        agent = self._agent
        if agent.state is AgentState.CLOSED:  # draining still replies: lanes welcome
            raise RpcStateError("RPC agent is shut down")
        member = agent.names.member(rank)
        if member is None:
            raise agent.names.gone_error(rank)
        conn = self._connect(member, lane=True)
        with self._lock:
            if agent.state is AgentState.CLOSED:
                conn.close()
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
            if agent.membership is not None:
                member = agent.membership.admit(rank, member)
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
        agent.server.inline.forget(conn)
        with self._lock:
            self.incoming.discard(conn)
            if conn in self.lanes_out:
                self.lanes_out.remove(conn)
        out = self._out.get(conn.peer_rank)
        if out is not None and out.conn is conn:
            with out.lock:
                if out.conn is conn:
                    out.conn = None
        if conn.initiated:
            why = f"connection lost ({exc})" if exc is not None else "connection closed"
            if agent.state is AgentState.CLOSED:
                err: BaseException = RpcStateError("RPC agent is shut down")
            else:
                err = agent.unavailable(conn.peer_rank, why)
            agent.pending.fail_where(err, conn=conn)
        if conn in self._retired:
            return  # with a member that was dropped: it tells nothing of the rank's newcomer
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
