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
from . import constants, functions, internal, options  # noqa: F401
from .._rref import RRef
from . import api, backend_registry, rref_proxy  # noqa: F401 - torch has them too
from .api import _set_rpc_timeout  # noqa: F401 - private, as in torch
from .api import _delete_all_user_and_unforked_owner_rrefs  # noqa: F401
from .api import _get_current_rpc_agent, _rref_context_get_debug_info  # noqa: F401
from .api import (AllGatherStates, get_rpc_timeout, get_worker_info, init_rpc, is_available,
                  method_factory, new_method, remote, rpc_async, rpc_sync, shutdown, stats)
from .backend_registry import (BackendType, BackendValue, backend_registered,
                               construct_rpc_backend_options, init_backend, register_backend)
from ._unsupported import (_disable_jit_rref_pickle, _enable_jit_rref_pickle,  # noqa: F401
                           _invoke_remote_torchscript, _invoke_rpc_torchscript,
                           enable_gil_profiling)
from .._autograd.context import container as _autograd_container
from .._base.options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,
                             DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT,
                             RpcBackendOptions, TensorPipeRpcBackendOptions,
                             TorchwireRpcBackendOptions)

__all__ = [
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef", "get_worker_info",
    "get_rpc_timeout", "is_available", "stats", "WorkerInfo", "BackendType", "functions", "Future",
    "TorchwireRpcBackendOptions", "TensorPipeRpcBackendOptions", "RpcBackendOptions",
    "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS", "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT",
    # the rest of torch's rpc.__all__
    "AllGatherStates", "BackendValue", "backend_registered", "construct_rpc_backend_options",
    "init_backend", "register_backend", "method_factory", "new_method",
    "TorchwireError", "RpcStateError", "RendezvousError", "WorkerUnavailableError",
    "RpcTimeoutError", "ProtocolError", "AuthenticationError", "LinkError",
    "ConnectionClosedError", "ConnectionBrokenError", "ConnectError", "SerializationError",
    "RemoteError", "UnknownWorkerError", "InvalidWorkerNameError", "RRefError",
    "DistAutogradError", "CallbackError", "RemoteCallError",
]



def _get_debug_info() -> dict[str, int | str]:
    """torch's private summary: the RRef counters, the agent's debug info (strings,
    under torch's keys: ``get_debug_info()``) and distributed autograd's counters."""
    info: dict[str, int | str] = dict(_rref_context_get_debug_info())
    info.update(_get_current_rpc_agent().get_debug_info())
    autograd = _autograd_container().debug_info()
    info.update({k: str(autograd[k]) for k in ("num_autograd_contexts",
                                               "num_current_backward_passes")})
    return info


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
