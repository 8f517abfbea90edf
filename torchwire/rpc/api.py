"""The public RPC functions: validate, then call the agent."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time

import torch

from .. import _rref
from .._base import devices as _devices
from .._bootstrap import membership as _membership
from .. import _serialization as ser
from .._agent import AgentState, RpcAgent
from .._base.errors import RendezvousError, RpcStateError
from .._agent.future import Future
from .._rref import RRef
from .._base.worker_info import check_worker_name
from .._bootstrap.rendezvous import hosts_store, join, open_store
from .._wire import cma, shm
from .._wire.auth import JobAuth
from .._wire.listener import Listener, host_identity
from .._base.worker_info import WorkerInfo
from . import _gather
from ._gather import _all_gather, _barrier, _wait_all_workers  # noqa: F401 - torch's private API
from .._base.options import channel_allowed
from .._base.options import (DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT, BackendType,
                       RpcBackendOptions, TorchwireRpcBackendOptions)

log = logging.getLogger("torchwire")

_agent: RpcAgent | None = None
_init_lock = threading.Lock()

# As torch: a graceful shutdown that finds RRefs still referenced somewhere raises
# "Leaking RRef" only when this is set to False.
_ignore_rref_leak = True


def _require_agent() -> RpcAgent:
    agent = _agent
    if agent is None or agent.state is AgentState.CLOSED:
        # Starts with torch's phrase for the API functions: ported code matches on it.
        raise RpcStateError("RPC has not been initialized, or has been shut down: call "
                            "torchwire.rpc.init_rpc first")
    return agent


def _get_current_rpc_agent() -> RpcAgent:
    agent = _agent
    if agent is None or agent.state is AgentState.CLOSED:
        # torch's phrase for the agent lookup (RRef constructors say the same)
        raise RpcStateError("Current RPC agent is not set! Did you initialize the RPC "
                            "framework (torchwire.rpc.init_rpc)? It has not been initialized "
                            "or has been shut down")
    return agent


def is_available() -> bool:
    """torchwire RPC is always available (it needs no special torch build)."""
    return True


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


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None) -> None:
    """Join the job as worker ``name`` and start serving RPCs.

    With a world size, blocks until every worker of the job has joined (or the init
    timeout passes).  Without one (neither ``world_size``, ``?world_size=`` in the
    ``init_method`` nor ``WORLD_SIZE``), joins a dynamic group: it returns once the
    members that joined before know this worker; later ones may join, and any
    member may leave with :func:`shutdown`.

    Args:
        name: globally unique name (letters, digits, ``_``, ``-``, ``:``; < 128 chars).
        backend: ``None`` or a :class:`BackendType` (all map to torchwire's backend).
        rank: this worker's rank, ``0 <= rank < world_size`` (a dynamic group: unique,
            0..32767); taken from ``RANK`` if -1.
        world_size: number of workers; taken from ``WORLD_SIZE`` if ``None``; neither:
            a dynamic group.
        rpc_backend_options: a :class:`TorchwireRpcBackendOptions`.

    Raises:
        ValueError: bad name, rank or world size, or bad ``init_method``.
        RendezvousError: duplicate name or rank, unreachable store, missing peers; a
            static and a dynamic member in one store; the dynamic group's lock not
            had within the init timeout.
        RpcStateError: RPC is already initialized in this process.

    Example::

        >>> # worker0                               # worker1
        >>> rpc.init_rpc("worker0", rank=0,         rpc.init_rpc("worker1", rank=1,
        ...              world_size=2)                           world_size=2)
        >>> rpc.rpc_sync("worker1", torch.add,      rpc.shutdown()
        ...              args=(torch.ones(2), 1))
        >>> rpc.shutdown()
    """
    global _agent
    check_worker_name(name)
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}")
    if rank is None:
        rank = -1
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    options = rpc_backend_options if rpc_backend_options is not None \
        else TorchwireRpcBackendOptions()
    options = _adopt_options(options, backend)
    with _init_lock:
        if _agent is not None and _agent.state is not AgentState.CLOSED:
            raise RpcStateError("RPC is already initialized in this process; "
                                "call torchwire.rpc.shutdown() first")
        timeout = options.init_timeout or options.rpc_timeout or 60.0
        deadline = time.monotonic() + timeout  # one budget for the store and the join
        auth = JobAuth.from_options(options)  # bad TLS files fail here, before the store
        store, rank, world_size, store_host = open_store(options.init_method, rank,
                                                         world_size, timeout)
        listener = Listener(_listen_host(options, store_host), 0)
        membership = None
        try:
            tcp = list(listener.tcp_address)
            if ipaddress.ip_address(tcp[0]).is_unspecified:  # every interface: name one
                tcp[0] = _route_host(store_host)
            record = {"name": name, "rank": rank, "host": host_identity(),
                      "tcp": tcp, "unix": listener.unix_address,
                      "pid": os.getpid(), "cma": cma.probe_record(), "security": auth.record(),
                      "shm": shm.available() and channel_allowed(options, "shm")}
            record.update(_devices.encode(options.device_maps, options.devices))
            if world_size is None:  # a dynamic group: members join and leave as they go
                membership = _membership.join(store, record, deadline, timeout,
                                              hosts_store(options.init_method, rank))
                records, job = membership.records, membership.job
            else:
                records, job = join(store, rank, world_size, record,
                                   max(0.001, deadline - time.monotonic()))
                _devices.check_all(records)  # the same data on every worker: the same error
            router = _devices.Router(name, records)
            ser.hooks.set_device_router(router.target if router else None)
            agent = RpcAgent(name, rank, world_size, options, store, store_host, listener,
                             records, auth.bind(job))
        except BaseException:
            if membership is not None:
                membership.abort()
            listener.close()
            raise
        ctx = _rref.start(agent)
        _gather._reset()
        # Published before it serves: a peer's first request may run as soon as it does
        # (and a dynamic group's members call it before attach returns).
        _agent = agent
        agent.start()
        if membership is not None:
            try:
                membership.attach(agent, deadline)  # every member learns of this worker
            except BaseException:
                _agent = None
                _rref.stop(ctx)
                raise


def _adopt_options(options, backend):
    """Accept torchwire's options, or torch's TensorPipe options (converted)."""
    if isinstance(options, TorchwireRpcBackendOptions):
        return options
    try:
        from torch._C._distributed_rpc import _TensorPipeRpcBackendOptionsBase as torch_tp
    except ImportError:
        torch_tp = ()
    if not isinstance(options, torch_tp):
        # torch's phrases: code that handles these errors matches on them
        if not isinstance(options, RpcBackendOptions):
            raise TypeError("Argument rpc_backend_options must be an instance of "
                            f"RpcBackendOptions, got {type(options).__name__}")
        if backend is None:
            raise TypeError(f"Could not infer backend for options {options!r}: pass "
                            "torchwire.rpc.TensorPipeRpcBackendOptions")
        raise TypeError("`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` "
                        f"(torchwire.rpc.TorchwireRpcBackendOptions), got "
                        f"{type(options).__name__}")
    try:
        return TorchwireRpcBackendOptions(
            num_worker_threads=getattr(options, "num_worker_threads", 16),
            rpc_timeout=getattr(options, "rpc_timeout", 60.0),
            init_method=getattr(options, "init_method", "env://"),
            device_maps=getattr(options, "device_maps", None) or None,
            devices=getattr(options, "devices", None) or None,
            _transports=getattr(options, "_transports", None),
            _channels=getattr(options, "_channels", None))
    except AttributeError as exc:
        raise TypeError(f"rpc_backend_options must be TorchwireRpcBackendOptions, got "
                        f"{type(options).__name__}") from exc


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker's RPC agent.

    With ``graceful=True`` (default) it blocks until every worker has called
    ``shutdown`` and all outstanding work in the job has finished, then closes
    everything.  In a dynamic group (``init_rpc`` without a world size) it leaves
    the group instead: once its own calls have finished, every other member stops
    calling it, finishes its calls in flight to it and forgets it; the store's host
    (rank 0 of ``tcp://``/``env://``) then waits until the others have left.
    ``graceful=False`` closes this worker at once.

    Args:
        graceful: wait for the other workers and for outstanding work.
        timeout: bound on the graceful wait in seconds; 0 (default) waits as long as
            the workers that have not arrived are alive (a dead worker ends the wait).

    Raises:
        RpcStateError: RPC is not initialized.
        RpcTimeoutError: the graceful phase timed out or a worker died (the local
            shutdown is still carried out).
    """
    global _agent
    agent = _require_agent()
    if timeout is None or timeout <= 0:
        timeout = float("inf")
    ctx = _rref._ctx
    try:
        agent.shutdown(graceful, timeout)
        leaks = ctx.leaks() if graceful and ctx is not None and not _ignore_rref_leak else []
    finally:
        if ctx is not None:
            _rref.stop(ctx)
        with _init_lock:
            if _agent is agent:
                _agent = None
    if leaks:
        raise RuntimeError(f"Leaking RRef(s) on {agent.name} at shutdown: " + "; ".join(leaks))


def _delete_all_user_and_unforked_owner_rrefs(timeout=None) -> None:
    """Delete every user RRef of this worker (graceful shutdown calls it, as torch's)."""
    ctx = _rref._ctx
    if ctx is not None:
        ctx.delete_all_users()


def _rref_context_get_debug_info() -> dict[str, int]:
    """RRef counters of this worker: ``num_owner_rrefs`` (values with forks elsewhere),
    ``num_forks``, ``num_live_values`` (every value owned here that is still alive),
    ``num_pending_users``, ``num_pending_children``, ``num_user_rrefs``."""
    _require_agent()
    return _rref.debug_info()


def get_worker_info(worker_name=None) -> WorkerInfo:
    """:class:`WorkerInfo` of ``worker_name`` (a name or rank), or of this worker if ``None``.

    Raises:
        UnknownWorkerError: no worker has that name.
        RpcStateError: RPC is not initialized.
    """
    return _require_agent().get_worker_info(worker_name)


def stats() -> dict:
    """This worker's counters: calls sent and served, pending calls, connections, bytes.

    torchwire addition (torch has no equivalent); handy for monitoring and tests.
    """
    return _require_agent().stats()


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds, as set by ``rpc_timeout``."""
    return _require_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of calls (seconds; 0 = no limit), like torch's private one."""
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) \
            or rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0 seconds, got {rpc_timeout!r}")
    _require_agent().rpc_timeout = float(rpc_timeout)


def _resolve_timeout(agent: RpcAgent, timeout) -> float:
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return agent.rpc_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0 = no limit) or -1 for the default, "
                         f"got {timeout}")
    return float(timeout)


def _invoke(to, func, args, kwargs, timeout) -> Future:
    agent, info, args, kwargs, timeout = _check_call(to, func, args, kwargs, timeout)
    return agent.call(info, func, args, kwargs, timeout)


def _check_call(to, func, args, kwargs, timeout):
    agent = _require_agent()
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    if args is not None and not isinstance(args, tuple):
        args = tuple(args)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    world = agent.world_size  # None: a dynamic group, whose members change
    info = to if isinstance(to, WorkerInfo) and world is not None and 0 <= to.id < world else \
        agent.get_worker_info(to)
    return agent, info, args, kwargs, _resolve_timeout(agent, timeout)


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and keep the result there.

    Returns at once a user :class:`RRef` to the result; the callee owns the value.
    Fetch it with ``rref.to_here()``, or call its methods where it lives with
    ``rref.rpc_sync().method(...)``.

    Args:
        to, func, args, kwargs: as :func:`rpc_async`.
        timeout: seconds for the creation; -1 uses the default ``rpc_timeout``, 0
            means no limit.  If it passes, ``to_here()`` and proxies raise
            "RRef creation via rpc.remote() timed out".

    Raises:
        SerializationError, UnknownWorkerError, RpcStateError: as :func:`rpc_async`.

    Example::

        >>> rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> x = rref1.to_here() + rref2.to_here()
    """
    agent, info, args, kwargs, timeout = _check_call(to, func, args, kwargs, timeout)
    return _rref._require_ctx().remote(info, func, args, kwargs, timeout)


# torch's name; torch's tests check that ``future_list`` is gone after _wait_all
_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all():
    """Collect every future ``rpc_async`` returns in the block; wait for them at its end
    (torch's private helper)."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT) -> Future:
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a future of the result.

    Args:
        to: destination worker's name, rank or :class:`WorkerInfo`.
        func: a picklable callable: Python function, builtin, torch op, or
            ``@torch.jit.script`` function.
        args, kwargs: its arguments.
        timeout: seconds; -1 uses the default ``rpc_timeout``, 0 means no limit.

    Returns:
        A :class:`torch.futures.Future` that completes with the return value,
        or with the remote exception (same type, message, remote worker and
        traceback), a timeout error, or an error naming an unavailable worker.

    Raises:
        SerializationError: the arguments cannot be pickled (nothing was sent).
        UnknownWorkerError: ``to`` is not a worker of this job.
        RpcStateError: RPC is not initialized or was shut down.

    Example::

        >>> fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
        >>> fut1.wait() + fut2.wait()
        tensor([5., 5.])
    """
    fut = _invoke(to, func, args, kwargs, timeout)
    # (the thread's own dict: getattr() would raise and catch an AttributeError)
    collected = _thread_local_var.__dict__.get("future_list")
    if collected is not None:
        collected.append(fut)
    return fut


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Same arguments as :func:`rpc_async`; blocks until the reply arrives.

    Raises:
        Exception: the remote function's exception, rebuilt with its type.
        RpcTimeoutError: no reply within ``timeout`` ("RPC ran for more than set timeout").
        WorkerUnavailableError: the destination is gone.
        SerializationError, UnknownWorkerError, RpcStateError: as :func:`rpc_async`.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    agent, info, args, kwargs, timeout = _check_call(to, func, args, kwargs, timeout)
    return agent.call(info, func, args, kwargs, timeout, None, True).wait()


