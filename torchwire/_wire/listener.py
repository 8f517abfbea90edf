"""Listening sockets: TCP on the chosen interface, and a Unix socket for same-host peers.

The Unix socket lives in Linux's abstract namespace (no file to clean up; it is
scoped to the network namespace, which is exactly "the same host" for us).
Each accepted socket is handed to ``on_accept(sock, transport)`` on a thread of
its own, so a slow or hostile peer in its handshake cannot block accepting.  The
handler runs the handshake and returns what this thread should run afterwards
(the connection's reader), or ``None``.  At most ``max_handshakes`` handshakes run
at once (each one is bounded by its own deadline); a connection accepted beyond
that is closed at once, so a flood of idle connections costs neither threads nor
file descriptors without bound.

The TCP socket binds to the given interface address; ``0.0.0.0`` (or ``::``)
listens on every interface and is used only when asked for.

Dialling (:func:`connect_tcp`, :func:`connect_unix`) raises ``ConnectError``, with
``refused`` set when nothing listens at the address (the process is gone).  The
``Listener`` constructor raises ``OSError``: a socket that cannot be bound is this
worker's setup failing, not a link.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid

from .._base.errors import ConnectError

log = logging.getLogger("torchwire")

MAX_HANDSHAKES = 256


def _tune(sock: socket.socket, tcp: bool) -> None:
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufsize = int(os.environ.get("TORCHWIRE_SOCKBUF", "0"))
    if bufsize:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
            except OSError:
                pass


class Listener:
    """Accepts connections on TCP and (on Linux) an abstract Unix socket."""

    def __init__(self, host: str, port: int, *, unix: bool = True,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._max_handshakes = max_handshakes
        self._last_full_warning = 0.0
        self._handler = None
        self._handler_set = threading.Event()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tcp = socket.socket(family, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, port))
        self.tcp.listen(1024)
        self.tcp_address = self.tcp.getsockname()[:2]
        self.unix: socket.socket | None = None
        self.unix_address: str | None = None
        if unix and sys.platform.startswith("linux"):
            name = f"\0torchwire-{os.getpid()}-{uuid.uuid4().hex}"
            self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.unix.bind(name)
            self.unix.listen(1024)
            self.unix_address = name
        self._threads = []
        for sock, kind in ((self.tcp, "tcp"), (self.unix, "unix")):
            if sock is not None:
                t = threading.Thread(target=self._accept_loop, args=(sock, kind), daemon=True,
                                     name=f"torchwire-accept-{kind}")
                t.start()
                self._threads.append(t)

    def __repr__(self) -> str:
        return f"<Listener tcp={self.tcp_address} unix={bool(self.unix)} closed={self._closed}>"

    def _accept_loop(self, sock: socket.socket, kind: str) -> None:
        while not self._closed:
            try:
                conn, _addr = sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse_over_limit(conn, kind)
                continue
            _tune(conn, kind == "tcp")
            threading.Thread(target=self._dispatch, args=(conn, kind), daemon=True,
                             name="torchwire-handshake").start()

    def set_handler(self, handler) -> None:
        """Install ``handler(sock, transport)``; connections accepted earlier wait for it."""
        self._handler = handler
        self._handler_set.set()

    def _refuse_over_limit(self, conn: socket.socket, kind: str) -> None:
        conn.close()
        now = time.monotonic()
        if now - self._last_full_warning > 10.0:
            self._last_full_warning = now
            log.warning("torchwire: %d handshakes already in progress: refusing %s connections "
                        "until they finish or time out", self._max_handshakes, kind)

    def _dispatch(self, conn: socket.socket, kind: str) -> None:
        then = None
        try:
            # A peer may finish rendezvous and connect before this worker's agent exists.
            if not self._handler_set.wait(30.0) or self._closed:
                conn.close()
                return
            then = self._handler(conn, kind)
        finally:
            self._slots.release()
        if then is not None:
            then()

    def close(self) -> None:
        self._closed = True
        for sock in (self.tcp, self.unix):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(2.0)


def connect_tcp(address, timeout: float) -> socket.socket:
    """A TCP connection to ``address`` (host, port), made within ``timeout`` seconds.

    Raises:
        ConnectError: it could not be made (``refused``: nothing listens there).
    """
    try:
        sock = socket.create_connection(tuple(address), timeout=timeout)
    except OSError as exc:
        raise _connect_error(exc) from exc
    try:
        _tune(sock, True)
    except OSError as exc:
        sock.close()
        raise _connect_error(exc) from exc
    return sock


def connect_unix(address: str, timeout: float) -> socket.socket:
    """A connection to the Unix socket ``address``, made within ``timeout`` seconds.

    Raises:
        ConnectError: it could not be made (``refused``: nothing listens there).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        _tune(sock, False)
    except OSError as exc:
        sock.close()
        raise _connect_error(exc) from exc
    return sock


def _connect_error(exc: OSError) -> ConnectError:
    return ConnectError(str(exc) or type(exc).__name__,
                        refused=isinstance(exc, ConnectionRefusedError),
                        timed_out=isinstance(exc, TimeoutError))


def listener_alive(tcp, unix: str | None = None, timeout: float = 2.0) -> bool:
    """Is a worker's listener still there?  ``tcp``: its ``(address, port)``; ``unix``:
    its Unix socket, tried instead when the worker is on this host.

    A closed listener refuses connections: its process is gone.  One that cannot be
    told within ``timeout`` (an unreachable host) counts as alive: no proof of death.
    """
    try:
        if unix:
            sock = connect_unix(unix, timeout)
        else:
            sock = connect_tcp(tcp, timeout)
    except ConnectError as exc:
        return isinstance(exc.__cause__, socket.timeout)  # no answer: no proof of death
    sock.close()
    return True


def host_identity() -> str:
    """A string equal for two processes exactly when they share a kernel and network stack."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{boot}/{netns}"
