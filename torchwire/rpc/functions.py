"""``torchwire.rpc.functions``: decorators for functions run through RPC."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["async_execution"]


def async_execution(fn: _F) -> _F:
    """Mark ``fn`` as returning a :class:`torch.futures.Future` to reply with.

    The callee runs ``fn``, which returns a future at once; the pool thread is
    freed, and the reply is sent when the future completes.  Works on plain
    functions, static methods and class methods (put this decorator *inside*
    ``@staticmethod`` / ``@classmethod``), exactly as in torch.

    Example::

        >>> @rpc.functions.async_execution
        ... def async_add_chained(to, x, y, z):
        ...     return rpc.rpc_async(to, torch.add, args=(x, y)).then(
        ...         lambda fut: fut.wait() + z)
        >>> rpc.rpc_sync("worker1", async_add_chained,
        ...              args=("worker2", torch.ones(2), 1, 1))
        tensor([3., 3.])
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
