"""torchwire's exception hierarchy.

Every error torchwire raises derives from :class:`TorchwireError`.  Families are
grouped by cause, with trio's distinction between a link *closed by us*
(:class:`ConnectionClosedError`) and one *broken by the peer or the network*
(:class:`ConnectionBrokenError`)::

    TorchwireError
    ├── RpcStateError            this worker is in the wrong state (not initialised, shut down)
    ├── RendezvousError          workers could not find each other
    ├── WorkerUnavailableError   the destination is gone or cannot be reached
    ├── RpcTimeoutError          a call did not complete in time
    ├── ProtocolError            a peer sent bytes that break the protocol
    ├── AuthenticationError      a peer did not prove it belongs to the job
    ├── LinkError                a link to one peer failed (wire layer)
    │   ├── ConnectionClosedError    closed by this side
    │   └── ConnectionBrokenError    broken by the peer or the network
    │       └── ConnectError             could not be made (``refused``: nobody listens)
    ├── SerializationError       a value could not be pickled or unpickled
    ├── RemoteError              a remote exception whose type cannot be rebuilt here
    ├── UnknownWorkerError       no worker has that name or rank (also ValueError)
    ├── InvalidWorkerNameError   a name breaks torch's rule (also ValueError)
    ├── RRefError                an RRef used the wrong way, or its value is gone
    ├── DistAutogradError        distributed autograd: no such context, bad roots, a failed pass
    ├── CallbackError            a future's callback raised
    └── RemoteCallError          the function a request names cannot run as asked

Where code written for ``torch.distributed.rpc`` catches ``RuntimeError`` (torch
raises ``RuntimeError`` for all of these), the family derives from it too, so that
such code keeps working after the import change.  Operating-system errors are
mapped to these once, in the wire layer; nothing above it sees an ``OSError``.
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
    "LinkError",
    "ConnectionClosedError",
    "ConnectionBrokenError",
    "ConnectError",
    "SerializationError",
    "RemoteError",
    "UnknownWorkerError",
    "InvalidWorkerNameError",
    "RRefError",
    "DistAutogradError",
    "CallbackError",
    "RemoteCallError",
    "not_initialized",
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
        reason: why, in words (its link's last transition: "connection lost (...)",
            "no heartbeat for ...", "cannot connect: ...", "its listener refused ...").
    """

    def __init__(self, message: str, worker_name: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.worker_name = worker_name
        self.reason = reason


class RpcTimeoutError(TorchwireError, RuntimeError):
    """A call did not complete within its timeout.

    The message keeps torch's phrase "RPC ran for more than set timeout" so that
    error handling written against torch.distributed.rpc still matches.
    """


class ProtocolError(TorchwireError, RuntimeError):
    """A peer sent bytes that do not follow the torchwire wire protocol."""


class AuthenticationError(TorchwireError, RuntimeError):
    """A connection's peer did not prove it knows the job secret, or refused our proof."""


class LinkError(TorchwireError, RuntimeError):
    """A link (one connection to one peer) failed or is closed."""


class ConnectionClosedError(LinkError):
    """An operation was attempted on a connection that this side has closed."""


class ConnectionBrokenError(LinkError):
    """The peer or the network broke the connection: reset, closed mid-frame, a write
    that failed.  The operating system's error is the ``__cause__``."""


class ConnectError(ConnectionBrokenError):
    """A connection to a peer could not be made.

    Attributes:
        refused: nothing listens at the peer's address any more (its process is
            gone); retrying cannot help.
        timed_out: the attempt ran out of time (the peer may be frozen or cut off,
            or the deadline was short): retrying may help.
    """

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out


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


class RRefError(TorchwireError, RuntimeError):
    """An RRef was used the wrong way (``local_value()`` on a user, used after its
    deletion, pickled outside RPC), or the value it names is gone."""


class DistAutogradError(TorchwireError, RuntimeError):
    """Distributed autograd: no such context, a context already open on this thread,
    roots that cannot start a backward pass, or a pass that failed on some worker."""


class CallbackError(TorchwireError, RuntimeError):
    """A callback added with ``Future.then`` raised (its error is the ``__cause__``)."""


class RemoteCallError(TorchwireError, RuntimeError):
    """The function a request names cannot run as asked: a torch operator given
    arguments that match none of its schemas, or an ``@async_execution`` function
    that did not return a future."""


def not_initialized(lookup: bool = False) -> RpcStateError:
    """The error of every use of RPC before ``init_rpc`` or after ``shutdown``.

    Args:
        lookup: the caller looks the agent up (RRef constructors, ``RemoteModule``):
            torch says "Current RPC agent is not set" there, and "RPC has not been
            initialized" for the API functions; ported code matches on both.
    """
    if lookup:
        return RpcStateError("Current RPC agent is not set! Did you initialize the RPC "
                             "framework (torchwire.rpc.init_rpc)? It has not been initialized "
                             "or has been shut down")
    return RpcStateError("RPC has not been initialized, or has been shut down: call "
                         "torchwire.rpc.init_rpc first")
