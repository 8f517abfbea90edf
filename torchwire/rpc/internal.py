"""``torchwire.rpc.internal``: the RPC pickler, as ``torch.distributed.rpc.internal``.

Also torch's small helpers of the same module that programs and torch's tests import:
:class:`RPCExecMode`, :data:`PythonUDF`, :func:`_build_rpc_profiling_key`.
"""

from __future__ import annotations

import collections
import enum
from typing import Any

import torch

from .. import _serialization as ser


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` as RPC would (tensors in a side table): ``(payload, tensors)``.

    Raises:
        RuntimeError: ``obj`` holds a deleted user RRef ("Cannot call fork an UserRRef
            after deletion.").
        SerializationError: it cannot be pickled.
    """
    payload, tensors, sent = ser.dumps_to(obj, -1, False)
    if sent is not None:
        sent.abort()  # nothing is sent: undo any fork it made
    return payload, tensors


def deserialize(payload: bytes, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`serialize` (the tensors as returned by it)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return ser.loads(payload, flat)


class RPCExecMode(enum.Enum):
    """How a call is made (torch's enum; its profiling keys use the values)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
PythonUDF.__doc__ = "A Python function call: ``func(*args, **kwargs)`` (torch's record)."


class _InternalRPCPickler:
    """torch's pickler object: :func:`serialize` and :func:`deserialize` as methods."""

    def serialize(self, obj: Any) -> tuple[bytes, list[torch.Tensor]]:
        return serialize(obj)

    def deserialize(self, binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
        return deserialize(binary_data, tensor_table)


_internal_rpc_pickler = _InternalRPCPickler()


def _build_rpc_profiling_key(exec_type: RPCExecMode, func_name: str,
                             current_worker_name: str, dst_worker_name: str) -> str:
    """torch's name of a call's profiling event: ``rpc_sync#f(worker0 -> worker1)``."""
    return f"rpc_{exec_type.value}#{func_name}({current_worker_name} -> {dst_worker_name})"
