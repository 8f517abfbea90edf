"""torchwire's exception hierarchy.

Every error torchwire raises derives from :class:`TorchwireError`.  Families
are grouped by cause (unavailable, timeout, protocol, closed, state,
serialization, rendezvous).  Where code written for ``torch.distributed.rpc``
catches ``RuntimeError``, the family also derives from ``RuntimeError`` so that
such code keeps working after the import change.
"""

from __future__ import annotations

__all__ = [
    "TorchwireError",
    "RpcStateError",
    "RendezvousError",
    "WorkerUnavailableError",
    "RpcTimeoutError",
    "ProtocolError",
    "AuthenticationError",
    "ConnectionClosedError",
    "SerializationError",
    "RemoteError",
    "UnknownWorkerError",
    "InvalidWorkerNameError",
]


class TorchwireError(Exception):
    """Root of every error raised by torchwire."""


class RpcStateError(TorchwireError, RuntimeError):
    """The RPC layer is in the wrong state for the call (not initialised, shut down, ...)."""


class RendezvousError(TorchwireError, RuntimeError):
    """Workers could not find each other: bad name, duplicate name or rank, missing peer."""


class WorkerUnavailableError(TorchwireError, RuntimeError):
    """The destination worker is gone or cannot be reached.

    Attributes:
        worker_name: name of the worker that is unavailable (``None`` if unknown).
    """

    def __init__(self, message: str, worker_name: str | None = None) -> None:
        super().__init__(message)
        self.worker_name = worker_name


class RpcTimeoutError(TorchwireError, RuntimeError):
    """A call did not complete within its timeout.

    The message keeps torch's phrase "RPC ran for more than set timeout" so that
    error handling written against torch.distributed.rpc still matches.
    """


class ProtocolError(TorchwireError, RuntimeError):
    """A peer sent bytes that do not follow the torchwire wire protocol."""


class AuthenticationError(TorchwireError, RuntimeError):
    """A connection's peer did not prove it knows the job secret, or refused our proof."""


class ConnectionClosedError(TorchwireError, RuntimeError):
    """An operation was attempted on a connection that is already closed."""


class SerializationError(TorchwireError, RuntimeError):
    """A value could not be pickled or unpickled for transport."""


class RemoteError(TorchwireError, RuntimeError):
    """An exception raised on a remote worker whose type could not be rebuilt locally.

    Attributes:
        remote_type: ``module.qualname`` of the original exception type.
        worker_name: the worker it was raised on.
        remote_traceback: the formatted traceback from the remote worker.
    """

    def __init__(self, message: str, remote_type: str = "", worker_name: str = "",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.worker_name = worker_name
        self.remote_traceback = remote_traceback


class InvalidWorkerNameError(TorchwireError, ValueError, RuntimeError):
    """A worker name breaks torch's rule (letters, digits, ``_``, ``-``, ``:``; 1-127 chars).

    A ``ValueError`` (bad argument) and, as torch raises it, a ``RuntimeError``.
    """


class UnknownWorkerError(TorchwireError, ValueError, RuntimeError):
    """No worker of the job has that name, rank or WorkerInfo.

    Derives from ``ValueError`` (it is a bad argument) and ``RuntimeError``
    (torch raises ``RuntimeError`` here).
    """
