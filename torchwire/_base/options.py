"""Backend options and the backend enum."""

from __future__ import annotations

import math
import os

from . import devices as _devices

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_MAX_MESSAGE_SIZE = 1 << 40  # 1 TiB: effectively "what the process can hold"
DEFAULT_POLL_US = 1000.0
POLL_ENV = "TORCHWIRE_POLL_US"


class RpcBackendOptions:
    """Base of every backend's options (as torch's): ``rpc_timeout`` and ``init_method``."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = _check_timeout(rpc_timeout)
        self.init_method = init_method


def _check_timeout(rpc_timeout) -> float:
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
        # "incompatible constructor arguments" is torch's phrase for a wrong type here
        raise TypeError(f"incompatible constructor arguments: rpc_timeout must be a number "
                        f"of seconds, got {type(rpc_timeout).__name__}")
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0 seconds (0 = no limit), got {rpc_timeout!r}")
    return float(rpc_timeout)


class TorchwireRpcBackendOptions(RpcBackendOptions):
    """Options for :func:`torchwire.rpc.init_rpc`; also exported as ``TensorPipeRpcBackendOptions``.

    Args:
        num_worker_threads: core threads of the pool that runs user functions (16).
        rpc_timeout: default timeout of every call, in seconds; 0 means no limit (60).
        init_method: ``env://``, ``tcp://host:port`` or ``file:///path`` ("env://").
        device_maps: ``{callee name: {local device: callee device}}`` (int, str or
            ``torch.device``); CUDA tensors on a mapped device arrive on the mapped
            device there (through host memory); replies use the inverse.  1-to-1,
            checked at init against every worker's devices.  See ``set_device_map``.
        devices: the local CUDA devices RPC uses (default: those of the maps).
        _transports: transports a connection may use, of ``"uds"`` (Unix socket, same
            host) and ``"tcp"``; ``None`` = all (Unix socket whenever the peer is on
            this host).  ``["tcp"]`` forces TCP, for tests and benchmarks.
        _channels: how large buffers may travel to a same-host peer, of ``"shm"``
            (shared-memory segments, one copy; the default), ``"cma"`` (cross-memory
            attach, one copy) and ``"socket"`` (torch's name ``"basic"`` too); ``None``
            = all, best first.  Across hosts buffers always go through the socket.
        _channel_threshold: buffers of at least this many bytes leave the socket
            stream for the ``shm`` or ``cma`` channel; ``None``: 2 MiB for ``shm``,
            256 KiB for ``cma`` (each where it beats the other; see docs/guide-channels.md).
        _tcp_lanes: split buffers of 8 MiB or more sent over TCP across the connection
            and a second one (a lane) to the same peer, written and read by two
            threads at once (True).
        max_message_size: largest frame (payload + tensors) accepted from a peer, in bytes.
        listen_addr: interface address to listen on; by default the one that routes to
            the rendezvous host (``127.0.0.1`` when that is loopback or for ``file://``).
        init_timeout: how long ``init_rpc`` waits for every worker; defaults to
            ``rpc_timeout`` (or 60 s when that is 0).
        auth_secret: the job secret (``str`` or ``bytes``) every connection proves it
            knows; else the ``TORCHWIRE_SECRET`` environment variable; else a random
            one from rendezvous, which is only as private as the rendezvous store.
            Every worker must get it the same way (all set, or none).
        handshake_timeout: seconds a connection's handshake (TLS and HMAC) may take (10).
        tls_certfile, tls_keyfile, tls_cafile: PEM files; when given (all three), TCP
            links use TLS with certificates checked both ways against the CA.  Links
            over the Unix socket (same host) stay plain.
        tls_check_hostname: whether a worker's certificate must name the address it
            listens on (True).
        heartbeat_interval: seconds a connection may stay idle before this worker pings
            its peer (1.0); busy connections are never pinged.  0 turns the heartbeat off.
        heartbeat_timeout: seconds without a sign of life on a connection after which its
            peer counts as frozen or unreachable: calls pending on it fail with
            ``WorkerUnavailableError`` and graceful shutdown stops waiting for it (10.0).
        metrics_port: serve this worker's ``rpc.stats()`` in Prometheus text format
            over HTTP on this port (0: any free one; needs ``prometheus_client``, the
            ``metrics`` extra).  None (default): off, unless the environment variable
            ``TORCHWIRE_METRICS_PORT`` is set (rank ``r`` then serves on its value + r).
        metrics_addr: the address the metrics endpoint listens on (127.0.0.1).
        poll_us: after serving requests, a connection's reader polls its socket for
            the next request for up to this many microseconds before it sleeps,
            yielding its core between polls and stopping when other threads of the
            process run; the window adapts to how soon requests come (see
            docs/architecture.md).  A caller that reads its own reply polls for it
            the same way.  None (default): the environment variable
            ``TORCHWIRE_POLL_US``, else 1000.  0 never polls: the better setting
            on a host with more busy threads than cores.
    """

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD, device_maps=None, devices=None,
                 _transports=None, _channels=None, _channel_threshold: int | None = None,
                 _tcp_lanes: bool = True,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
                 listen_addr: str | None = None, init_timeout: float | None = None,
                 auth_secret: str | bytes | None = None, handshake_timeout: float = 10.0,
                 tls_certfile: str | None = None, tls_keyfile: str | None = None,
                 tls_cafile: str | None = None, tls_check_hostname: bool = True,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 metrics_port: int | None = None, metrics_addr: str | None = None,
                 poll_us: float | None = None) -> None:
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(
                f"num_worker_threads must be a positive int, got {num_worker_threads!r}")
        _check_timeout(rpc_timeout)
        if auth_secret is not None and (not isinstance(auth_secret, (str, bytes))
                                        or not auth_secret):
            raise ValueError("auth_secret must be a non-empty str or bytes")
        if not isinstance(handshake_timeout, (int, float)) or handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be > 0 seconds, got {handshake_timeout!r}")
        for what, v in (("heartbeat_interval", heartbeat_interval),
                        ("heartbeat_timeout", heartbeat_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{what} must be >= 0 seconds, got {v!r}")
        if heartbeat_interval and heartbeat_timeout <= heartbeat_interval:
            raise ValueError(f"heartbeat_timeout ({heartbeat_timeout}) must be longer than "
                             f"heartbeat_interval ({heartbeat_interval})")
        if metrics_port is not None and (isinstance(metrics_port, bool) or not isinstance(
                metrics_port, int) or not 0 <= metrics_port < 65536):
            raise ValueError(f"metrics_port must be a port number (0..65535), got "
                             f"{metrics_port!r}")
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        if device_maps is not None and not isinstance(device_maps, dict):
            raise TypeError(f"device_maps must be a dict of worker name -> device map, got "
                            f"{type(device_maps).__name__}")
        self.device_maps = {name: _devices.to_device_map(m)
                            for name, m in (device_maps or {}).items()}
        self.devices = [_devices.to_device(d) for d in (devices or [])]
        self._transports = _transports
        self._channels = _channels
        if _channel_threshold is not None and (
                isinstance(_channel_threshold, bool) or not isinstance(_channel_threshold, int)
                or _channel_threshold < 1):
            raise ValueError(f"_channel_threshold must be a positive int (bytes), got "
                             f"{_channel_threshold!r}")
        self._channel_threshold = _channel_threshold
        self._tcp_lanes = bool(_tcp_lanes)
        self.max_message_size = int(max_message_size)
        self.listen_addr = listen_addr
        self.init_timeout = init_timeout
        self.auth_secret = auth_secret
        self.handshake_timeout = float(handshake_timeout)
        self.tls_certfile = tls_certfile
        self.tls_keyfile = tls_keyfile
        self.tls_cafile = tls_cafile
        self.tls_check_hostname = tls_check_hostname
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.poll_us = _poll_us(poll_us)

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Map this worker's devices to ``to``'s: a tensor on a key device arrives on the
        value device there, and replies come back through the inverse.  Must be 1-to-1;
        merged with what is already set for ``to``.

        Raises:
            ValueError: the merged map is not 1-to-1.
        """
        merged = dict(self.device_maps.get(to, {}))
        merged.update(_devices.to_device_map(device_map))
        self.device_maps[to] = _devices.to_device_map(merged)

    def set_devices(self, devices: list) -> None:
        """The local CUDA devices RPC uses (by default: those of the device maps)."""
        self.devices = [_devices.to_device(d) for d in devices]

    def __repr__(self) -> str:
        return (f"TorchwireRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
                f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r})")


TensorPipeRpcBackendOptions = TorchwireRpcBackendOptions


def _poll_us(value) -> float:
    """``poll_us``: the option, else ``TORCHWIRE_POLL_US``, else the default."""
    what = "poll_us"
    if value is None:
        env = os.environ.get(POLL_ENV)
        if env is None or not env.strip():
            return DEFAULT_POLL_US
        what = f"environment variable {POLL_ENV}"
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{what} must be a number of microseconds, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{what} must be >= 0 microseconds (0: never poll), got {value!r}")
    return float(value)


_CHANNEL_ALIASES = {"basic": "socket"}


def channel_allowed(options, name: str) -> bool:
    """Does ``options._channels`` allow channel ``name`` (``None`` allows all)?"""
    channels = getattr(options, "_channels", None)
    if channels is None:
        return True
    return name in {_CHANNEL_ALIASES.get(c, c) for c in channels}


def resolve_timeout(timeout, default: float) -> float:
    """A call's timeout in seconds: ``default`` (the agent's ``rpc_timeout``) for -1 or
    None, 0 (no limit) for 0 or infinity.

    Raises:
        TypeError: not a number.
        ValueError: negative (other than -1), or NaN.
    """
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout >= 0:  # NaN included
        raise ValueError(f"timeout must be >= 0 seconds (0 = no limit) or -1 for the default, "
                         f"got {timeout}")
    return float(timeout) if timeout != math.inf else 0.0
