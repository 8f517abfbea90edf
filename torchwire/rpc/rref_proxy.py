"""``torchwire.rpc.rref_proxy``, as ``torch.distributed.rpc.rref_proxy``.

:class:`RRefProxy` is what ``rref.rpc_sync()``, ``rref.rpc_async()`` and
``rref.remote()`` stand for: attribute access names a method of the RRef's value,
and calling it runs that method on the value's owner through ``rpc_api``.
"""

from __future__ import annotations

from typing import Any, Callable

from .._base.options import UNSET_RPC_TIMEOUT
from .._rref import RRef
from .api import remote, rpc_async, rpc_sync

__all__ = ["RRefProxy"]

# each RPC function and the RRef method that makes its proxy
_PROXY_OF = {rpc_sync: "rpc_sync", rpc_async: "rpc_async", remote: "remote"}


class RRefProxy:
    """A proxy of ``rref``: ``RRefProxy(rref, rpc.rpc_sync).method(*args)`` runs
    ``method`` on the owner, like ``rref.rpc_sync().method(*args)``.

    Args:
        rref: the RRef whose value's methods are called.
        rpc_api: ``rpc_sync``, ``rpc_async`` or ``remote`` of ``torchwire.rpc``.
        timeout: seconds for each call (-1: the default ``rpc_timeout``; 0: no limit).

    Raises:
        ValueError: ``rpc_api`` is none of the three.
    """

    def __init__(self, rref: RRef, rpc_api: Callable[..., Any],
                 timeout: float = UNSET_RPC_TIMEOUT) -> None:
        if rpc_api not in _PROXY_OF:
            raise ValueError(f"rpc_api must be torchwire.rpc.rpc_sync, rpc_async or remote, "
                             f"got {rpc_api!r}")
        self.rref = rref
        self.rpc_api = rpc_api
        self.rpc_timeout = timeout

    def __getattr__(self, func_name: str) -> Callable[..., Any]:
        proxy = getattr(self.rref, _PROXY_OF[self.rpc_api])(self.rpc_timeout)
        method: Callable[..., Any] = getattr(proxy, func_name)
        return method

    def __repr__(self) -> str:
        return f"<RRefProxy {_PROXY_OF[self.rpc_api]} of {self.rref}>"
