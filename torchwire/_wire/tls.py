"""Optional TLS for TCP links (links between hosts).

``ssl.SSLSocket`` is not used: OpenSSL forbids using one ``SSL`` object from two
threads at once, and a connection here has a reader thread blocked in ``recv``
while other threads write.  :class:`TlsSocket` instead drives an
``ssl.SSLObject`` over two memory BIOs.  Encrypting and decrypting happen in
memory under a lock; the socket I/O happens outside it, so a reader waiting for
bytes never blocks a writer.  It offers the subset of the socket interface a
:class:`~torchwire._wire.connection.Connection` uses (``recv_into``, ``recv``,
``write_nowait`` instead of a non-blocking ``sendmsg``, ``sendall`` and
``sendall_parts`` for the authentication handshake, ``settimeout``, ``shutdown``,
``close``).  The writer's records go out without blocking, so a write keeps its
call's deadline as on a plain socket (``writer.py``).

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
_DONTWAIT = int(getattr(socket, "MSG_DONTWAIT", 0))


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
        # Under ``_send_lock``: ciphertext out of the BIO that the socket has not taken
        # yet, and how many plaintext bytes of the last record ``write_nowait`` has not
        # reported as sent (their record is in ``_backlog``).
        self._backlog: bytes | memoryview = b""
        self._held = 0

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
                self._flush(block=True)
                return
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                try:  # let the peer see our alert (bad certificate, ...)
                    settimeout_until(self.raw, deadline)
                    self._flush(block=True)
                except OSError:
                    pass
                raise
            settimeout_until(self.raw, deadline)
            self._flush(block=True)
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
    #
    # Ciphertext must reach the socket exactly as OpenSSL made it, in order: each
    # record's MAC covers its sequence number, so a record sent twice, dropped or
    # reordered ends the session.  Only the thread holding ``_send_lock`` moves
    # ciphertext from the out BIO to the socket, and what the socket did not take
    # waits in ``_backlog``, sent before anything else by whoever comes next.

    def write_nowait(self, buffers) -> int:
        """Encrypt ``buffers`` in order and send the records without blocking; return
        how many plaintext bytes went (0: the socket is full: wait until it is writable
        and call again).

        This is a plain socket's ``sendmsg(buffers, (), MSG_DONTWAIT)`` for the writer
        (``writer.py``), which calls it from one thread at a time on a socket without a
        timeout.  A record the socket took only part of stays in ``_backlog`` and its
        plaintext is not counted as sent: the caller passes those bytes again at the head
        of its next call, which sends the rest of the record and counts them then,
        without encrypting them twice.

        Raises:
            OSError: the socket failed.
        """
        with self._send_lock:
            if not self._push():
                return 0
            sent, self._held = self._held, 0  # their record is out now
            for piece in _pieces(buffers, sent):
                with self._lock:
                    self._ssl.write(piece)
                    self._backlog = memoryview(self._out.read())
                if not self._push():
                    self._held = len(piece)
                    return sent
                sent += len(piece)
            self._push_pending()  # what reading made while we held the send lock
            return sent

    def sendall_parts(self, parts) -> None:
        """Send every part in order, blocking (the socket's timeout bounds each wait):
        for the authentication handshake, before a writer owns the socket."""
        with self._send_lock:
            if self._backlog:
                self.raw.sendall(self._backlog)
                self._backlog = b""
            for piece in _pieces(parts, 0):
                with self._lock:
                    self._ssl.write(piece)
                    out = self._out.read()
                self.raw.sendall(out)
        self._flush()  # anything reading produced while we held the send lock

    def sendall(self, data) -> None:
        self.sendall_parts([data])

    def _push(self) -> bool:
        """Send ``_backlog`` without blocking (on a socket without a timeout); True
        when all of it is out.  The caller holds ``_send_lock``."""
        backlog = self._backlog
        try:
            while backlog:
                backlog = backlog[self.raw.send(backlog, _DONTWAIT):]
        except BlockingIOError:
            pass
        finally:
            self._backlog = backlog
        return not backlog

    def _push_pending(self) -> None:
        """Queue what the out BIO holds behind ``_backlog`` and send what the socket
        takes now; the caller holds ``_send_lock``."""
        with self._lock:
            if not self._out.pending:
                return
            out = self._out.read()
        self._backlog = bytes(self._backlog) + out if self._backlog else memoryview(out)
        self._push()

    def _flush(self, block: bool = False) -> None:
        """Send ciphertext that reading or the handshake produced.  A reader sends what
        the socket takes now and leaves the rest to the next writer, which sends it
        before its own records (a reader must not block on a write; one busy writing
        meanwhile sends it all).  ``block``: the TLS handshake, alone on the socket,
        sends it all (the socket's timeout bounds the wait)."""
        if not self._send_lock.acquire(blocking=block):
            return
        try:
            self._push_pending()
            if block and self._backlog:
                self.raw.sendall(self._backlog)
                self._backlog = b""
        finally:
            self._send_lock.release()

    # ------------------------------------------------------------------ closing

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()


def _pieces(buffers, skip: int):
    """The bytes of ``buffers`` after the first ``skip``, in pieces to encrypt: small
    parts gathered (a frame's header and payload make one record), large ones cut into
    ``_CHUNK`` slices, so each piece's ciphertext is at most about ``2 * _CHUNK``."""
    small = bytearray()
    for p in buffers:
        view = memoryview(p).cast("B")
        n = view.nbytes
        if skip:
            if skip >= n:
                skip -= n
                continue
            view, n, skip = view[skip:], n - skip, 0
        if n < _CHUNK:
            small += view
            if len(small) >= _CHUNK:
                yield small
                small = bytearray()
            continue
        if small:
            yield small
            small = bytearray()
        for off in range(0, n, _CHUNK):
            yield view[off:off + _CHUNK]
    if small:
        yield small
