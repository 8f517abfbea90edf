"""Invoking: what every call to a remote function goes through before the agent sends it.

The public ``rpc_sync``/``rpc_async`` and RRef proxies share it: the runtime check,
the destination lookup, the arguments' shape and the timeout, and the collection of
futures that torch's private ``_wait_all`` block waits for.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._base.options import resolve_timeout
from .._base.worker_info import WorkerInfo
from .runtime import require_agent

if TYPE_CHECKING:
    from .future import Future

# torch's name (``rpc.api._thread_local_var``): inside ``_wait_all()`` its
# ``future_list`` collects the futures ``rpc_async`` returns on this thread
_thread_local_var = threading.local()


def check_call(to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: Any
               ) -> tuple[Any, WorkerInfo, tuple[Any, ...] | None, dict[str, Any] | None, float]:
    """Validate a call.

    Returns:
        ``(agent, destination WorkerInfo, args as a tuple or None, kwargs, timeout in s)``.

    Raises:
        RpcStateError: RPC is not initialized.
        TypeError: ``func`` is not callable, ``args`` a tensor or not iterable,
            ``kwargs`` not a dict, a bad timeout type.
        ValueError: ``to`` is None, a negative or NaN timeout.
        UnknownWorkerError: ``to`` names no worker of the job.
    """
    agent = require_agent()
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    if args is not None and not isinstance(args, tuple):
        args = _as_tuple(args)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if to is None:  # an unset variable, most likely: not this worker
        raise ValueError("Cannot get WorkerInfo from name None: pass a worker name, rank or "
                         "WorkerInfo")
    info = agent.get_worker_info(to)
    return agent, info, args, kwargs, resolve_timeout(timeout, agent.rpc_timeout)


def _as_tuple(args: Any) -> tuple[Any, ...]:
    """``args`` given as a list or another iterable, as a tuple.

    Raises:
        TypeError: a tensor (``args=(t)`` for ``args=(t,)``: its rows would become the
            arguments), or not iterable.
    """
    if isinstance(args, torch.Tensor):
        raise TypeError("args must be a tuple of arguments, got a Tensor (for one tensor "
                        "argument write args=(t,))")
    try:
        return tuple(args)
    except TypeError:
        raise TypeError(f"args must be a tuple of arguments, got {type(args).__name__}"
                        ) from None


def invoke_async(to: Any, func: Callable[..., Any], args: Any, kwargs: Any,
                 timeout: Any) -> Future:
    """``rpc_async``: send the call, return its future (collected inside ``_wait_all``)."""
    agent, info, args, kwargs, timeout = check_call(to, func, args, kwargs, timeout)
    fut = agent.call(info, func, args, kwargs, timeout)
    # (the thread's own dict: getattr() would raise and catch an AttributeError)
    collected = _thread_local_var.__dict__.get("future_list")
    if collected is not None:
        collected.append(fut)
    return fut


def invoke_sync(to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: Any) -> Any:
    """``rpc_sync``: send the call and wait for its result."""
    agent, info, args, kwargs, timeout = check_call(to, func, args, kwargs, timeout)
    return agent.call(info, func, args, kwargs, timeout, None, True).wait()
