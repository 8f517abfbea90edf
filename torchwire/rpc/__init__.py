"""``torchwire.rpc``: a drop-in for ``torch.distributed.rpc``.

Port a program by changing ``import torch.distributed.rpc as rpc`` to
``import torchwire.rpc as rpc``.
"""

from __future__ import annotations

from .._base.errors import (AuthenticationError, CallbackError, ConnectError,
                            ConnectionBrokenError, ConnectionClosedError, DistAutogradError,
                            InvalidWorkerNameError, LinkError, ProtocolError, RemoteCallError,
                            RemoteError, RendezvousError, RpcStateError, RpcTimeoutError,
                            RRefError, SerializationError, TorchwireError, UnknownWorkerError,
                            WorkerUnavailableError)
from .._agent.future import Future, install_wait_all
from .._base.worker_info import WorkerInfo
from . import constants, functions, internal  # noqa: F401
from .._rref import RRef
from . import api  # noqa: F401 - torch has rpc.api too
from .api import _set_rpc_timeout  # noqa: F401 - private, as in torch
from .api import _delete_all_user_and_unforked_owner_rrefs  # noqa: F401
from .api import _get_current_rpc_agent, _rref_context_get_debug_info  # noqa: F401
from .api import (get_rpc_timeout, get_worker_info, init_rpc, is_available, remote,
                  rpc_async, rpc_sync, shutdown, stats)
from .._base.options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,
                             DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT,
                             BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions,
                             TorchwireRpcBackendOptions)

__all__ = [
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef", "get_worker_info",
    "get_rpc_timeout", "is_available", "stats", "WorkerInfo", "BackendType", "functions", "Future",
    "TorchwireRpcBackendOptions", "TensorPipeRpcBackendOptions", "RpcBackendOptions",
    "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS", "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT",
    "TorchwireError", "RpcStateError", "RendezvousError", "WorkerUnavailableError",
    "RpcTimeoutError", "ProtocolError", "AuthenticationError", "LinkError",
    "ConnectionClosedError", "ConnectionBrokenError", "ConnectError", "SerializationError",
    "RemoteError", "UnknownWorkerError", "InvalidWorkerNameError", "RRefError",
    "DistAutogradError", "CallbackError", "RemoteCallError",
]

for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__") and isinstance(_obj, type):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):
            pass
del _name, _obj

# torch.futures.wait_all stops at the first error of a torchwire future too (_future.wait_all)
install_wait_all()
