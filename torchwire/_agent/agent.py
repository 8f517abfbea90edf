"""The RPC agent: one per process, split by job.

:class:`RpcAgent` is the facade the layers above use (``call``, ``notify``,
``stats``, ``shutdown``) and the place where its parts meet:

==================  ==========================================================
``names.py``        the name table: members by rank and name, those that left
``members.py``      member changes: joins, leaves, a restarted rank's rejoin
``links.py``        connections: made on first use, accepted, lost, retired
``pending.py``      calls waiting for replies, and the timer of their deadlines
``serving.py``      what arrives: replies to pending calls, requests to run
``inline.py``       requests a reader runs in place
``termination.py``  graceful shutdown of a static group (store rounds)
``liveness.py``     the heartbeat, lost and dead peers, reconnection
``pool.py``         the threads that run user functions and callbacks
``coroutines.py``   the event loop that runs ``async def`` functions
``counters.py``     requests sent and received, for stats and termination
``metrics.py``      per-peer latency histograms, errors and timeouts of calls
``report.py``       ``stats()``, torch's ``get_metrics()``/``get_debug_info()``
==================  ==========================================================

Threads: a reader per connection (I/O: decodes frames, completes pending calls,
runs a few requests in place, hands the rest to the pool), the timer (I/O),
the pool, the asyncio loop thread (I/O; started by the first ``async def`` call),
one accept thread per listening socket plus a short-lived handshake thread per
accepted connection (which then becomes its reader), and the liveness monitor.

A dynamic group (``world_size`` None, ``torchwire._bootstrap.membership``) changes
the name table while the agent runs (``add_member``, ``remove_member``), and its
graceful shutdown is leaving the group.

Failures (DESIGN.md, "Failure model"): a connection lost outside an orderly close,
a connection that cannot be made or a silent heartbeat marks the peer down
(:meth:`RpcAgent.peer_lost`): calls pending on it fail with
``WorkerUnavailableError`` naming it, new calls to it fail at once, plug-ins hear
``peer_lost``.
"""

from __future__ import annotations

import logging
import time

from .. import _serialization as ser
from .._base import devices, intraop
from .._base.errors import (LinkError, RpcStateError, RpcTimeoutError, SerializationError,
                            WorkerUnavailableError, not_initialized)
from .._base.options import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT
from .._base.worker_info import WorkerInfo
from .._base.worker_record import WorkerRecord
from .._wire import frame as F
from .._wire.lending import LENT as _LENT
from .._wire.listener import host_identity
from .coroutines import CoroutineRunner
from .counters import Counters
from .future import Future, SyncReply, _may_borrow
from .links import Links
from .liveness import PeerHealth
from .members import MemberChanges
from .names import MessageLimits, NameTable
from .pending import PendingCalls
from .plugins import AgentPlugin
from . import profiling, prometheus, report
from .pool import WorkerPool
from .serving import Server
from .state import AgentState
from .termination import Termination

log = logging.getLogger("torchwire")

_K_REQUEST, _F_PLAIN = F.K_REQUEST, F.F_PLAIN


class RpcAgent:
    """The per-process RPC runtime (see the module docstring).

    Args:
        name, rank: this worker.
        world_size: the static job's size; None for a dynamic group.
        options: ``TorchwireRpcBackendOptions``.
        store: the (prefixed) rendezvous store, for shutdown's rounds.
        store_host: the store's host (None for a file store).
        listener: this worker's listening sockets.
        records: every member's :class:`WorkerRecord` (this one's included).
        job: the job's key (``JobAuth``, bound to the job token).
    """

    def __init__(self, name: str, rank: int, world_size: int | None, options, store,
                 store_host: str | None, listener, records: list[WorkerRecord], job) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size  # None: a dynamic group (membership changes)
        self.options = options
        self.store = store
        self.store_host = store_host
        self.host = host_identity()
        self.info = WorkerInfo(name, rank)
        self.rpc_timeout = float(options.rpc_timeout)
        self.max_message_size = int(options.max_message_size)
        self.poll_us = float(options.poll_us)
        self.state = AgentState.RUNNING
        self.membership = None  # a dynamic group's GroupMembership
        self.metrics_endpoint = None  # the Prometheus endpoint, when asked for
        self.admission = None  # who accepted connections come from (plugins.Admission)
        self._plugins: list[AgentPlugin] = []
        self.names = NameTable(records)
        # how many processes held this rank before this one (a restarted worker's rejoin)
        self.incarnation = self.names.member(rank).record.incarnation
        self.limits = MessageLimits(self.max_message_size, self.names)
        self.counters = Counters(world_size)
        self.pending = PendingCalls(self.names.name_of)
        self.pool = WorkerPool(options.num_worker_threads, name=f"torchwire-{name}")
        self.coroutines = CoroutineRunner(name)
        self.health = PeerHealth(
            self, getattr(options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL),
            getattr(options, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT))
        self.links = Links(self, listener, job, options)
        self.server = Server(self)
        self.termination = Termination(self)
        self.members = MemberChanges(self)
        self._share_host()
        profiling.install()

    def __repr__(self) -> str:
        world = self.world_size if self.world_size is not None else \
            f"dynamic({len(self.names)})"
        return (f"<RpcAgent {self.name} rank={self.rank}/{world} state={self.state.value} "
                f"pending={len(self.pending)} {self.links!r}>")

    # rpc.stats(), and torch's agent metrics and debug info under torch's keys
    stats, get_metrics, get_debug_info = report.stats, report.get_metrics, report.get_debug_info

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        """Serve: accept connections, start the liveness monitor and (if asked for) the
        Prometheus endpoint (``prometheus.MetricsEndpoint``: its errors)."""
        port = prometheus.wanted_port(self.options, self.rank)
        if port is not None:
            self.metrics_endpoint = prometheus.MetricsEndpoint(
                self, port, getattr(self.options, "metrics_addr", None) or "127.0.0.1")
        self.links.start()
        self.health.start()

    def add_plugin(self, plugin) -> None:
        """Attach a layer above the agent (``plugins.AgentPlugin``: the RRef context,
        the autograd container) to shutdown and to the news of lost peers.

        Raises:
            TypeError: ``plugin`` does not implement ``AgentPlugin``.
        """
        if not isinstance(plugin, AgentPlugin):
            raise TypeError(f"{type(plugin).__name__} is not an AgentPlugin")
        self._plugins.append(plugin)

    def set_membership(self, membership) -> None:
        """A dynamic group's membership (``plugins.GroupMembership``): it admits the
        connections of newcomers, and graceful shutdown leaves the group through it."""
        self.membership = membership
        self.admission = membership

    def set_admission(self, admission) -> None:
        """A static group's ``plugins.Admission``: a connection from a rank's next
        incarnation (it rejoined) replaces the member the agent knew."""
        self.admission = admission

    @property
    def closed(self) -> bool:
        return self.state is AgentState.CLOSED

    def defer(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the pool (off an I/O thread).

        Raises RpcStateError if the pool is shut down."""
        self.pool.submit(fn, *args)

    # ------------------------------------------------------------------ names

    def get_worker_info(self, to=None) -> WorkerInfo:
        """This worker's :class:`WorkerInfo` (``to`` None) or that of the member ``to``
        (a name, rank or WorkerInfo) names.

        Raises:
            UnknownWorkerError: no member has that name, rank or WorkerInfo.
            WorkerUnavailableError: (dynamic groups) it names a member that left.
        """
        t = type(to)
        if t is str:  # the common cases, without a call more
            info = self.names.by_name.get(to)
            if info is not None:
                return info
        elif t is int:
            member = self.names.by_rank.get(to)
            if member is not None:
                return member.info
        elif t is WorkerInfo:  # most often one this table gave out
            member = self.names.by_rank.get(to.id)
            if member is not None and member.info is to:
                return to
        return self.info if to is None else self.names.lookup(to)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every member, this worker included, by rank (a dynamic group: as of now)."""
        return self.names.infos()

    def name_of(self, rank: int) -> str:
        """The name of ``rank``, a member or one that left (for messages)."""
        return self.names.name_of(rank)

    def unavailable(self, rank: int, why: str) -> WorkerUnavailableError:
        """The error that calls to ``rank`` fail with, saying ``why``."""
        return self.names.unavailable(rank, why)

    # ------------------------------------------------------------------ calls

    def call(self, to: WorkerInfo, func, args, kwargs, timeout: float, pin=None,
             sync: bool = False, traced=None, bookkeeping: bool = False):
        """Send a request; returns the future of its reply.

        ``pin``: an object kept alive until the reply arrives (or the call fails).
        ``sync``: the caller waits for the reply at once: a :class:`SyncReply` instead
        of a future (only ``wait()`` and ``done()``).  While a profiler runs, the call
        is an event of it (``profiling.py``; ``traced``: it is, this is its
        ``profiling.Probe``, told the sizes of the request and of its reply).
        ``bookkeeping``: an internal call whose reply nobody waits for soon (RRef
        deletions): it never takes a lent reading back (``_wire/lending.py``).

        Raises (on the caller, before anything is sent):
            RpcStateError: the agent is shut down.
            SerializationError: the call cannot be pickled.
        """
        if self.state is AgentState.CLOSED:
            raise not_initialized()
        if traced is None and profiling.active():
            return profiling.call(self, to, func, args, kwargs, timeout, pin, sync)
        peer = to.id
        plain = ser.plain_call(func, args, kwargs, peer)
        if plain is None:
            flags = 0
            payload, tensors, sent = ser.dumps_to((func, args, kwargs), peer, True)
        else:
            flags = _F_PLAIN
            payload, tensors, sent = plain
        size = len(payload)
        for t in tensors:
            size += t.nbytes
        if size > self.limits.smallest and size > self.limits.of(peer):
            if sent is not None:
                sent.abort()
            raise SerializationError(
                f"a request of {size} bytes to {to.name} exceeds max_message_size "
                f"{self.limits.of(peer)} (the smaller of this worker's and its receiver's)")
        fut = SyncReply() if sync else Future()
        # one deadline for connecting, writing and the reply
        deadline = time.monotonic() + timeout if timeout > 0 else None
        try:
            conn = self.links.connection_to(peer, deadline)
        except (WorkerUnavailableError, RpcStateError, RpcTimeoutError) as exc:
            if sent is not None:
                sent.abort()
            if isinstance(exc, RpcTimeoutError):
                exc = self.pending.timeout_error(peer, timeout, func, str(exc))
            self.pending.metrics.failed(peer, exc, isinstance(exc, RpcTimeoutError))
            fut.set_exception(exc)
            return fut
        # ``sent`` rides along: it pins what must stay alive until the reply (RRefs)
        if traced is not None:
            traced.bytes_out = size
        rid = self.pending.add(fut, peer, conn, timeout, func,
                               sent if pin is None else (sent, pin), deadline, traced)
        # its caller may read the reply itself (``_wire/lending.py``)
        if sync:
            fut.conn, fut.deadline, fut.pending = conn, deadline, self.pending
            fut.lends = conn.role is not None and _may_borrow()
        else:
            # a call sent while the reading is not lent has its reply read before the
            # reading can be lent (the reader lends only with nothing pending)
            role = conn.role
            if role is not None and role.state is _LENT and not bookkeeping:
                fut._tw_link = (conn, deadline, self.pending)
                role.sent_one()
        try:
            conn.send_frame(_K_REQUEST, flags, rid, payload, tensors, deadline)
        except (LinkError, RpcTimeoutError) as exc:
            if sent is not None:
                sent.abort()
            if isinstance(exc, RpcTimeoutError):
                err = self.pending.timeout_error(peer, timeout, func, str(exc))
            else:
                err = self.unavailable(peer, f"connection lost: {exc}")
            self.pending.fail(rid, err)
            return fut
        c = self.counters
        with c.lock:  # (Counters.count_sent, inlined: every call's path)
            c.sent += 1
            c.sent_to[peer] += 1
        return fut

    def notify(self, to: WorkerInfo, func, args) -> None:
        """Send a one-way request (request id 0): ``func(*args)`` runs there, no reply.

        For internal control messages whose loss can only mean the peer is gone.

        Raises:
            RpcStateError, WorkerUnavailableError, LinkError, SerializationError: it
            could not be sent.
        """
        if self.state is AgentState.CLOSED:
            raise not_initialized()
        payload, tensors, sent = ser.dumps_to((func, args, None), to.id, False)
        try:
            self.links.connection_to(to.id).send_frame(_K_REQUEST, 0, 0, payload, tensors)
        except BaseException:
            if sent is not None:
                sent.abort()
            raise
        self.counters.count_sent(to.id)

    def notify_plain(self, rank: int, payload: bytes, tensors=()) -> None:
        """Send an internal one-way message that is not pickled: ``payload[0]`` is a
        plain message kind its layer registered (``ser.hooks.register_plain``), whose
        handler decodes the rest itself; ``tensors`` (contiguous CPU tensors) travel
        as the frame's buffers.  For frequent small messages (the distributed
        backward pass's).

        Raises:
            RpcStateError, WorkerUnavailableError, LinkError: not sent.
        """
        if self.state is AgentState.CLOSED:
            raise not_initialized()
        self.links.connection_to(rank).send_frame(_K_REQUEST, _F_PLAIN, 0, payload, tensors)
        c = self.counters
        with c.lock:
            c.sent += 1
            c.sent_to[rank] += 1

    # ------------------------------------------------------------------ membership

    def add_member(self, record: WorkerRecord):
        """A member joined, or a rank's next incarnation rejoined (``members.py``).

        Returns:
            its :class:`~.names.Member`.
        """
        return self.members.add(record)

    def remove_member(self, rank: int, deadline: float, why: str) -> None:
        """A dynamic group lost member ``rank`` (``members.py``)."""
        self.members.remove(rank, deadline, why)

    def plugins(self) -> list[AgentPlugin]:
        return list(self._plugins)

    def update_router(self) -> None:
        """Device maps of a dynamic group: route to the members of now; and the
        intra-op threads of torchwire's own passes (their share of this host)."""
        self.limits.reset()
        router = devices.Router(self.name, [m.record for m in self.names.members()])
        ser.hooks.set_device_router(router.target if router else None,
                                        cpu_routed=router.routes_cpu, ipc=router.ipc,
                                        here=router.rank)
        self._share_host()

    def _share_host(self) -> None:
        local = sum(1 for m in self.names.members() if m.record.host == self.host)
        intraop.set_local_workers(max(1, local))

    # ------------------------------------------------------------------ lost peers

    def peer_lost(self, rank: int, why: str, dead: bool = False, member=None) -> None:
        """``rank`` is gone or cut off: remember it (new calls fail at once), close every
        connection with it, fail every call pending on it, and tell the plug-ins once.

        Called from readers, the liveness thread and callers whose connect failed
        (``member``: the one dialed; if another holds the rank now, nothing happens).
        """
        if rank == self.rank or self.state is AgentState.CLOSED:
            return
        names = self.names
        current = None if member is None else (lambda: names.member(rank) is member)
        # one that left a dynamic group is not remembered as down: nothing calls it
        first = names.member(rank) is not None and self.health.mark_down(rank, why, dead,
                                                                         current)
        if first is None:  # it restarted: the loss was its old process's
            return
        err = self.unavailable(rank, why)
        # Fail the pending calls first: closing wakes the readers, which would fail
        # them with a bare "connection lost" instead of the reason known here.
        self.pending.fail_where(err, peer=rank)
        self.links.close_peer(rank, err)
        if not first:
            return
        log.warning("torchwire: %s lost worker %s: %s", self.name, self.name_of(rank), why)
        for p in self._plugins:
            try:
                self.pool.submit(p.peer_lost, rank, err)
            except RpcStateError:
                pass  # the pool is shut down: so is everything the hook would fix

    def open_connections(self) -> list:
        """Every socket connection, in and out (for the heartbeat)."""
        return self.links.open_connections()

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Stop the agent: gracefully, the termination rounds of a static group
        (``termination.py``) or leaving a dynamic one; then close everything.

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
                        self.termination.drain(time.monotonic() + timeout)
                except RpcTimeoutError as exc:
                    error = exc
        finally:
            self._close_local()  # whatever went wrong above
        if error is not None:
            raise error

    def _mark_closed(self) -> None:
        self.state = AgentState.CLOSED

    def all_arrived(self) -> None:
        """Every worker has entered graceful shutdown (or this one leaves its dynamic
        group): tell the plug-ins (the RRef context deletes its user RRefs)."""
        for p in self._plugins:
            p.all_arrived()

    def settle(self, deadline: float) -> None:
        """Wait until no call is pending and no plug-in has control messages to send.

        Raises:
            RpcTimeoutError: ``deadline`` passed first.
        """
        while True:
            for p in self._plugins:
                p.settle(deadline)
            if not self.pending.wait_idle(deadline):
                raise RpcTimeoutError(
                    f"graceful shutdown of {self.name} timed out: {len(self.pending)} call(s) "
                    "still pending")
            if all(p.idle() for p in self._plugins):
                return

    def _close_local(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self.links.close_all(self._mark_closed)
        self.pending.stop()
        self.health.stop()
        self.pending.fail_where(RpcStateError(
            "RPC agent is shut down before the call completed"))
        for p in self._plugins:
            try:
                p.close()
            except Exception:
                log.exception("torchwire: closing %r failed", p)
        self.coroutines.stop(5.0)
        self.pool.shutdown(5.0)
