"""Authentication of every connection: a job secret and an HMAC challenge-response both ways.

The secret comes from ``TorchwireRpcBackendOptions(auth_secret=...)``, else the
``TORCHWIRE_SECRET`` environment variable, else it is the random job token rank 0
puts in the rendezvous store (then it is only as private as the store: anyone who
can read the store can join).  The connection key binds it to this job::

    K = HMAC-SHA256(secret, "torchwire job key" 0x00 job_token)

Handshake (frame protocol version 2), before any payload byte is read; on TCP
links with TLS configured it runs inside the TLS session::

    server -> client  CHALLENGE  server rank u32, nonce_s (32 random bytes)
    client -> server  HELLO      client rank u32, nonce_c (32 B),
                                 HMAC(K, "torchwire/2 client" nonce_s nonce_c ranks)
    server -> client  HELLO_ACK  HMAC(K, "torchwire/2 server" nonce_s nonce_c ranks)
                      or HELLO_ACK with the ERROR flag: a reason (at most 256 B), then close

``ranks`` is ``client rank u32, server rank u32``.  The client proves first, so
the server computes no MAC for a peer that has not shown it knows K (no oracle
for guessing a weak secret); both nonces are fresh, so nothing can be replayed,
and the role labels differ, so a MAC cannot be reflected.  MACs are compared with
``hmac.compare_digest``.  Every handshake frame has one exact size (the refusal
reason a maximum) checked from the header before its body is read, and the whole
handshake has one deadline (``handshake_timeout``), not one per read, so a peer
that sends nothing or trickles bytes is dropped when it passes.  The listener caps
how many handshakes run at once.

Errors, either side: ``AuthenticationError`` (a key not proven, or our proof
refused), ``ProtocolError`` (not a torchwire peer, or not the rank dialled);
``ConnectError`` when the deadline passes or TLS fails (the link could not be
made); ``ConnectionBrokenError`` when the peer closes or resets the connection
midway (on a server, a liveness probe that dials and hangs up looks like this).
The socket's ``OSError`` is the ``__cause__`` of the last two.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import ssl
import struct
import time

from .._base.errors import (AuthenticationError, ConnectError, ConnectionBrokenError,
                            ProtocolError, RpcStateError)
from . import frame as F
from .tls import TlsConfig, settimeout_until

SECRET_ENV = "TORCHWIRE_SECRET"
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
NONCE_SIZE = 32
MAX_REASON = 256
CHALLENGE = struct.Struct("<I32s")
HELLO = struct.Struct("<I32s32s")
HELLO_ACK = struct.Struct("<32s")
_RANKS = struct.Struct("<II")
_CONTEXT = b"torchwire/2 "
MISMATCH_HINT = ("the workers do not share one secret: give every worker the same "
                 "auth_secret option or TORCHWIRE_SECRET environment variable")


class JobAuth:
    """A worker's credentials: the secret's source, TLS contexts, and (after ``bind``) K.

    Args:
        secret: the user's secret, or ``None`` to use the rendezvous job token.
        source: where ``secret`` came from (``"options"``, ``"env"``, ``"rendezvous"``).
        tls: contexts for TCP links, or ``None`` for plain TCP.
        timeout: seconds one handshake may take, TLS included.
    """

    def __init__(self, secret: bytes | None, *, source: str = "rendezvous",
                 tls: TlsConfig | None = None,
                 timeout: float = DEFAULT_HANDSHAKE_TIMEOUT) -> None:
        self._secret = secret
        self.source = source
        self.tls = tls
        self.timeout = float(timeout)
        self._key: bytes | None = None

    def __repr__(self) -> str:  # never shows the secret
        return (f"<JobAuth secret from {self.source} tls={self.tls is not None} "
                f"bound={self._key is not None}>")

    @classmethod
    def from_options(cls, options) -> JobAuth:
        """Read ``auth_secret``, ``TORCHWIRE_SECRET``, the TLS files and ``handshake_timeout``.

        Raises:
            ValueError: an empty secret, or TLS files that are missing or incomplete.
        """
        secret, source = getattr(options, "auth_secret", None), "options"
        if secret is None and os.environ.get(SECRET_ENV):
            secret, source = os.environ[SECRET_ENV], "env"
        if secret is None:
            source = "rendezvous"
        elif isinstance(secret, str):
            secret = secret.encode()
        files = [getattr(options, f"tls_{k}", None) for k in ("certfile", "keyfile", "cafile")]
        tls = None
        if any(files):
            if not all(files):
                raise ValueError("TLS needs all of tls_certfile, tls_keyfile and tls_cafile")
            tls = TlsConfig(*files, check_hostname=getattr(options, "tls_check_hostname", True))
        timeout = getattr(options, "handshake_timeout", None) or DEFAULT_HANDSHAKE_TIMEOUT
        return cls(secret, source=source, tls=tls, timeout=timeout)

    def record(self) -> dict:
        """What rendezvous publishes so that workers can check they agree (no secret in it)."""
        return {"secret": "rendezvous" if self._secret is None else "user",
                "tls": self.tls is not None}

    def bind(self, job_token: bytes) -> JobAuth:
        """Derive this job's key K from the secret (or the job token) and the job token."""
        self._key = hmac.new(self._secret if self._secret is not None else job_token,
                             b"torchwire job key\0" + job_token, hashlib.sha256).digest()
        return self

    def mac(self, role: bytes, nonce_s: bytes, nonce_c: bytes, client_rank: int,
            server_rank: int) -> bytes:
        if self._key is None:
            raise RpcStateError("JobAuth.bind was not called")
        msg = _CONTEXT + role + nonce_s + nonce_c + _RANKS.pack(client_rank, server_rank)
        return hmac.new(self._key, msg, hashlib.sha256).digest()


# ---------------------------------------------------------------------- frames


def _recv_exact(sock, n: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        settimeout_until(sock, deadline)
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise EOFError("peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _send(sock, kind: int, flags: int, body: bytes, deadline: float) -> None:
    settimeout_until(sock, deadline)
    sock.sendall(F.encode_header(kind, flags, 0, len(body), []) + body)


def _recv_frame(sock, kind: int, size: int, deadline: float, *,
                refusal_ok: bool = False) -> tuple[int, bytes]:
    """Read one handshake frame of ``kind`` and exactly ``size`` body bytes.

    The header is checked before the body is read: a frame of another kind or
    size is refused without reading (let alone unpickling) what follows it.
    """
    head = _recv_exact(sock, F.HEADER_SIZE, deadline)
    got, flags, _rid, plen, nbufs = F.decode_header(head, max_message_size=1 << 20)
    refused = refusal_ok and flags == F.F_ERROR
    if got != kind or nbufs or not (plen <= MAX_REASON if refused else plen == size) \
            or (flags and not refused):
        raise ProtocolError(f"expected a {F.Kind(kind).name} frame of {size} bytes in the "
                            f"handshake, got a {_kind_name(got)} frame of {plen} bytes "
                            f"(flags {flags}, {nbufs} buffers)")
    return flags, _recv_exact(sock, plen, deadline)


def _kind_name(kind: int) -> str:
    try:
        return F.Kind(kind).name
    except ValueError:
        return f"kind-{kind}"


def _refuse(sock, reason: str, deadline: float) -> None:
    """Tell the peer why, best effort (a stranger may not be listening)."""
    try:
        _send(sock, F.K_HELLO_ACK, F.F_ERROR, reason.encode()[:MAX_REASON],
              min(deadline, time.monotonic() + 1.0))
    except (OSError, EOFError):
        pass


def _peer(sock) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "a unix socket"


@contextlib.contextmanager
def _link_errors(peer: str, timeout: float):
    """What the socket raises during a handshake, as torchwire's link errors."""
    try:
        yield
    except socket.timeout as exc:
        raise ConnectError(f"handshake with {peer} timed out after {timeout:g}s",
                           timed_out=True) from exc
    except ssl.SSLError as exc:
        raise ConnectError(f"TLS handshake with {peer} failed: {exc}") from exc
    except EOFError as exc:
        raise ConnectionBrokenError(f"{peer} closed the connection during the handshake"
                                    ) from exc
    except OSError as exc:
        raise ConnectionBrokenError(f"{peer} left during the handshake: {exc}") from exc


# ---------------------------------------------------------------------- handshake


def client_handshake(sock: socket.socket, my_rank: int, auth: JobAuth, expect_rank: int, *,
                     transport: str = "tcp", host: str | None = None,
                     deadline: float | None = None):
    """Open a connection we initiated: prove our key, check the server's.

    ``deadline`` (``time.monotonic()``): the caller's, when sooner than the job's
    ``handshake_timeout`` from now.

    Returns:
        The socket to use from now on (a :class:`TlsSocket` on a TLS link).

    Raises:
        AuthenticationError: the server refused us or failed to prove its key.
        ProtocolError: it is not a torchwire worker or not the rank we dialled.
        ConnectError: the handshake timed out, or TLS failed.
        ConnectionBrokenError: the server closed or reset the connection.
    """
    own = time.monotonic() + auth.timeout
    deadline = own if deadline is None else min(own, deadline)
    with _link_errors(_peer(sock), max(0.0, deadline - time.monotonic())):
        if auth.tls is not None and transport == "tcp":
            sock = auth.tls.wrap(sock, server_side=False, hostname=host, deadline=deadline)
        _, body = _recv_frame(sock, F.K_CHALLENGE, CHALLENGE.size, deadline)
        server_rank, nonce_s = CHALLENGE.unpack(body)
        if server_rank != expect_rank:
            raise ProtocolError(f"connected to rank {server_rank}, expected rank {expect_rank}")
        nonce_c = secrets.token_bytes(NONCE_SIZE)
        mac = auth.mac(b"client", nonce_s, nonce_c, my_rank, server_rank)
        _send(sock, F.K_HELLO, 0, HELLO.pack(my_rank, nonce_c, mac), deadline)
        flags, body = _recv_frame(sock, F.K_HELLO_ACK, HELLO_ACK.size, deadline,
                                  refusal_ok=True)
    if flags:
        raise AuthenticationError(f"rank {server_rank} refused the connection: "
                                  f"{body.decode(errors='replace')}")
    if not hmac.compare_digest(body, auth.mac(b"server", nonce_s, nonce_c, my_rank,
                                               server_rank)):
        raise AuthenticationError(f"the worker at rank {server_rank}'s address failed to prove "
                                  f"it knows the job secret ({MISMATCH_HINT})")
    with _link_errors(_peer(sock), auth.timeout):
        sock.settimeout(None)
    return sock


def server_handshake(sock: socket.socket, my_rank: int, auth: JobAuth, world_size: int | None,
                     transport: str = "tcp"):
    """Accept a connection: challenge the peer, check its proof, prove ours.

    ``world_size`` None (a dynamic group): any rank; the agent checks membership.

    Returns:
        ``(sock, peer_rank)``; ``sock`` is a :class:`TlsSocket` on a TLS link.

    Raises:
        ConnectionBrokenError: the peer left (a liveness probe, or a peer that gave up).
        AuthenticationError, ProtocolError, ConnectError: refused (a stranger, another
            job, a peer too slow for the deadline); the caller closes ``sock``.
    """
    deadline = time.monotonic() + auth.timeout
    peer = _peer(sock)
    with _link_errors(peer, auth.timeout):
        try:
            if auth.tls is not None and transport == "tcp":
                sock = auth.tls.wrap(sock, server_side=True, hostname=None, deadline=deadline)
            nonce_s = secrets.token_bytes(NONCE_SIZE)
            _send(sock, F.K_CHALLENGE, 0, CHALLENGE.pack(my_rank, nonce_s), deadline)
            _, body = _recv_frame(sock, F.K_HELLO, HELLO.size, deadline)
        except ProtocolError as exc:
            _refuse(sock, str(exc), deadline)
            raise ProtocolError(f"{exc} (from {peer})") from None
    rank, nonce_c, mac = HELLO.unpack(body)
    if not hmac.compare_digest(mac, auth.mac(b"client", nonce_s, nonce_c, rank, my_rank)):
        _refuse(sock, f"authentication failed: {MISMATCH_HINT}", deadline)
        raise AuthenticationError(f"peer {peer} (claiming rank {rank}) failed authentication: "
                                  "it does not know this job's secret")
    if world_size is not None and not 0 <= rank < world_size:
        _refuse(sock, f"rank {rank} is outside the world of {world_size}", deadline)
        raise ProtocolError(f"peer {peer} claims rank {rank} outside world of {world_size}")
    with _link_errors(peer, auth.timeout):
        _send(sock, F.K_HELLO_ACK, 0, HELLO_ACK.pack(auth.mac(b"server", nonce_s, nonce_c,
                                                               rank, my_rank)), deadline)
        sock.settimeout(None)
    return sock, rank
