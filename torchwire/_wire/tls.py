"""Optional TLS for TCP links (links between hosts).

``ssl.SSLSocket`` is not used: OpenSSL forbids using one ``SSL`` object from two
threads at once, and a connection here has a reader thread blocked in ``recv``
while other threads write.  :class:`TlsSocket` instead drives an
``ssl.SSLObject`` over two memory BIOs.  Encrypting and decrypting happen in
memory under a lock; the blocking socket I/O happens outside it, so a reader
waiting for bytes never blocks a writer.  It offers the subset of the socket
interface a :class:`~torchwire._wire.connection.Connection` uses
(``recv_into``, ``recv``, ``sendall``, ``sendall_parts`` instead of
``sendmsg``, ``settimeout``, ``shutdown``, ``close``).

Both sides present a certificate signed by the configured CA (mutual TLS), and
the client checks that the server's certificate names the address it dialled
unless ``tls_check_hostname=False``.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time

_RECV = 256 * 1024
_CHUNK = 256 * 1024  # plaintext encrypted per step: bounds the ciphertext held in memory


class TlsConfig:
    """Server and client contexts built from PEM files.

    Raises:
        ValueError: a file is missing or cannot be loaded.
    """

    def __init__(self, certfile: str, keyfile: str, cafile: str, *,
                 check_hostname: bool = True) -> None:
        for what, path in (("tls_certfile", certfile), ("tls_keyfile", keyfile),
                           ("tls_cafile", cafile)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"{what} {path!r} is not a readable file")
        try:
            self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            for ctx in (self.server, self.client):
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(certfile, keyfile)
                ctx.load_verify_locations(cafile)
                ctx.verify_mode = ssl.CERT_REQUIRED
            self.client.check_hostname = bool(check_hostname)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot load the TLS files (cert {certfile!r}, key {keyfile!r}, "
                             f"CA {cafile!r}): {exc}") from exc
        self.check_hostname = bool(check_hostname)

    def wrap(self, sock: socket.socket, *, server_side: bool, hostname: str | None,
             deadline: float) -> TlsSocket:
        """Run the TLS handshake on ``sock`` by ``deadline`` (``time.monotonic``)."""
        ctx = self.server if server_side else self.client
        tls = TlsSocket(sock, ctx, server_side=server_side,
                        server_hostname=None if server_side or not self.check_hostname
                        else hostname)
        tls.do_handshake(deadline)
        return tls


def settimeout_until(sock, deadline: float) -> None:
    """Give ``sock`` what is left until ``deadline``; raise ``socket.timeout`` if nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("handshake timed out")
    sock.settimeout(left)


class TlsSocket:
    """A TLS connection over a connected socket; one reader and any writers may share it."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None) -> None:
        self.raw = raw
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._in, self._out, server_side=server_side,
                                     server_hostname=server_hostname)
        self._lock = threading.Lock()  # the SSLObject and both BIOs
        self._send_lock = threading.Lock()  # order of ciphertext on the socket

    # What passes through to the plain socket (never a way to send or read plaintext).
    _RAW = frozenset({"settimeout", "gettimeout", "fileno", "getpeername", "getsockname",
                      "setsockopt", "getsockopt", "family", "type"})

    def __getattr__(self, name):
        if name in TlsSocket._RAW:
            return getattr(self.raw, name)
        raise AttributeError(f"TlsSocket has no attribute {name!r}")

    def do_handshake(self, deadline: float) -> None:
        while True:
            try:
                with self._lock:
                    self._ssl.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                try:  # let the peer see our alert (bad certificate, ...)
                    settimeout_until(self.raw, deadline)
                    self._flush()
                except OSError:
                    pass
                raise
            settimeout_until(self.raw, deadline)
            self._flush()
            if not self._pull():
                raise EOFError("peer closed the connection during the TLS handshake")

    # ------------------------------------------------------------------ reading

    def _pull(self) -> bool:
        data = self.raw.recv(_RECV)
        with self._lock:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()
        return bool(data)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        n = nbytes or len(buffer)
        if n == 0:
            return 0
        while True:
            with self._lock:
                try:
                    got = self._ssl.read(n, buffer)
                except ssl.SSLWantReadError:
                    got = -1
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0
                pending = self._out.pending
            if pending:
                self._flush()
            if got >= 0:
                return got
            if not self._pull():
                return 0

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf)
        return bytes(buf[:got])

    # ------------------------------------------------------------------ writing

    def _write(self, data) -> None:
        """Encrypt ``data`` and send it; the caller holds ``_send_lock``."""
        view = memoryview(data).cast("B")
        for off in range(0, len(view), _CHUNK):
            with self._lock:
                self._ssl.write(view[off:off + _CHUNK])
                out = self._out.read()
            self.raw.sendall(out)

    def _flush(self) -> None:
        """Send ciphertext that reading or the handshake produced (unless a writer is busy)."""
        while True:
            with self._lock:
                pending = self._out.pending
            if not pending or not self._send_lock.acquire(blocking=False):
                return
            try:
                with self._lock:
                    out = self._out.read()
                if out:
                    self.raw.sendall(out)
            finally:
                self._send_lock.release()

    def sendall_parts(self, parts) -> None:
        """Send every part in order; small parts are gathered into one TLS record."""
        with self._send_lock:
            small = bytearray()
            for p in parts:
                n = p.nbytes if isinstance(p, memoryview) else len(p)
                if n < _CHUNK:
                    small += p
                    if len(small) < _CHUNK:
                        continue
                    p, small = small, bytearray()
                elif small:
                    self._write(small)
                    small = bytearray()
                self._write(p)
            if small:
                self._write(small)
        self._flush()  # anything reading produced while we held the send lock

    def sendall(self, data) -> None:
        self.sendall_parts([data])

    # ------------------------------------------------------------------ closing

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()
