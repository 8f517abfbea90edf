"""torchwire: a fast, failure-tolerant, authenticated drop-in for torch.distributed.rpc.

Public packages: :mod:`torchwire.rpc`, :mod:`torchwire.autograd`, :mod:`torchwire.optim`,
:mod:`torchwire.nn`.  Errors are re-exported here too.
"""

from ._base.errors import (AuthenticationError, ConnectionClosedError, ProtocolError, RemoteError,
                      RendezvousError, RpcStateError, RpcTimeoutError, SerializationError,
                      TorchwireError, UnknownWorkerError, WorkerUnavailableError,
                      InvalidWorkerNameError)

__version__ = "0.1.0"

__all__ = [
    "TorchwireError", "RpcStateError", "RendezvousError", "WorkerUnavailableError",
    "RpcTimeoutError", "ProtocolError", "ConnectionClosedError", "SerializationError",
    "RemoteError", "UnknownWorkerError", "InvalidWorkerNameError", "AuthenticationError",
    "__version__",
]
