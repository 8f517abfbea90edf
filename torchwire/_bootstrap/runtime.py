"""Wiring the runtime together: what ``init_rpc`` builds and ``shutdown`` takes apart.

This is the one place that knows every layer.  :func:`start`:

1. opens the rendezvous store (``rendezvous.open_store``) and a listener;
2. joins the job: a static group's rendezvous (``rendezvous.join``, in a new
   session of the store if this process took part in its last one: ``sessions.py``),
   or a dynamic group's (``membership.join``);
3. builds the agent, the RRef context, the distributed autograd container and the
   collectives' state, and registers the last three as agent plug-ins
   (``torchwire._agent.runtime.AgentPlugin``), a dynamic group's membership as its
   ``GroupMembership`` (a static group's admission of rejoined ranks otherwise);
4. publishes the :class:`~torchwire._agent.runtime.Runtime` in ``current`` - before
   the agent serves, since a peer's first request may run as soon as it does - and
   starts the agent; a dynamic member then announces itself to the group, and so
   does a restarted worker that took its rank back in a static one (``rejoin.py``).

:func:`stop` shuts the agent down and clears ``current``, whatever went wrong.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time

from .. import _serialization as ser
from .._agent import AgentState, RpcAgent
from .._agent.runtime import Runtime, current
from .._autograd.backward import AutogradContainer
from .._base import devices, threads as _threads
from .._base.errors import RendezvousError, RpcStateError, RRefError, not_initialized
from .._base.options import channel_allowed
from .._base.worker_record import WorkerRecord
from .._rref import RRefContext
from .._wire.channels.link import local_offer
from .._wire.auth import JobAuth
from .._wire.listener import Listener, host_identity
from . import membership as _membership
from . import rejoin as _rejoin
from . import sessions as _sessions
from .collectives import Collectives
from .rendezvous import hosts_store, join, open_store

log = logging.getLogger("torchwire")

_init_lock = threading.Lock()


def start(name: str, rank: int, world_size: int | None, options) -> Runtime:
    """Join the job and start serving (``init_rpc`` after its argument checks).

    Raises:
        RpcStateError: RPC is already initialized in this process.
        ValueError, RendezvousError: see ``torchwire.rpc.init_rpc``.
    """
    with _init_lock:
        rt = current.runtime
        if rt is not None and rt.agent.state is not AgentState.CLOSED:
            raise RpcStateError("RPC is already initialized in this process; "
                                "call torchwire.rpc.shutdown() first")
        timeout = options.init_timeout or options.rpc_timeout or 60.0
        deadline = time.monotonic() + timeout  # one budget for the store and the join
        auth = JobAuth.from_options(options)  # bad TLS files fail here, before the store
        store, rank, world_size, store_host, session = _open_session(options, rank,
                                                                    world_size, deadline)
        listener = Listener(_listen_host(options, store_host), 0)
        membership = None
        try:
            record = _record(name, rank, options, listener, store_host, auth)
            if world_size is None:  # a dynamic group: members join and leave as they go
                membership = _membership.join(store, record, deadline, timeout,
                                              hosts_store(options.init_method, rank))
                _sessions.joined(session)
                records, job = membership.records, membership.job
            else:
                found, job = join(store, rank, world_size, record,
                                  max(0.001, deadline - time.monotonic()),
                                  hosts_store(options.init_method, rank))
                _sessions.joined(session)
                records = [WorkerRecord.from_json(r) for r in found]
                devices.check_all(records)  # the same data on every worker: the same error
            warn_if_unauthenticated(records, auth, rank)
            router = devices.Router(name, records)
            ser.hooks.set_device_router(router.target if router else None,
                                        cpu_routed=router.routes_cpu, ipc=router.ipc,
                                        here=router.rank)
            agent = RpcAgent(name, rank, world_size, options, store, store_host, listener,
                             records, auth.bind(job))
        except BaseException:
            if membership is not None:
                membership.abort()
            listener.close()
            raise
        rt = Runtime(agent, RRefContext(agent), AutogradContainer(agent), membership,
                     Collectives())
        agent.add_plugin(rt.rrefs)
        agent.add_plugin(rt.autograd)
        agent.add_plugin(rt.collectives)  # a lost worker ends the _all_gather waits for it
        if membership is not None:
            membership.bind(agent)
            agent.set_membership(membership)
        else:
            agent.set_admission(_rejoin.StaticAdmission(store, agent))
        # Published before it serves: a peer's first request may run as soon as it does
        # (and a dynamic group's members call it before attach returns).
        current.runtime = rt
        agent.start()
        if membership is not None:
            try:
                membership.attach(deadline)  # every member learns of this worker
            except BaseException:
                current.runtime = None
                raise
        elif record.get("incarnation", 0) > 0:  # a restarted worker took its rank back
            _rejoin.announce(agent, record, deadline)
        return rt


def _open_session(options, rank: int, world_size: int | None, deadline: float):
    """``open_store``, then the session to join: a new one if this process took part
    in the store's last one, or that one is over (``sessions.py``).  A store that
    fails meanwhile (its host left; a new one may come up on the same address) is
    opened again until ``deadline``.

    Returns:
        ``(store, rank, world_size, store_host, session)``.
    """
    while True:
        timeout = max(0.001, deadline - time.monotonic())
        store, rank, world_size, store_host = open_store(options.init_method, rank,
                                                         world_size, timeout)
        try:
            if world_size is None:
                store, session = _sessions.enter_dynamic(store, deadline)
            else:
                store, session = _sessions.enter(store, rank, world_size, deadline)
            return store, rank, world_size, store_host, session
        except _sessions.StoreLost as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("torchwire: the rendezvous store failed while rank %d waited for its "
                     "next session (%s); opening it again", rank, exc)
            time.sleep(0.01)


def stop(graceful: bool, timeout: float, delete_users=None, ignore_leak: bool = True) -> None:
    """Stop this worker's runtime (``shutdown``); ``current`` is cleared after, whatever
    happened.

    Args:
        graceful: wait for the other workers and for outstanding work.
        timeout: bound on the graceful wait, in seconds (inf: as long as they live).
        delete_users: what deletes this worker's user RRefs once every worker shuts
            down (torch's ``rpc.api._delete_all_user_and_unforked_owner_rrefs``).
        ignore_leak: False: a graceful shutdown that still finds RRefs referenced
            elsewhere raises "Leaking RRef".

    Raises:
        RpcStateError: RPC is not initialized.
        RpcTimeoutError: the graceful phase passed its timeout, or the store is gone.
        RRefError: "Leaking RRef" (with ``ignore_leak=False``).
    """
    rt = current.runtime
    if rt is None or rt.agent.state is AgentState.CLOSED:
        raise not_initialized()
    if graceful and _threads.in_torchwire_thread():
        # it would wait for the outstanding work, its own call (or callback) included,
        # whose caller waits for it in turn
        raise RpcStateError("a graceful rpc.shutdown() cannot run inside a function or "
                            "callback that RPC runs (it would wait for itself); call it "
                            "from the program's own thread, or use graceful=False")
    agent = rt.agent
    if delete_users is not None:
        rt.rrefs.delete_users = delete_users
    try:
        agent.shutdown(graceful, timeout)
        leaks = rt.rrefs.leaks() if graceful and not ignore_leak else []
    finally:
        with _init_lock:
            if current.runtime is rt:
                current.runtime = None
    if leaks:
        raise RRefError(f"Leaking RRef(s) on {agent.name} at shutdown: " + "; ".join(leaks))


def warn_if_unauthenticated(records: list[WorkerRecord], auth: JobAuth, rank: int) -> bool:
    """Log one warning (on the lowest rank) when the job spans hosts and its connections
    are authenticated only by the token in the rendezvous store.  Returns whether it did."""
    hosts = {r.host for r in records}
    if auth.source != "rendezvous" or len(hosts) < 2 or rank != min(r.rank for r in records):
        return False
    log.warning(
        "torchwire: this job's workers run on %d hosts and no auth_secret (or "
        "TORCHWIRE_SECRET) is set, so connections are authenticated only by a random token "
        "kept in the rendezvous store: anyone who can read the store can join the job and "
        "run code on every worker (RPC unpickles what it receives). Give every worker the "
        "same auth_secret (and TLS files to encrypt the links).", len(hosts))
    return True


def _record(name: str, rank: int, options, listener: Listener, store_host, auth) -> dict:
    """This worker's rendezvous record (JSON: the store is not trusted with pickles)."""
    tcp = list(listener.tcp_address)
    if ipaddress.ip_address(tcp[0]).is_unspecified:  # every interface: name one
        tcp[0] = _route_host(store_host)
    record = {"name": name, "rank": rank, "host": host_identity(),
              "tcp": tcp, "unix": listener.unix_address,
              "pid": os.getpid(), "security": auth.record(),
              "max_message_size": int(options.max_message_size)}
    record.update(local_offer(shm=channel_allowed(options, "shm")))
    record.update(devices.encode(options.device_maps, options.devices))
    return record


def _listen_host(options, store_host: str | None) -> str:
    """``listen_addr`` if set (``0.0.0.0`` = every interface), else the route to the store."""
    explicit = getattr(options, "listen_addr", None) or os.environ.get("TORCHWIRE_LISTEN_ADDR")
    if explicit:
        return explicit
    return _route_host(store_host)


def _route_host(store_host: str | None) -> str:
    if store_host is None:
        return "127.0.0.1"
    try:
        addr = socket.getaddrinfo(store_host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return "127.0.0.1"
    if ipaddress.ip_address(addr).is_loopback:
        return "127.0.0.1" if ":" not in addr else "::1"
    # The local address of the interface that routes to the store host (no packet is sent).
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((addr, 9))
            return probe.getsockname()[0]
        except OSError as exc:
            raise RendezvousError(f"no interface routes to the rendezvous host {store_host} "
                                  f"({exc}); set listen_addr") from exc
