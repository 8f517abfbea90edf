"""The public RPC functions: validate, then call the layers below.

``init_rpc`` and ``shutdown`` hand over to the bootstrap layer, which wires the
runtime together; calls go through the agent's invoking functions; ``remote`` to
the RRef layer.  Names that torch's ``rpc.api`` has privately and that programs and
torch's tests use (``_all_gather``, ``_wait_all``, ``_thread_local_var``,
``_delete_all_user_and_unforked_owner_rrefs``, ...) are here too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _rref
from .._agent.future import Future
from .._agent.invoke import _thread_local_var, check_call, invoke_async
from .._agent.runtime import current, require_agent, require_runtime
from .._base.options import (DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT,
                             TorchwireRpcBackendOptions)
from .._base.worker_info import WorkerInfo, check_worker_name
from .._bootstrap import runtime as _runtime
from .._bootstrap.collectives import AllGatherStates
from .._bootstrap.collectives import (_all_gather, _barrier,  # noqa: F401 - torch's private API
                                      _broadcast_to_followers, _gather_to_leader,
                                      _wait_all_workers)
from .._rref import RRef
from . import backend_registry
from . import options as _options
from ._unsupported import _use_rpc_pickler  # noqa: F401 - torch's private API

log = logging.getLogger("torchwire")

# As torch: a graceful shutdown that finds RRefs still referenced somewhere raises
# "Leaking RRef" only when this is set to False.
_ignore_rref_leak = True


def _get_current_rpc_agent() -> Any:
    """The current agent (torch's private lookup: "Current RPC agent is not set" otherwise)."""
    return require_agent(lookup=True)


def _is_current_rpc_agent_set() -> bool:
    """Whether this process has a running agent (torch's private check)."""
    try:
        require_agent(lookup=True)
    except RuntimeError:
        return False
    return True


def is_available() -> bool:
    """torchwire RPC is always available (it needs no special torch build)."""
    return True


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: Any = None) -> None:
    """Join the job as worker ``name`` and start serving RPCs.

    With a world size, blocks until every worker of the job has joined (or the init
    timeout passes).  Without one (neither ``world_size``, ``?world_size=`` in the
    ``init_method`` nor ``WORLD_SIZE``), joins a dynamic group: it returns once the
    members that joined before know this worker; later ones may join, and any
    member may leave with :func:`shutdown`.

    Args:
        name: globally unique name (letters, digits, ``_``, ``-``, ``:``; < 128 chars).
        backend: ``None`` or ``BackendType.TENSORPIPE`` (torchwire's backend; also
            torch's own ``BackendType.TENSORPIPE``).
        rank: this worker's rank, ``0 <= rank < world_size`` (a dynamic group: unique,
            0..32767); taken from ``RANK`` if -1.
        world_size: number of workers; taken from ``WORLD_SIZE`` if ``None``; neither:
            a dynamic group.
        rpc_backend_options: a :class:`TorchwireRpcBackendOptions`, or torch's
            ``TensorPipeRpcBackendOptions`` (its fields are carried over).

    Raises:
        TypeError: ``backend`` is not a ``BackendType``; the options are another
            backend's (torch's messages).
        NotImplementedError: ``backend`` is one registered with ``register_backend``.
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
    check_worker_name(name)
    if backend is not None:
        backend = backend_registry.resolve(backend)
        if not backend_registry.is_torchwire(backend):
            raise NotImplementedError(
                f"torchwire.rpc.init_rpc starts torchwire's own backend only, not "
                f"{backend!r} (registered with register_backend)")
    if rank is None:
        rank = -1
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    options = rpc_backend_options if rpc_backend_options is not None \
        else TorchwireRpcBackendOptions()
    options = _options.adopt(options, backend is not None)
    backend_registry.init_backend(backend or backend_registry.BackendType.TENSORPIPE,
                                  None, name, rank, world_size, options)


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

    A worker that died or froze does not make it fail: the others shut down without
    it and log a warning naming it.

    Raises:
        RpcStateError: RPC is not initialized.
        RpcTimeoutError: the graceful phase passed ``timeout``, or the rendezvous store
            is gone (rank 0 hosted it, with ``tcp://`` or ``env://``, and died); the
            local shutdown is still carried out.
    """
    if timeout is None or timeout <= 0:
        timeout = float("inf")
    # looked up when it runs: torch's tests patch it on this module
    _runtime.stop(graceful, timeout, lambda: _delete_all_user_and_unforked_owner_rrefs(),
                  _ignore_rref_leak)


def _delete_all_user_and_unforked_owner_rrefs(timeout: float | None = None) -> None:
    """Delete every user RRef of this worker (graceful shutdown calls it, as torch's)."""
    rt = current.runtime
    if rt is not None:
        rt.rrefs.delete_all_users()


def _rref_context_get_debug_info() -> dict[str, str]:
    """RRef counters of this worker, as strings (as torch's): torch's keys
    ``num_owner_rrefs`` (values with forks elsewhere), ``num_forks``,
    ``num_pending_futures`` (RRef control messages queued or awaiting their reply),
    ``num_pending_users``; and torchwire's ``num_live_values`` (every value owned here
    that is still alive), ``num_pending_children``, ``num_user_rrefs``."""
    return {k: str(v) for k, v in require_runtime().rrefs.debug_info().items()}


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """:class:`WorkerInfo` of ``worker_name`` (a name or rank), or of this worker if ``None``.

    Raises:
        UnknownWorkerError: no worker has that name.
        RpcStateError: RPC is not initialized.
    """
    info: WorkerInfo = require_agent().get_worker_info(worker_name)
    return info


def stats() -> dict[str, Any]:
    """This worker's counters: calls sent and served, pending calls, connections, bytes;
    and under ``"peers"``, per peer name: ``calls_sent``, ``calls_received``,
    ``bytes_out``, ``bytes_in``, ``replies``, ``latency_p50_s``/``latency_p99_s``/
    ``latency_mean_s`` (from a fixed-size histogram; None before a reply), ``errors``
    (by exception type name) and ``timeouts``.  ``"metrics_url"``: the Prometheus
    endpoint's URL when it is on (``metrics_port``), else None.  ``"polls"``: how the
    readers of open connections polled for the next request after serving
    (``episodes``, ``hits``, ``ceded``: stopped as other threads ran, ``seconds``);
    ``"reply_polls"``: the same for callers that read their own replies and polled
    for them (``rpc_sync``, ``wait()``, an ``await`` on an idle loop).

    torchwire addition (torch has no equivalent); handy for monitoring and tests.
    See docs/guide-observability.md.
    """
    counters: dict[str, Any] = require_agent().stats()
    return counters


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds, as set by ``rpc_timeout``."""
    return float(require_agent().rpc_timeout)


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of calls (seconds; 0 = no limit), like torch's private one."""
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) \
            or rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0 seconds, got {rpc_timeout!r}")
    require_agent().rpc_timeout = float(rpc_timeout)


def remote(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
           kwargs: dict[str, Any] | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
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
    _agent, info, args, kwargs, timeout = check_call(to, func, args, kwargs, timeout)
    rref: RRef = _rref.context().remote(info, func, args, kwargs, timeout)
    return rref


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
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


def rpc_async(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
              kwargs: dict[str, Any] | None = None, timeout: float = UNSET_RPC_TIMEOUT
              ) -> Future:
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a future of the result.

    Args:
        to: destination worker's name, rank or :class:`WorkerInfo`.
        func: a picklable callable: Python function, builtin, torch op, or
            ``@torch.jit.script`` function.
        args, kwargs: its arguments.
        timeout: seconds; -1 uses the default ``rpc_timeout``, 0 (or ``math.inf``)
            means no limit.

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
    return invoke_async(to, func, args, kwargs, timeout)


def rpc_sync(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
             kwargs: dict[str, Any] | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
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
    agent, info, args, kwargs, timeout = check_call(to, func, args, kwargs, timeout)
    return agent.call(info, func, args, kwargs, timeout, None, True).wait()


def method_factory(method_name: str, docstring: str | None) -> Callable[..., Any]:
    """torch's helper that gives ``RRef`` a documented Python method per method of its
    C++ base: here, a function that runs ``RRef``'s own ``method_name``."""
    implementation = _RREF_METHODS[method_name]

    def method(self: RRef, *args: Any, **kwargs: Any) -> Any:
        return implementation(self, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = docstring
    return method


_RREF_METHODS = {name: value for name, value in vars(RRef).items() if callable(value)}
# torch leaves the last method its loop made under this name (RRef.to_here)
new_method = method_factory("to_here", RRef.to_here.__doc__)

__all__ = ["shutdown", "get_worker_info", "remote", "rpc_sync", "rpc_async", "RRef",
           "AllGatherStates", "method_factory", "new_method"]
