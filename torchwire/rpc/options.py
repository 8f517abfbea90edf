"""``torchwire.rpc.options``, as ``torch.distributed.rpc.options``.

Also where options made for torch become torchwire's: :func:`adopt` takes torch's own
``TensorPipeRpcBackendOptions`` (made before ``torchwire.patch`` or without it, or a
subclass of it) and carries its fields over.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .._base.options import (RpcBackendOptions, TensorPipeRpcBackendOptions,
                             TorchwireRpcBackendOptions)

__all__ = ["TensorPipeRpcBackendOptions", "TorchwireRpcBackendOptions"]

DeviceType = int | str | torch.device

try:  # torch's options classes, where this torch build has RPC
    from torch._C._distributed_rpc import RpcBackendOptions as _TorchOptions
    from torch._C._distributed_rpc import _TensorPipeRpcBackendOptionsBase as _TorchTP
except ImportError:  # pragma: no cover - a torch built without distributed
    _TorchOptions = _TorchTP = ()  # type: ignore[assignment, misc]

# the fields a torch options object may carry over: every keyword of torchwire's class
_FIELDS = [p.name for p in inspect.signature(TorchwireRpcBackendOptions).parameters.values()
           if p.kind is p.KEYWORD_ONLY]


def adopt(options: Any, backend_given: bool) -> TorchwireRpcBackendOptions:
    """``options`` as torchwire's options: torchwire's as they are; torch's TensorPipe
    options (or a subclass) converted, field by field.

    Raises:
        TypeError: another backend's options, with torch's messages (code matches on
            them): "Could not infer backend for options" without a backend,
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`" with one;
            not options at all: "must be an instance of RpcBackendOptions".
    """
    if isinstance(options, TorchwireRpcBackendOptions):
        return options
    if isinstance(options, _TorchTP):
        return _from_torch(options)
    if not isinstance(options, (RpcBackendOptions, _TorchOptions)):
        raise TypeError("Argument rpc_backend_options must be an instance of "
                        f"RpcBackendOptions, got {type(options).__name__}")
    if not backend_given:
        raise TypeError(f"Could not infer backend for options {options!r}: pass "
                        "torchwire.rpc.TensorPipeRpcBackendOptions")
    raise TypeError("`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` "
                    f"(torchwire.rpc.TorchwireRpcBackendOptions), got {type(options).__name__}")


def _from_torch(options: Any) -> TorchwireRpcBackendOptions:
    fields = {}
    for name in _FIELDS:
        try:
            value = getattr(options, name)
        except AttributeError:
            continue
        if name in ("device_maps", "devices") and not value:
            continue  # torch's empty defaults
        fields[name] = value
    return TorchwireRpcBackendOptions(**fields)
