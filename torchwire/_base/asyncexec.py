"""``@rpc.functions.async_execution``: the mark it leaves on a function, and its rule.

A function so marked returns a future; the reply is sent when the future completes,
and no thread waits for it meanwhile.  The mark is torch's attribute, so functions
decorated by torch's decorator are recognized too.
"""

from __future__ import annotations

import torch

from .errors import RemoteCallError

# torch's name for the mark (the wrapped function); torch's own code reads it too
ASYNC_ATTR = "_wrapped_async_rpc_function"


def is_async(func) -> bool:
    """Whether ``func`` is marked ``@async_execution``."""
    return getattr(func, ASYNC_ATTR, None) is not None


def check_future(func, result) -> None:
    """An ``@async_execution`` function must return a future.

    Raises:
        RemoteCallError: it returned something else (torch's wording first:
            "Functions decorated with @rpc.async_function must return a
            torch.futures.Future object", which ported error handling matches on).
    """
    if not isinstance(result, torch._C.Future):
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func
        raise RemoteCallError(
            "Functions decorated with @rpc.async_function must return a "
            f"torch.futures.Future object, but {name} (@rpc.functions.async_execution) "
            f"returned {type(result).__name__}")
