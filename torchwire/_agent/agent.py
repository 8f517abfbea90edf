"""The RPC agent: one per process.

It owns the name table, the connections (made on first use), the table of
pending calls (request id -> future and deadline), the one timer for every
deadline, the pool that runs user functions, and shutdown.  The public
``torchwire.rpc`` functions validate their arguments and call it.

Threads:
    * reader (one per connection, I/O): decodes frames, completes response
      futures, queues requests on the pool.  Never runs user code.
    * timer (I/O): fails calls whose deadline passed.
    * pool (``num_worker_threads`` core threads): runs user functions,
      ``async_execution`` completions and future callbacks.
    * accept (one per listening socket) + one short-lived handshake thread per
      accepted connection (authentication: ``_wire/auth.py``), which then becomes
      that connection's reader.
    * liveness (``_liveness.py``): the heartbeat on idle connections, and
      reconnection of peers that were cut off.  Never blocks on a write.

Graceful shutdown (store-based termination detection)::

    DRAINING:  round r = 0, 1, ...
                 wait until this worker has no pending outgoing call
                 publish "sd/<r>/<rank>" = requests sent, requests received
                   (and, once some worker is down, the counts per peer)
                 wait for every rank's round-r record, except from ranks that
                   are gone (down, found dead, or already left)
                 stop when totals balance (sent == received) and equal the
                 previous round's: no request is in flight or being served
                 (with ranks gone: per pair of workers that reach each other)
    EXIT:      set "sd/exit/<rank>"; rank 0 (which may host the store) waits
               until every rank that is not gone has, then all close their sockets.

In a dynamic group (``world_size`` None, ``_membership.py``) graceful shutdown is
leaving the group instead, and the name table changes while the agent runs
(``add_member``, ``remove_member``): it is replaced, never changed in place, so a
reader iterates a consistent copy without a lock.

Failures (DESIGN.md, "Failure model"): a connection lost outside an orderly
close, a connection that cannot be made or a silent heartbeat marks the peer
down (``_peer_lost``): calls pending on it fail with ``WorkerUnavailableError``
naming it, new calls to it fail at once, plugins hear ``peer_lost``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import sys
import threading
import time
import traceback
import weakref

import torch

from .._base import devices as _devices, intraop as _intraop, threads as _threads
from .. import _serialization as ser
from .._base.errors import (ConnectError, LinkError, ProtocolError, RpcStateError,
                             RpcTimeoutError, SerializationError, WorkerUnavailableError)
from .future import Deferred, Future, SyncReply
from .inline import InlineScheduler
from .liveness import PeerHealth
from .plugins import AgentPlugin
from .state import AgentState
from .pool import WorkerPool
from .timer import DeadlineTimer
from .._wire.channels import segments
from .._wire.channels.lanes import LaneRegistry
from .._wire.channels.link import ChannelSet
from .._wire import frame as F
from .._wire.auth import JobAuth, client_handshake, server_handshake
from .._wire.connection import Connection
from .._wire.listener import (Listener, connect_tcp, connect_unix, host_identity,
                              listener_alive)
from .._base.worker_info import WorkerInfo
from .._base.options import (DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT,
                             channel_allowed)

log = logging.getLogger("torchwire")

_LIVENESS_PERIOD = 1.0  # seconds between liveness checks while shutdown waits
_INLINE_MAX = 4  # a reader runs a batch of at most this many requests itself


class _Peer:
    __slots__ = ("info", "record", "lock", "out")

    def __init__(self, info: WorkerInfo, record: dict) -> None:
        self.info = info
        self.record = record
        self.lock = threading.Lock()
        self.out = None


class LoopbackConnection:
    """Calls to oneself: same serialization (copy semantics), no socket."""

    transport = "loopback"
    initiated = True
    closed = False

    def __init__(self, agent: RpcAgent, rank: int) -> None:
        self._agent = agent
        self.peer_rank = rank

    def __repr__(self) -> str:
        return f"<LoopbackConnection rank={self.peer_rank}>"

    def send_frame(self, kind, flags, request_id, payload, tensors=()) -> None:
        copies = [t.reshape(-1).view(torch.uint8).clone() if t.numel() else
                  torch.empty(0, dtype=torch.uint8) for t in tensors]
        self._agent._on_frames(self, [(kind, flags, request_id, payload, copies)])

    def close(self, reason=None) -> None:
        pass

    def send_goodbye(self) -> None:
        pass

    def join(self, timeout) -> None:
        pass


class RpcAgent:
    """The per-process RPC runtime (see the module docstring)."""

    def __init__(self, name: str, rank: int, world_size: int | None, options, store,
                 store_host: str | None, listener: Listener, records: list[dict],
                 job: JobAuth) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size  # None: a dynamic group (membership changes)
        self.options = options
        self.store = store
        self._listener = listener
        self._job = job
        self._host = host_identity()
        self.rpc_timeout = float(options.rpc_timeout)
        self.max_message_size = int(getattr(options, "max_message_size",
                                            F.DEFAULT_MAX_MESSAGE_SIZE))
        self.state = AgentState.RUNNING
        self.info = WorkerInfo(name, rank)
        # rank -> _Peer and name -> WorkerInfo; replaced whole when members change
        self._peers: dict[int, _Peer] = {}
        self._by_name: dict[str, WorkerInfo] = {}
        for r in records:
            info = WorkerInfo(r["name"], r["rank"])
            self._peers[info.id] = _Peer(info, r)
            self._by_name[info.name] = info
        self._share_host()
        # dynamic groups: members that left or were found gone, and why (for errors)
        self._departed: dict[int, tuple[WorkerInfo, str]] = {}
        self._departed_names: dict[str, tuple[WorkerInfo, str]] = {}
        self._members_lock = threading.Lock()  # serializes changes of the name table
        # connections with members that were dropped: their end says nothing about a
        # newcomer that took the rank
        self._retired: weakref.WeakSet = weakref.WeakSet()
        self.membership = None  # a dynamic group's _membership.Membership
        self._pending: dict[int, tuple] = {}
        self._rids = itertools.count(1)
        self._stats_lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self._replies_in_place = 0
        self._replies_sent = 0
        # per peer, for termination detection without the peers that are gone
        if world_size is None:  # only counted: a dynamic group has no termination rounds
            self._sent_to = collections.defaultdict(int)
            self._recv_from = collections.defaultdict(int)
        else:
            self._sent_to = [0] * world_size
            self._recv_from = [0] * world_size
        self._idle = threading.Condition(threading.Lock())
        self._draining = False
        self._incoming: set = set()
        self._plugins: list = []
        self._conn_lock = threading.Lock()
        self._pool = WorkerPool(options.num_worker_threads, name=f"torchwire-{name}")
        self._inline = InlineScheduler(self._pool.submit, self._spawn_reader)
        self._timer = DeadlineTimer(self._expire)
        self._health = PeerHealth(
            self, getattr(options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL),
            getattr(options, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT))
        self._desc = repr(self.info)
        self._use_cma = channel_allowed(options, "cma")
        self._use_shm = channel_allowed(options, "shm") and segments.available()
        if self._use_shm:
            segments.prepare()
        self._lanes = LaneRegistry()
        self._lanes_out: list[Connection] = []
        self._use_lanes = bool(getattr(options, "_tcp_lanes", True))
        self._channel_min = getattr(options, "_channel_threshold", None)
        transports = getattr(options, "_transports", None)
        # torch's names: "shm" is its same-host transport, "uv" its TCP one.
        self._use_unix = transports is None or bool({"uds", "unix", "shm"} & set(transports))

    def __repr__(self) -> str:
        peers = self._peers.values()
        world = self.world_size if self.world_size is not None else f"dynamic({len(peers)})"
        return (f"<RpcAgent {self.name} rank={self.rank}/{world} "
                f"state={self.state.value} pending={len(self._pending)} "
                f"connections={len(self._incoming) + sum(p.out is not None for p in peers)}>")

    def stats(self) -> dict:
        """Counters for monitoring and the demo: calls and bytes, per direction."""
        with self._conn_lock:
            conns = list(self._incoming)
        conns += [p.out for p in self._peers.values() if isinstance(p.out, Connection)]
        return {
            "name": self.name,
            "calls_sent": self._sent,
            "calls_served": self._received,
            "pending": len(self._pending),
            "replies_sent": self._replies_sent,
            # replies an I/O thread wrote itself, without a pool hop (see _reply_nowait)
            "replies_in_place": self._replies_in_place,
            "connections": len(conns),
            "bytes_out": sum(c.bytes_out for c in conns),
            "bytes_in": sum(c.bytes_in for c in conns),
            "transports": sorted({c.transport for c in conns}),
            "channels": sorted({"shm" if c.channels.sends("shm") else "cma"
                                if c.channels.sends("cma") else "socket" for c in conns}),
            "shm": segments.stats(),
        }

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        self._listener.set_handler(self._on_accept)
        self._health.start()

    def add_plugin(self, plugin) -> None:
        """Attach a layer above the agent (``runtime.AgentPlugin``: the RRef context,
        the autograd container) to shutdown and to the news of lost peers.

        Raises:
            TypeError: ``plugin`` does not implement ``AgentPlugin``.
        """
        if not isinstance(plugin, AgentPlugin):
            raise TypeError(f"{type(plugin).__name__} is not an AgentPlugin")
        self._plugins.append(plugin)

    def set_membership(self, membership) -> None:
        """A dynamic group's membership (``runtime.GroupMembership``): it admits the
        connections of newcomers, and graceful shutdown leaves the group through it."""
        self.membership = membership

    @property
    def closed(self) -> bool:
        return self.state is AgentState.CLOSED

    def defer(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the pool (off an I/O thread).

        Raises:
            RpcStateError: the pool is shut down.
        """
        self._pool.submit(fn, *args)

    # ------------------------------------------------------------------ name table

    def get_worker_info(self, to=None) -> WorkerInfo:
        """Raises:
            UnknownWorkerError: no member has that name, rank or WorkerInfo.
            WorkerUnavailableError: (dynamic groups) it names a member that left.
        """
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            peer = self._peers.get(to.id)
            if peer is None or peer.info != to:
                gone = self._departed.get(to.id)
                raise self._not_member(repr(to), gone if gone and gone[0] == to else None)
            return peer.info
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is None:
                raise self._not_member(to, self._departed_names.get(to))
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            peer = self._peers.get(to)
            if peer is None:
                raise self._not_member(f"rank {to}", self._departed.get(to))
            return peer.info
        raise ValueError(f"Cannot get WorkerInfo from {to!r}: pass a worker name, rank or "
                         "WorkerInfo")

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every member, this worker included, by rank (a dynamic group: as of now)."""
        return sorted(p.info for p in self._peers.values())

    def _not_member(self, what: str, gone: tuple[WorkerInfo, str] | None):
        if gone is None:
            return _unknown(what)
        return self._unavailable(gone[0].id, gone[1])

    def _name_of(self, rank: int) -> str:
        """The name of ``rank``, a member or one that left (for messages)."""
        peer = self._peers.get(rank)
        if peer is not None:
            return peer.info.name
        gone = self._departed.get(rank)
        return gone[0].name if gone is not None else f"<rank {rank}>"

    def _gone_error(self, rank: int) -> WorkerUnavailableError:
        gone = self._departed.get(rank)
        return self._unavailable(rank, gone[1] if gone else "it is not a member of the group")

    # ------------------------------------------------------------------ membership

    def add_member(self, record: dict) -> _Peer:
        """A dynamic group gained a member (it joined, or a connection from it arrived
        first).  A different worker known under its rank or name died without
        leaving (the group gave them to the newcomer): it is dropped first.

        Returns:
            its ``_Peer``.
        """
        info = WorkerInfo(record["name"], record["rank"])
        while True:
            with self._members_lock:
                old = self._peers.get(info.id)
                if old is not None and old.record == record:
                    return old
                named = self._by_name.get(info.name)
                if old is None and named is not None:
                    old = self._peers.get(named.id)
                if old is None:
                    peer = _Peer(info, record)
                    self._peers = {**self._peers, info.id: peer}
                    self._by_name = {**self._by_name, info.name: info}
                    self._departed.pop(info.id, None)
                    self._departed_names.pop(info.name, None)
                    break
            self._drop_member(old, "another worker joined with its rank or name (it is gone)")
        self._health.forget(info.id)
        self._update_router()
        return peer

    def remove_member(self, rank: int, deadline: float, why: str) -> None:
        """A dynamic group lost member ``rank`` (``why``: it left, or it is gone).

        New calls to it fail at once; calls already sent to it are waited for until
        ``deadline`` (a leaving member still serves them); what is left then fails
        with a ``WorkerUnavailableError`` naming it and ``why``.
        """
        peer = self._peers.get(rank)
        if peer is not None and rank != self.rank:
            self._drop_member(peer, why, deadline)

    def _drop_member(self, peer: _Peer, why: str, deadline: float | None = None) -> None:
        rank = peer.info.id
        with self._members_lock:
            if self._peers.get(rank) is not peer:
                return
            self._peers = {r: p for r, p in self._peers.items() if r != rank}
            self._by_name = {n: i for n, i in self._by_name.items() if i.id != rank}
            self._departed[rank] = self._departed_names[peer.info.name] = (peer.info, why)
        if deadline is not None:
            delay = 0.001
            in_pool = _threads.current_pool() is self._pool
            with self._pool.blocking() if in_pool else contextlib.nullcontext():
                while any(e[2] == rank for e in list(self._pending.values())) \
                        and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
        err = self._unavailable(rank, why)
        for rid in [rid for rid, e in list(self._pending.items()) if e[2] == rank]:
            self._fail(rid, err)
        # Ours close now; the member closes those it opened (a leaving one still
        # replies on them), or they ended with its process.
        with self._conn_lock:
            theirs = [c for c in self._incoming if c.peer_rank == rank]
            ours = [c for c in self._lanes_out if c.peer_rank == rank]
            out = peer.out  # not under peer.lock: a connect may hold it
            if out is not None:
                ours.append(out)
            self._retired.update(theirs + ours)
        for c in ours:
            c.send_goodbye()
            c.close()
        self._health.forget(rank)
        self._update_router()
        for p in self._plugins:  # here, not on the pool: before the rank can be reused
            try:
                p.peer_lost(rank, err)
            except Exception:
                log.exception("torchwire: %r could not forget rank %d", p, rank)

    def _update_router(self) -> None:
        """Device maps of a dynamic group: route to the members of now; and the
        intra-op threads of torchwire's own passes (their share of this host)."""
        router = _devices.Router(self.name, [p.record for p in self._peers.values()])
        ser.hooks.set_device_router(router.target if router else None)
        self._share_host()

    def _share_host(self) -> None:
        local = sum(1 for p in self._peers.values() if p.record.get("host") == self._host)
        _intraop.set_local_workers(max(1, local))

    # ------------------------------------------------------------------ calls

    def call(self, to: WorkerInfo, func, args, kwargs, timeout: float, pin=None,
             sync: bool = False) -> Future:
        """Send a request; returns the future of its reply.

        ``pin``: an object kept alive until the reply arrives (or the call fails).
        ``sync``: the caller waits for the reply at once: a :class:`SyncReply` instead
        of a future (only ``wait()`` and ``done()``).

        Raises (on the caller, before anything is sent):
            RpcStateError: the agent is shut down.
            SerializationError: the call cannot be pickled.
        """
        if self.state is AgentState.CLOSED:
            raise RpcStateError("RPC agent is shut down; call torchwire.rpc.init_rpc first")
        peer = to.id
        plain = ser.plain_call(func, args, kwargs, peer)
        if plain is None:
            flags = 0
            payload, tensors, sent = ser.dumps_to((func, args, kwargs), peer, True)
        else:
            flags = F.F_PLAIN
            payload, tensors, sent = plain
        size = len(payload)
        for t in tensors:
            size += t.nbytes
        if size > self.max_message_size:
            if sent is not None:
                sent.abort()
            raise SerializationError(
                f"message of {len(payload)} bytes + tensors exceeds max_message_size "
                f"{self.max_message_size}")
        fut = SyncReply() if sync else Future()
        rid = next(self._rids)
        try:
            conn = self._connection_to(peer)
        except (WorkerUnavailableError, RpcStateError) as exc:
            if sent is not None:
                sent.abort()
            fut.set_exception(exc)
            return fut
        tick = None
        if timeout > 0:
            tick = self._timer.add(rid, time.monotonic() + timeout)
        # ``sent`` rides along: it pins what must stay alive until the reply (RRefs)
        self._pending[rid] = (fut, tick, peer, conn, timeout, func,
                              sent if pin is None else (sent, pin))
        try:
            conn.send_frame(F.K_REQUEST, flags, rid, payload, tensors)
        except LinkError as exc:
            if sent is not None:
                sent.abort()
            self._fail(rid, self._unavailable(peer, f"connection lost: {exc}"))
            return fut
        with self._stats_lock:
            self._sent += 1
            self._sent_to[peer] += 1
        return fut

    def notify(self, to: WorkerInfo, func, args) -> None:
        """Send a one-way request (request id 0): ``func(*args)`` runs there, no reply.

        For internal control messages whose loss can only mean the peer is gone.

        Raises:
            RpcStateError, WorkerUnavailableError, LinkError, SerializationError: it
            could not be sent.
        """
        if self.state is AgentState.CLOSED:
            raise RpcStateError("RPC agent is shut down")
        payload, tensors, sent = ser.dumps_to((func, args, None), to.id, False)
        try:
            self._connection_to(to.id).send_frame(F.K_REQUEST, 0, 0, payload, tensors)
        except BaseException:
            if sent is not None:
                sent.abort()
            raise
        with self._stats_lock:
            self._sent += 1
            self._sent_to[to.id] += 1

    def notify_plain(self, rank: int, payload: bytes, tensors=()) -> None:
        """Send an internal one-way message that is not pickled: ``payload[0]`` picks
        the receiver's handler in ``_serialization.PLAIN_HANDLERS``, which decodes the rest
        itself; ``tensors`` (contiguous CPU tensors) travel as a request's buffers.
        What a pickle costs both sides (~20 µs each with the caches cold, as between
        messages), for the distributed backward pass's frequent small messages.

        Raises:
            RpcStateError, WorkerUnavailableError, LinkError: not sent.
        """
        if self.state is AgentState.CLOSED:
            raise RpcStateError("RPC agent is shut down")
        self._connection_to(rank).send_frame(F.K_REQUEST, F.F_PLAIN, 0, payload, tensors)
        with self._stats_lock:
            self._sent += 1
            self._sent_to[rank] += 1

    def _serve_plain(self, conn, rid: int, payload, tensors) -> None:
        """A PLAIN request: a call (``ser.plain_call``), run and replied as any; or an
        internal one-way message, to its handler on this thread (a failure can only be
        logged: the handlers report their own errors to whoever waits)."""
        if rid != 0:  # a call (ser.plain_call)
            try:
                if not payload or payload[0] != ser.PlainKind.CALL:
                    raise ProtocolError("malformed plain request")
                func, args, kwargs = ser.plain_call_decode(payload, tensors)
            except Exception as exc:
                self._reply_error(conn, rid, exc, "")
                return
            del payload, tensors
            self._run(conn, rid, func, args, kwargs)
            return
        try:
            if not payload:
                raise ProtocolError("empty internal message")
            handler = ser.hooks.plain_handler(payload[0])
            if handler is None:
                raise ProtocolError(f"unknown internal message kind {payload[0]}")
            handler(conn.peer_rank, payload, tensors)
        except Exception:
            log.exception("torchwire: internal message from %s failed",
                          self._name_of(conn.peer_rank))

    def _connection_to(self, rank: int):
        peer = self._peers.get(rank)
        if peer is None:  # it left a dynamic group (a static one checks ranks before)
            raise self._gone_error(rank)
        conn = peer.out
        if conn is not None and not conn.closed:
            return conn
        self._health.check(rank)  # a peer known to be down fails at once, unlocked
        with peer.lock:
            conn = peer.out
            if conn is not None and not conn.closed:
                return conn
            if self.state is AgentState.CLOSED:
                raise RpcStateError("RPC agent is shut down")
            if rank == self.rank:
                conn = LoopbackConnection(self, rank)
            else:
                self._health.check(rank)
                try:
                    conn = self._connect(peer)
                except WorkerUnavailableError as exc:
                    self._peer_lost(rank, *self._health.connect_failed(rank, exc))
                    raise
            peer.out = conn
        return conn

    def _reconnect(self, rank: int) -> None:
        """Liveness thread: try to reach a peer that is down again (see _liveness.py).

        Raises:
            WorkerUnavailableError: it is still out of reach.
        """
        peer = self._peers.get(rank)
        if peer is None:
            return  # it left the group
        with peer.lock:  # callers do not wait on it: they see the peer down first
            if self.state is AgentState.CLOSED:
                return
            if peer.out is None or peer.out.closed:
                peer.out = self._connect(peer)
        self._health.mark_up(rank)

    def _connect(self, peer: _Peer, lane: bool = False) -> Connection:
        rec = peer.record
        timeout = min(self.rpc_timeout, 30.0) if self.rpc_timeout > 0 else 30.0
        try:
            if rec.get("host") == self._host and rec.get("unix") and self._use_unix \
                    and not lane:
                sock = connect_unix(rec["unix"], timeout)
                transport = "unix"
            else:
                sock = connect_tcp(rec["tcp"], timeout)
                transport = "tcp"
            try:
                sock = client_handshake(sock, self.rank, self._job, peer.info.id,
                                        transport=transport, host=rec["tcp"][0])
            except BaseException:
                sock.close()
                raise
        except LinkError as exc:
            raise self._unavailable(peer.info.id, f"cannot connect: {exc}") from exc
        except Exception as exc:  # AuthenticationError, ProtocolError
            raise self._unavailable(peer.info.id, f"handshake failed: {exc}") from exc
        conn = Connection(sock, peer.info.id, self._on_frames, self._on_close,
                          channels=self._channels(peer, transport, lane),
                          defer=self._pool.submit, max_message_size=self.max_message_size,
                          initiated=True, transport=transport)
        conn.start()
        return conn

    def _channels(self, peer: _Peer, transport: str, lane: bool = False) -> ChannelSet:
        """How large buffers travel on a new connection with ``peer`` (see
        ``_wire/channels/link.py``): shared memory and CMA to a same-host peer on a
        Unix socket, as the options and the peer allow; on TCP, every connection
        receives split buffers, and one that is not a lane itself splits its own over
        a lane it opens on first need."""
        rank = peer.info.id
        return ChannelSet.for_link(
            transport, same_host=peer.record.get("host") == self._host, peer=peer.record,
            cma=self._use_cma, shm=self._use_shm, lanes=self._lanes,
            open_lane=None if lane or not self._use_lanes else lambda: self._open_lane(rank),
            threshold=self._channel_min)

    def _open_lane(self, rank: int) -> Connection:
        """A second TCP connection to ``rank`` for the second half of large buffers."""
        if self.state is AgentState.CLOSED:  # draining still replies: lanes welcome
            raise RpcStateError("RPC agent is shut down")
        peer = self._peers.get(rank)
        if peer is None:
            raise self._gone_error(rank)
        conn = self._connect(peer, lane=True)
        with self._conn_lock:
            if self.state is AgentState.CLOSED:
                conn.close()
            self._lanes_out.append(conn)
        return conn

    def _spawn_reader(self, read_loop) -> None:
        """Run a connection's reading on a pool thread, not counted against the core."""
        def run():
            with self._pool.blocking():
                read_loop()
        self._pool.submit(run)

    def _unavailable(self, rank: int, why: str) -> WorkerUnavailableError:
        name = self._name_of(rank)
        return WorkerUnavailableError(f"worker {name} (rank {rank}) is unavailable: {why}",
                                      worker_name=name)

    def _fail(self, rid: int, exc: BaseException) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        if entry[1] is not None:
            self._timer.cancel(rid, entry[1])
        entry[0].set_exception(exc)
        self._note_idle()

    def _note_idle(self) -> None:
        if self._draining and not self._pending:
            with self._idle:
                self._idle.notify_all()

    def _expire(self, rids) -> None:
        for rid in rids:
            entry = self._pending.pop(rid, None)
            if entry is None:
                continue
            fut, _tick, peer, _conn, timeout, func, _sent = entry
            name = self._name_of(peer)
            fut.set_exception(RpcTimeoutError(
                f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be "
                f"marked with an error (call to {name}: {_func_name(func)})"))
        self._note_idle()

    # ------------------------------------------------------------------ incoming frames

    def _on_frames(self, conn, frames, at_rest: bool = False) -> bool:
        """Reader thread: dispatch a batch of decoded frames.

        When the batch ends what the reader has read (``at_rest``) and holds a few
        requests (``_INLINE_MAX``; a ``remote()`` followed by ``to_here()`` typically
        arrives as two), the reader runs them itself, in order (``inline.py``).

        Returns:
            True if the reading was handed to another thread meanwhile: the reader
            must stop.
        """
        work = []
        for kind, flags, rid, payload, tensors in frames:
            if kind == F.K_RESPONSE:
                self._complete(rid, flags, payload, tensors)
            elif kind == F.K_REQUEST:
                work.append((self._serve_plain if flags & F.F_PLAIN else self._serve,
                             (conn, rid, payload, tensors)))
            elif kind == F.K_GOODBYE:
                pass
            else:
                raise ser_protocol_error(kind)
        if work:
            with self._stats_lock:
                self._received += len(work)
                self._recv_from[conn.peer_rank] += len(work)
            if at_rest and len(work) <= _INLINE_MAX:
                # The requests own their payloads and tensors now: nothing else may keep
                # a received tensor (its buffer, its mapping) alive while they run.
                frames.clear()
                del payload, tensors
                return self._inline.run(conn, work)
            self._pool.submit_many(work)
        return False

    def _complete(self, rid: int, flags: int, payload, tensors) -> None:
        entry = self._pending.get(rid)
        if entry is None:
            return  # reply to a call that already timed out: dropped quietly
        # Decode while the call still counts as pending: what unpickling starts (RRef
        # fork messages) is then visible to shutdown's termination detection.
        if flags & F.F_ERROR:
            value, error = None, ser.loads_exception(payload)
        elif flags & F.F_PLAIN:
            try:
                value, error = ser.plain_value(payload, tensors), None
            except ProtocolError as exc:
                value, error = None, SerializationError(
                    f"cannot decode the reply from {self._name_of(entry[2])}: {exc}")
        else:
            try:
                value, error = ser.loads(payload, tensors), None
            except SerializationError as exc:
                value, error = None, SerializationError(
                    f"cannot decode the reply from {self._name_of(entry[2])}: {exc}")
        if self._pending.pop(rid, None) is None:
            return  # timed out while decoding
        fut, tick = entry[0], entry[1]
        if tick is not None:
            self._timer.cancel(rid, tick)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
        if self._draining:
            self._note_idle()

    def _serve(self, conn, rid: int, payload, tensors) -> None:
        """Pool thread: decode one request, run it and reply."""
        gates: list = []
        try:
            func, args, kwargs = ser.loads(payload, tensors, gates=gates)
        except Exception as exc:
            self._reply_error(conn, rid, exc, "")
            return
        del payload, tensors
        if gates:
            # Something in the arguments is not ready yet (an RRef fork the owner has
            # not confirmed): run the function once it is, without holding this thread.
            torch.futures.collect_all(gates).add_done_callback(
                lambda _f: self._pool.submit(self._run, conn, rid, func, args, kwargs))
            return
        self._run(conn, rid, func, args, kwargs)

    def _run(self, conn, rid: int, func, args, kwargs) -> None:
        try:
            if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                fut = func(*(args or ()), **(kwargs or {}))
                if not isinstance(fut, torch._C.Future):
                    # torch's wording ("@rpc.async_function ... Future object,") kept for
                    # error handling written against it
                    raise RuntimeError(
                        "Functions decorated with @rpc.async_function must return a "
                        f"torch.futures.Future object, but {_func_name(func)} "
                        f"(@rpc.functions.async_execution) returned {type(fut).__name__}")
                fut.add_done_callback(lambda f: self._reply_future(conn, rid, f))
                return
            result = func(*(args or ()), **(kwargs or {}))
            if type(result) is Deferred:  # torchwire-internal functions (RRefs)
                torch._C.Future.add_done_callback(
                    result.future, lambda f: self._reply_future(conn, rid, f))
                return
        except Exception as exc:
            tb = traceback.format_exc()
            # As torch, the callee reports a failing function on its stderr too, not
            # only through the caller's exception.
            print(f"On {self._desc}:\n{exc!r}\n{tb}", file=sys.stderr)
            if isinstance(exc, TypeError) and _is_torch_op(func):
                exc = RuntimeError("Overloaded torch operator invoked from Python failed to "
                                   f"match any schema: {exc}")
            self._reply_error(conn, rid, exc, tb)
            return
        # Release the arguments before replying: an RRef among them sends its
        # deletion before the caller learns the call is over.
        del func, args, kwargs
        self._reply_value(conn, rid, result)

    def _reply_future(self, conn, rid: int, fut) -> None:
        if _threads.in_io_thread():
            # A reader completed the future (the reply to a nested call arrived): a
            # small plain value is sent from here without waking a pool thread.
            if not self._reply_nowait(conn, rid, fut):
                self._pool.submit(self._reply_future, conn, rid, fut)
            return
        try:
            value = fut.wait()
        except Exception as exc:
            self._reply_error(conn, rid, exc, traceback.format_exc())
            return
        self._reply_value(conn, rid, value)

    def _reply_nowait(self, conn, rid: int, fut) -> bool:
        """I/O thread: reply with ``fut``'s value if it is small and plain (no user
        code runs to pickle it, no tensors) and the link can write without blocking
        (``Connection.send_nowait``); False to leave the reply to the pool."""
        send = getattr(conn, "send_nowait", None)
        if send is None or rid == 0:
            return False
        try:
            value = fut.value()
        except Exception:
            return False  # errors: the pool formats them
        if not _plain_value(value, 0):
            return False
        try:
            payload, _, _ = ser.dumps_to(value, conn.peer_rank, False)
        except SerializationError:
            return False
        if len(payload) > _NOWAIT_MAX:
            return False
        self._count_reply(1)
        if not send(F.pack_header(F.K_RESPONSE, 0, rid, len(payload), 0) + payload):
            self._count_reply(-1)
            return False
        with self._stats_lock:
            self._replies_in_place += 1
        return True

    def _reply_value(self, conn, rid: int, value) -> None:
        if rid == 0:
            return  # one-way request (notify)
        flags, sent = F.F_PLAIN, None
        try:
            plain = ser.plain_reply(value)
            if plain is None:
                flags = 0
                payload, tensors, sent = ser.dumps_to(value, conn.peer_rank, False)
            else:
                payload, tensors = plain
        except SerializationError as exc:
            self._reply_error(conn, rid, SerializationError(
                f"the return value could not be serialized: {exc}"), "")
            return
        self._count_reply(1)  # before the write: the caller may go on before it returns
        try:
            conn.send_frame(F.K_RESPONSE, flags, rid, payload, tensors)
        except LinkError:
            self._count_reply(-1)
            if sent is not None:
                sent.abort()
            log.debug("torchwire: reply %d to rank %s dropped: connection closed", rid,
                      conn.peer_rank)

    def _reply_error(self, conn, rid: int, exc: BaseException, tb: str) -> None:
        if rid == 0:
            log.warning("torchwire: one-way request from rank %s failed on %s: %s: %s\n%s",
                        conn.peer_rank, self.name, type(exc).__name__, exc, tb)
            return
        payload = ser.dumps_exception(exc, self._desc, tb)
        self._count_reply(1)
        try:
            conn.send_frame(F.K_RESPONSE, F.F_ERROR, rid, payload)
        except LinkError:
            self._count_reply(-1)
            log.debug("torchwire: error reply %d dropped: connection closed", rid)

    def _count_reply(self, n: int) -> None:
        with self._stats_lock:
            self._replies_sent += n

    # ------------------------------------------------------------------ connections

    def _on_accept(self, sock: socket.socket, transport: str):
        """Handshake thread: authenticate the peer; returns its reader loop to run next."""
        try:
            sock, rank = server_handshake(sock, self.rank, self._job, self.world_size, transport)
            peer = self._peers.get(rank)
            if self.membership is not None:
                peer = self.membership.admit(rank, peer)
        except LinkError as exc:
            sock.close()
            if isinstance(exc, ConnectError):  # silent or slow until the deadline: refused
                log.warning("torchwire: %s refused a %s connection: %s", self.name, transport,
                            exc)
            return  # else it left: a liveness probe, or a peer that gave up
        except Exception as exc:
            log.warning("torchwire: %s refused a %s connection: %s", self.name, transport, exc)
            try:
                sock.close()
            except OSError:
                pass
            return
        if peer is None:  # authenticated, but not (or no longer) a member of the group
            log.warning("torchwire: %s refused a %s connection from rank %d: not a member of "
                        "the group", self.name, transport, rank)
            sock.close()
            return
        conn = Connection(sock, rank, self._on_frames, self._on_close,
                          channels=self._channels(peer, transport),
                          defer=self._pool.submit, max_message_size=self.max_message_size,
                          initiated=False, transport=transport)
        with self._conn_lock:
            if self.state is AgentState.CLOSED:
                conn.close()
            self._incoming.add(conn)
        self._health.mark_up(rank)
        return conn.read_loop

    def _on_close(self, conn, exc) -> None:
        """Reader thread, once per connection: fail what depended on it."""
        self._inline.forget(conn)
        with self._conn_lock:
            self._incoming.discard(conn)
            if conn in self._lanes_out:
                self._lanes_out.remove(conn)
        peer = self._peers.get(conn.peer_rank)
        if peer is not None and peer.out is conn:
            with peer.lock:
                if peer.out is conn:
                    peer.out = None
        if conn.initiated:
            why = f"connection lost ({exc})" if exc is not None else "connection closed"
            if self.state is AgentState.CLOSED:
                err: BaseException = RpcStateError("RPC agent is shut down")
            else:
                err = self._unavailable(conn.peer_rank, why)
            for rid in [rid for rid, e in list(self._pending.items()) if e[3] is conn]:
                self._fail(rid, err)
        if conn in self._retired:
            return  # with a member that was dropped: it tells nothing of the rank's newcomer
        if exc is not None and self.state is AgentState.RUNNING and not conn.goodbye_received:
            log.warning("torchwire: %s lost its connection to %s: %s", self.name,
                        self._name_of(conn.peer_rank), exc)
        if exc is not None and not conn.goodbye_received:
            # Outside an orderly close, a lost connection means a lost peer (DESIGN.md).
            self._peer_lost(conn.peer_rank, f"connection lost ({exc})")

    def _peer_lost(self, rank: int, why: str, dead: bool = False) -> None:
        """``rank`` is gone or cut off: remember it (new calls fail at once), close every
        connection with it, fail every call pending on it, and tell the plugins once.

        Called from readers, the liveness thread and callers whose connect failed.
        """
        if rank == self.rank or self.state is AgentState.CLOSED:
            return
        peer = self._peers.get(rank)
        # one that left a dynamic group is not remembered as down: nothing calls it
        first = peer is not None and self._health.mark_down(rank, why, dead)
        err = self._unavailable(rank, why)
        with self._conn_lock:
            conns = [c for c in list(self._incoming) + self._lanes_out if c.peer_rank == rank]
        out = peer.out if peer is not None else None  # not under peer.lock: a connect may hold it
        if out is not None:
            conns.append(out)
        # Fail the pending calls first: closing wakes the readers, which would fail
        # them with a bare "connection lost" instead of the reason known here.
        for rid in [rid for rid, e in list(self._pending.items()) if e[2] == rank]:
            self._fail(rid, err)
        for c in conns:
            c.close(err)
        if not first:
            return
        log.warning("torchwire: %s lost worker %s: %s", self.name, self._name_of(rank), why)
        for p in self._plugins:
            try:
                self._pool.submit(p.peer_lost, rank, err)
            except RpcStateError:
                pass  # the pool is shut down: so is everything the hook would fix

    def _open_connections(self) -> list:
        """Every socket connection, in and out (for the heartbeat)."""
        with self._conn_lock:
            conns = list(self._incoming)
            if self._retired:
                conns = [c for c in conns if c not in self._retired]
        return conns + [p.out for p in self._peers.values() if isinstance(p.out, Connection)]

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Stop the agent; see the module docstring for the graceful protocol.

        Raises:
            RpcTimeoutError: graceful shutdown did not complete within ``timeout``
                (the local shutdown still happens).
        """
        if self.state is AgentState.CLOSED:
            return
        error = None
        try:
            if graceful:
                self.state = AgentState.DRAINING
                try:
                    if self.membership is not None:
                        self.membership.leave(time.monotonic() + timeout)
                    else:
                        self._drain(time.monotonic() + timeout)
                except RpcTimeoutError as exc:
                    error = exc
        finally:
            self._close_local()  # whatever went wrong above
        if error is not None:
            raise error

    def _wait_idle(self, deadline: float) -> bool:
        with self._idle:
            self._draining = True
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def _drain(self, deadline: float) -> None:
        store, world = self.store, self.world_size
        previous = None
        full = False  # publish per-peer counts (some worker is gone or cut off)
        for r in itertools.count():
            self.settle(deadline)
            keys = [f"sd/{r}/{k}" for k in range(world)]
            try:
                store.set(keys[self.rank], self._shutdown_record(full))
            except Exception as exc:
                raise RpcTimeoutError(f"graceful shutdown of {self.name} failed: the "
                                      f"rendezvous store is gone ({exc})") from exc
            records = {k: v.decode() for k, v in self._gather(keys, deadline).items()}
            balanced = _balanced(records, world)
            if balanced is None:
                full = True
            state = sorted(records.items())
            if balanced and state == previous:
                break
            if r == 0:
                self.all_arrived()
            previous = state
        # Exit barrier: rank 0 may host the store, so it leaves last.
        store.set(f"sd/exit/{self.rank}", "1")
        if self.rank == 0:
            self._gather([f"sd/exit/{k}" for k in range(world)], deadline)
        gone = sorted(set(range(world)) - set(records))
        if gone:
            names = ", ".join(self._peers[k].info.name for k in gone)
            log.warning("torchwire: %s shut down gracefully without worker(s) %s (gone or "
                        "cut off)", self.name, names)

    def _shutdown_record(self, full: bool) -> str:
        """This worker's termination-detection record: ``"sent,received"``, then, when a
        peer is or was down (or ``full``), ``";s:r s:r ...;down,ranks"`` per peer.

        A peer that was down and came back stays listed: what was in flight to it
        when the link broke is lost, so that pair's counts can never balance; only
        the calls still pending (on both sides) guard its traffic then.
        """
        down = sorted(set(self._health.down()) | self._health.ever_down)
        with self._stats_lock:
            head = f"{self._sent},{self._received}"
            if not (full or down):
                return head
            vec = " ".join(f"{s}:{r}" for s, r in zip(self._sent_to, self._recv_from))
        return f"{head};{vec};{','.join(map(str, down))}"

    def all_arrived(self) -> None:
        """Every worker has entered graceful shutdown (or this one leaves its dynamic
        group): tell the plug-ins (the RRef context deletes its user RRefs)."""
        for p in self._plugins:
            p.all_arrived()

    def settle(self, deadline: float) -> None:
        """Wait until no call is pending and no plugin has control messages to send."""
        while True:
            for p in self._plugins:
                p.settle(deadline)
            if not self._wait_idle(deadline):
                raise RpcTimeoutError(
                    f"graceful shutdown of {self.name} timed out: {len(self._pending)} call(s) "
                    "still pending")
            if all(p.idle() for p in self._plugins):
                return

    def _gather(self, keys: list[str], deadline: float) -> dict[int, bytes]:
        """Wait for one key per rank, except from ranks that are gone; between waits,
        check that missing ranks are alive.

        A rank is gone when it is down (see _liveness.py), found dead now, or has
        already left (its exit key is set).

        Returns:
            ``{rank: value}`` for the ranks that are not gone.

        Raises:
            RpcTimeoutError: ``deadline`` passed or the store is gone.
        """
        store = self.store
        next_probe = time.monotonic() + _LIVENESS_PERIOD
        delay = 0.001
        while True:
            try:
                missing = [k for k, key in enumerate(keys) if not store.check([key])]
                waiting = [k for k in missing if not self._health.is_down(k)
                           and not store.check([f"sd/exit/{k}"])]
                if not waiting:
                    present = [k for k in range(len(keys)) if k not in missing]
                    return dict(zip(present, store.multi_get([keys[k] for k in present])))
            except Exception as exc:
                raise RpcTimeoutError(f"graceful shutdown of {self.name} failed: the "
                                      f"rendezvous store is gone ({exc})") from exc
            now = time.monotonic()
            if now >= deadline:
                names = ", ".join(self._peers[k].info.name for k in waiting)
                raise RpcTimeoutError(
                    f"graceful shutdown of {self.name} timed out waiting for the other "
                    f"workers to call shutdown() (still waiting for {names})")
            if now >= next_probe:
                for k in waiting:
                    if k != self.rank:
                        self._alive(k)  # marks it down if it is not
                next_probe = time.monotonic() + _LIVENESS_PERIOD
                continue
            # Polling the store (rather than store.wait) keeps torch's C++ layer from
            # logging a timeout warning on every liveness period.
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.02)

    def _alive(self, rank: int) -> bool:
        """Shutdown waits for ``rank``: is it alive?  With the heartbeat on, a connection
        to it settles that (a frozen peer falls silent on it); else a dead listener."""
        if self._health.is_down(rank):
            return False
        if self._health.timeout > 0:
            try:
                self._connection_to(rank)
            except (WorkerUnavailableError, RpcStateError):
                return False
            return True
        if self._probe(rank):
            return True
        self._peer_lost(rank, "its listener refused the connection (the process is gone)",
                        dead=True)
        return False

    def _probe(self, rank: int) -> bool:
        """Is ``rank``'s listener still there?  (A dead process refuses connections.)"""
        return listener_alive(self._peers[rank].record, self._host)

    def _close_local(self) -> None:
        with self._conn_lock:
            self.state = AgentState.CLOSED
            conns = list(self._incoming) + self._lanes_out
        self._listener.close()
        for p in self._peers.values():
            with p.lock:
                if p.out is not None:
                    conns.append(p.out)
                    p.out = None
        for c in conns:
            c.send_goodbye()
            c.close()
        for c in conns:
            c.join(2.0)
        segments.clear()  # released segments; leased ones close when their mappings go
        self._timer.stop()
        self._health.stop()
        err = RpcStateError("RPC agent is shut down before the call completed")
        for rid in list(self._pending):
            self._fail(rid, err)
        for p in self._plugins:
            try:
                p.close()
            except Exception:
                log.exception("torchwire: closing %r failed", p)
        self._pool.shutdown(5.0)


_PLAIN_TYPES = frozenset((type(None), bool, int, float, str, bytes))
_NOWAIT_MAX = 16 << 10  # bytes of reply payload an I/O thread may write itself


def _plain_value(value, depth: int) -> bool:
    """None, numbers, strings and bytes, and small tuples and lists of them."""
    t = type(value)
    if t in _PLAIN_TYPES:
        return True
    if (t is tuple or t is list) and depth < 2 and len(value) <= 16:
        return all(_plain_value(v, depth + 1) for v in value)
    return False


def _balanced(records: dict[int, str], world: int) -> bool | None:
    """Do the shutdown records show every request received?  None: cannot tell yet
    (a worker is gone and some record lacks per-peer counts: publish them).

    With every worker there and none down, the totals must balance.  Otherwise
    each pair of workers that still reach each other must: what i sent to j is
    what j received from i; traffic with the gone and the cut off is left out.
    """
    parsed = {}
    for k, v in records.items():
        parts = v.split(";")
        sent, recv = (int(x) for x in parts[0].split(","))
        if len(parts) == 1:
            parsed[k] = (sent, recv, None, frozenset())
        else:
            vec = [tuple(int(x) for x in p.split(":")) for p in parts[1].split()]
            down = frozenset(int(x) for x in parts[2].split(",") if x)
            parsed[k] = (sent, recv, vec, down)
    if len(parsed) == world and not any(p[3] for p in parsed.values()):
        return sum(p[0] for p in parsed.values()) == sum(p[1] for p in parsed.values())
    if any(p[2] is None for p in parsed.values()):
        return None
    for i, (_s, _r, vec_i, down_i) in parsed.items():
        for j, (_s, _r, vec_j, down_j) in parsed.items():
            if j not in down_i and i not in down_j and vec_i[j][0] != vec_j[i][1]:
                return False
    return True


def _unknown(what: str):
    from .._base.errors import UnknownWorkerError
    # "could not find destination" is torch's phrase; ported error handling matches on it
    return UnknownWorkerError(f"Unknown destination worker {what}: could not find destination "
                              f"name {what} among this job's workers")


def ser_protocol_error(kind: int):
    from .._base.errors import ProtocolError
    return ProtocolError(f"unexpected frame kind {kind} on an established connection")


def _is_torch_op(func) -> bool:
    """A builtin torch operator (``torch.add``), whose bad arguments torch reports as a
    RuntimeError ("failed to match any schema") rather than TypeError."""
    return type(func).__name__ == "builtin_function_or_method" and \
        getattr(func, "__module__", None) == "torch"


def _func_name(func) -> str:
    mod = getattr(func, "__module__", None)
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{mod}.{qual}" if mod else str(qual)


__all__ = ["RpcAgent", "AgentState", "LoopbackConnection"]
