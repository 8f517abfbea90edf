"""``torchwire.rpc.backend_registry``, as ``torch.distributed.rpc.backend_registry``.

torch's semantics: :data:`BackendType` is an enum of the registered backends, made
anew by every :func:`register_backend` (so a member taken before a registration
belongs to the enum of its time); a member's value is a :class:`BackendValue` of two
handlers.  torchwire's backend is registered as ``TORCHWIRE`` and as ``TENSORPIPE``
(one member under two names: ``TENSORPIPE`` is what ported programs pass).

torchwire runs its own backend only: another backend can be registered, and its
options constructed, but ``init_rpc`` refuses it (:func:`init_backend` calls its
handler as torch does).
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable

from .._agent.runtime import require_agent
from .._base.options import (DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC,
                             TorchwireRpcBackendOptions)
from .._bootstrap import runtime as _runtime
from . import options as _options

__all__ = ["backend_registered", "register_backend", "construct_rpc_backend_options",
           "init_backend", "BackendValue", "BackendType"]

BackendValue = collections.namedtuple(
    "BackendValue", ["construct_rpc_backend_options_handler", "init_backend_handler"])
BackendValue.__doc__ = "A backend's two handlers: options construction and agent start."

_DOC = """An enum of the registered RPC backends (torch's semantics).

    torchwire's backend is ``BackendType.TENSORPIPE`` (also ``BackendType.TORCHWIRE``);
    :func:`~torchwire.rpc.backend_registry.register_backend` adds others.
"""


def _backend_type_repr(self: enum.Enum) -> str:
    return "BackendType." + self.name


def _make_enum(members: dict[str, BackendValue]) -> Any:
    made = enum.Enum("BackendType", members)  # type: ignore[misc]
    made.__repr__ = _backend_type_repr  # type: ignore[assignment]
    made.__doc__ = _DOC
    made.__module__ = __name__
    return made


BackendType: Any = _make_enum({})


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` was registered with :func:`register_backend`."""
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Callable[..., Any],
                     init_backend_handler: Callable[..., Any]) -> Any:
    """Register a backend: a new :data:`BackendType` with one more member, which is returned.

    Args:
        backend_name: the member's name.
        construct_rpc_backend_options_handler: called by
            :func:`construct_rpc_backend_options` with ``(rpc_timeout, init_method,
            **kwargs)``.
        init_backend_handler: called by :func:`init_backend`; returns the agent.

    Raises:
        RuntimeError: ``backend_name`` is registered already.
    """
    global BackendType
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    # the newest first, as torch: among equal values it is the canonical name
    members = {backend_name: BackendValue(construct_rpc_backend_options_handler,
                                          init_backend_handler)}
    members.update({m: v.value for m, v in BackendType.__members__.items()})
    BackendType = _make_enum(members)
    return BackendType[backend_name]


def construct_rpc_backend_options(backend: Any, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = DEFAULT_INIT_METHOD,
                                  **kwargs: Any) -> Any:
    """Options for ``backend``, built by its handler (torchwire's takes every field of
    :class:`~torchwire.rpc.TorchwireRpcBackendOptions` as a keyword)."""
    return resolve(backend).value.construct_rpc_backend_options_handler(
        rpc_timeout, init_method, **kwargs)


def init_backend(backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Start ``backend``'s agent through its handler and return it.

    torchwire's handler takes torch's arguments ``(store, name, rank, world_size,
    rpc_backend_options)`` and starts the agent as ``init_rpc`` does.
    """
    return resolve(backend).value.init_backend_handler(*args, **kwargs)


def resolve(backend: Any) -> Any:
    """The member of today's :data:`BackendType` that ``backend`` names: a member of this
    enum or of an earlier one (before a registration), or of torch's own ``BackendType``.

    Raises:
        TypeError: ``backend`` is not a ``BackendType`` member, or names a backend that
            is not registered here.
    """
    if isinstance(backend, BackendType):
        return backend
    if isinstance(backend, enum.Enum) and type(backend).__name__ == "BackendType" \
            and backend.name in BackendType.__members__:
        return BackendType[backend.name]
    raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}")


def is_torchwire(backend: Any) -> bool:
    """Whether ``backend`` (a member of :data:`BackendType`) is torchwire's own."""
    return backend.value.init_backend_handler is _init_backend_handler


def _construct_rpc_backend_options_handler(rpc_timeout: float, init_method: str,
                                           **kwargs: Any) -> TorchwireRpcBackendOptions:
    return TorchwireRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                      **kwargs)


def _init_backend_handler(store: Any, name: str, rank: int, world_size: int | None,
                          rpc_backend_options: Any) -> Any:
    if store is not None:
        raise NotImplementedError(
            "torchwire's backend makes its own store from the options' init_method; it "
            "cannot start on a store made by the caller (pass store=None)")
    _runtime.start(name, rank, world_size, _options.adopt(rpc_backend_options, True))
    return require_agent()


register_backend("TORCHWIRE", _construct_rpc_backend_options_handler, _init_backend_handler)
register_backend("TENSORPIPE", _construct_rpc_backend_options_handler, _init_backend_handler)
