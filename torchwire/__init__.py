"""torchwire: a fast, failure-tolerant, authenticated drop-in for torch.distributed.rpc.

Public packages: :mod:`torchwire.rpc`, :mod:`torchwire.autograd`, :mod:`torchwire.optim`,
:mod:`torchwire.nn`.  Errors are re-exported here too.
"""

from ._base.errors import (AuthenticationError, CallbackError, ConnectError,
                           ConnectionBrokenError, ConnectionClosedError, DistAutogradError,
                           InvalidWorkerNameError, LinkError, ProtocolError, RemoteCallError,
                           RemoteError, RendezvousError, RpcStateError, RpcTimeoutError,
                           RRefError, SerializationError, TorchwireError, UnknownWorkerError,
                           WorkerUnavailableError)

__version__ = "0.1.0"

__all__ = [
    "TorchwireError", "RpcStateError", "RendezvousError", "WorkerUnavailableError",
    "RpcTimeoutError", "ProtocolError", "AuthenticationError", "LinkError",
    "ConnectionClosedError", "ConnectionBrokenError", "ConnectError", "SerializationError",
    "RemoteError", "UnknownWorkerError", "InvalidWorkerNameError", "RRefError",
    "DistAutogradError", "CallbackError", "RemoteCallError", "__version__",
]
