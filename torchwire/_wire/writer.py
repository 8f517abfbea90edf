"""The combining writer of one connection: no writer thread.

A sender appends its frame's parts to the connection's queue; if no other thread
is writing, it takes the writer's turn and writes everything queued (its own frame
and any that arrive meanwhile) with ``sendmsg`` scatter/gather, straight from
tensor memory.  Idle, a frame goes out at once from the caller's thread; under
load, frames coalesce.

The usual case skips the queue: when nobody is writing, the sender writes its
frame directly (one lock round to take the turn, one to give it back) and only
then looks for frames queued meanwhile.

Deadlines and backpressure: a sender may pass its call's ``deadline``.  Every
``sendmsg`` is non-blocking (on a TLS link it encrypts too: ``_TlsStream``); a socket
that is full is waited for with ``poll`` until the deadline at most.  A frame half
written when the deadline passes cannot be taken back (the stream would be corrupt;
on TLS, records already encrypted must go as they are), so the rest of the queue goes
to a pool thread that finishes it without a deadline (a peer that never reads again is
cut by the heartbeat, which closes the socket and wakes it), and the sender returns:
its call fails at its deadline by the timer.  Frames queued behind a writing thread
keep their tensors alive, so the queue is capped at ``max_queued`` bytes: a sender
that would pass the cap waits for room until its deadline, then raises
``RpcTimeoutError`` with nothing sent (one frame is always let in, whatever its size).
The memory a connection holds for a peer that stopped reading is thus at most the
batch being written plus ``max_queued``.

Errors: a write on a closed connection raises ``ConnectionClosedError``; a write
that fails (the peer reset, the network) raises ``ConnectionBrokenError`` with the
``OSError`` as its cause, and closes the connection with it.
"""

from __future__ import annotations

import array
import os
import select
import socket
import threading
import time
from functools import partial

from .._base.errors import ConnectionBrokenError, ConnectionClosedError, RpcTimeoutError

_IOV_MAX = 1000  # parts per sendmsg (Linux takes at most 1024)
_DONTWAIT = int(getattr(socket, "MSG_DONTWAIT", 0))
MAX_QUEUED = 64 << 20  # bytes queued behind a writing thread before senders wait


class _Late(Exception):
    """A write ran into its deadline; ``rest``: the parts not yet written."""

    def __init__(self, rest: list) -> None:
        super().__init__()
        self.rest = rest


class Fds:
    """In a connection's queue, just before a frame's header: the descriptors
    that frame's buffers need.  They go with the first ``sendmsg`` that carries
    the frame, so they reach the reader no later than the header.  The queue owns
    them (duplicates) and closes them once sent or dropped; closing twice is safe."""

    __slots__ = ("fds",)

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def close_fds(parts) -> None:
    """Close the descriptors of every ``Fds`` marker among ``parts``."""
    for p in parts:
        if type(p) is Fds:
            p.close()


class Writer:
    """Writes one connection's frames; any thread may send.

    Args:
        sock: the connected socket (a ``TlsSocket`` on a TLS link).
        peer_rank: for messages.
        defer: ``defer(fn, *args)`` runs ``fn`` on a pool thread.
        broken: ``broken(exc)``: a write failed with ``exc`` (an ``OSError``): close
            the connection.

    ``lock`` guards the queue and ``closed``; the connection holds it to close.
    """

    def __init__(self, sock, peer_rank: int, defer, broken,
                 max_queued: int = MAX_QUEUED) -> None:
        self.lock = threading.Lock()
        self._room = threading.Condition(self.lock)  # the queue fell below the cap
        self.max_queued = max_queued
        self.queued = 0  # bytes in ``queue``
        self.queue: list = []
        self.keep: list = []  # tensors of queued frames, alive until written
        self.flushing = False  # a thread holds the writer's turn
        self.closed = False
        self.fd_frames = 0  # frames in the queue that carry descriptors
        self.frames_out = 0
        self.bytes_out = 0
        # Liveness evidence: waits for a full socket that ended with room (the peer
        # read): a long write is not a silent peer.
        self.progress_out = 0
        self._peer = peer_rank
        self._sock = sock
        self._defer = defer
        self._broken = broken
        self.nowait = isinstance(sock, socket.socket) and bool(_DONTWAIT)
        # A TLS link goes the same way as a plain socket (non-blocking writes, the
        # deadline, the progress count), its records encrypted as they are written.
        stream = _TlsStream(sock) if hasattr(sock, "write_nowait") else sock
        self._sendall = partial(_sendall, stream, counter=self)

    def enqueue(self, parts: list, tensors, size: int, deadline: float | None = None,
                admitted=None) -> None:
        """Write one frame's ``parts`` (``size`` bytes; ``tensors`` alive until written),
        or queue them behind the thread that is writing.  ``admitted()``, if given, runs
        once the frame is taken (the queue had room, the connection is open), before
        any of it can be written: what else the frame needs sent (a lane's half) goes
        only then.

        Raises:
            ConnectionClosedError: the connection is closed.
            ConnectionBrokenError: the write failed (the connection is closed now).
            RpcTimeoutError: the queue stayed full until ``deadline``; nothing was sent.
        """
        with self.lock:
            if self.flushing and self.queued and self.queued + size > self.max_queued:
                self._wait_for_room(size, deadline)
            if self.closed:
                raise ConnectionClosedError(f"connection to rank {self._peer} is closed")
            if admitted is not None:
                admitted()
            self.frames_out += 1
            self.bytes_out += size
            # Nobody writing (so nothing queued) and no descriptors: this thread writes
            # its frame straight away, without the queue (``tensors``, a local here,
            # keeps the buffers alive meanwhile).
            direct = not self.flushing and type(parts[0]) is not Fds
            if not direct:
                self.queue.extend(parts)
                self.queued += size
                if type(parts[0]) is Fds:
                    self.fd_frames += 1
                if tensors:
                    self.keep.append(tensors)
                if self.flushing:
                    return
            self.flushing = True
        if direct:
            try:
                self._sendall(parts, deadline)
            except OSError as exc:
                self._write_failed(exc)
            except _Late as late:
                self._hand_off(late.rest, tensors, 0)
                return
            with self.lock:
                if not self.queue:  # (nobody queued a frame meanwhile)
                    self.flushing = False
                    return
        self.flush(deadline)

    def _wait_for_room(self, size: int, deadline: float | None) -> None:
        """Under ``lock``: wait until the queue has room for ``size`` bytes (or is
        empty), the connection closes, or ``deadline`` passes (raise)."""
        while (self.flushing and self.queued and self.queued + size > self.max_queued
               and not self.closed):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RpcTimeoutError(
                    f"the connection to rank {self._peer} stayed full until the call's "
                    f"deadline ({self.queued} bytes queued: the peer is not reading)")
            self._room.wait(left)

    def flush(self, deadline: float | None = None) -> None:
        """Write what is queued until the queue is empty; the caller holds the turn.
        Past ``deadline``, a pool thread finishes (see the module docstring)."""
        while True:
            with self.lock:
                parts = self.queue
                if not parts:
                    self.flushing = False
                    self.keep = []
                    return
                self.queue = []
                self.queued = 0
                self._room.notify_all()
                keep = self.keep
                self.keep = []
                with_fds, self.fd_frames = self.fd_frames, 0
            try:
                if with_fds:
                    _sendall_fds(self._sock, parts, deadline)
                else:
                    self._sendall(parts, deadline)
            except OSError as exc:
                if with_fds:
                    close_fds(parts)
                self._write_failed(exc)
            except _Late as late:
                if with_fds:  # close the descriptors that went, keep the rest's
                    kept = {id(p) for p in late.rest}
                    close_fds([p for p in parts if id(p) not in kept])
                self._hand_off(late.rest, keep, late.fds)
                return
            if with_fds:
                close_fds(parts)
            del keep

    def _hand_off(self, rest: list, keep, fd_frames: int) -> None:
        """The writing thread's deadline passed with ``rest`` unwritten: put it back at
        the head of the queue and let a pool thread finish, keeping the turn."""
        size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in rest
                   if type(p) is not Fds)
        with self.lock:
            self.queue[:0] = rest
            self.queued += size
            self.fd_frames += fd_frames
            if keep:
                self.keep.append(keep)
        try:
            self._defer(self._flush_or_close)
        except RuntimeError:  # the pool is shut down: finish here
            self._flush_or_close()

    def send_nowait(self, frame: bytes) -> bool:
        """Send one small encoded frame from a thread that must never block on a write
        (a reader: two peers whose readers both waited for buffer space would
        deadlock), without waking another thread in the usual case.

        Written at once when no other thread is writing and the socket takes it
        without blocking; else it joins the queue of the thread that is writing;
        a tail the socket did not take goes to the pool, which finishes the write.
        False (nothing done) on a link that cannot do this (TLS): the caller then
        hands the frame to the pool itself.  A closed connection drops the frame
        quietly (its reader reports the loss).
        """
        if not self.nowait:
            return False
        with self.lock:
            if self.closed:
                return True
            self.frames_out += 1
            self.bytes_out += len(frame)
            if self.flushing:  # the writing thread sends it with what it has
                self.queue.append(frame)
                self.queued += len(frame)
                return True
            self.flushing = True
        try:
            sent = self._sock.send(frame, _DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            with self.lock:
                self.flushing = False
            self._broken(exc)
            return True
        with self.lock:
            if sent < len(frame):
                self.queue.insert(0, frame[sent:])
                self.queued += len(frame) - sent
            elif not self.queue:
                self.flushing = False
                return True
        # Left to write (the tail, or what others queued meanwhile): the pool
        # finishes, still holding the writer's turn.
        try:
            self._defer(self._flush_or_close)
        except RuntimeError:  # the pool is shut down: this is the last writer
            self._flush_or_close()
        return True

    def _flush_or_close(self) -> None:
        try:
            self.flush()
        except (ConnectionClosedError, ConnectionBrokenError):
            pass  # the reader reports the loss

    def shut(self) -> list:
        """Refuse every later frame; return the parts still queued (to close their
        descriptors).  The caller holds ``lock``."""
        self.closed = True
        dropped, self.queue = self.queue, []
        self.queued = 0
        self.fd_frames = 0
        self.keep = []
        self._room.notify_all()
        return dropped

    def _write_failed(self, exc: OSError) -> None:
        """The writing thread's write failed: drop what is queued, close, and raise."""
        with self.lock:
            self.flushing = False
            dropped, self.queue = self.queue, []
            self.queued = 0
            self.fd_frames = 0
            self.keep = []
            self._room.notify_all()
        close_fds(dropped)
        self._broken(exc)
        raise ConnectionBrokenError(f"write to rank {self._peer} failed: {exc}") from exc


class _TlsStream:
    """A ``TlsSocket`` as ``_sendall`` uses a socket: ``sendmsg`` encrypts and sends
    without blocking, and returns how many plaintext bytes went (``write_nowait``).
    Records the socket took only part of wait in the ``TlsSocket``, so a frame that a
    deadline cut short goes on later (a pool thread, see the module docstring) exactly
    as it was encrypted."""

    __slots__ = ("_tls",)

    def __init__(self, tls) -> None:
        self._tls = tls

    def sendmsg(self, buffers, ancdata=(), flags=0) -> int:
        return self._tls.write_nowait(buffers)

    def fileno(self) -> int:
        return self._tls.fileno()


def _sendall_fds(sock: socket.socket, parts: list, deadline: float | None = None) -> None:
    """``_sendall`` for a queue holding ``Fds`` markers: each marker starts a
    new ``sendmsg`` that carries its descriptors with the frame that follows.

    Raises:
        _Late: as ``_sendall``; its ``rest`` keeps the markers not yet sent, and
            ``fds`` counts them.
    """
    start, anc = 0, None
    for i, p in enumerate(parts):
        if type(p) is Fds:
            if i > start:
                _sendall_late(sock, parts, start, i, anc, deadline)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", p.fds))]
            start = i + 1
    if start < len(parts):
        _sendall_late(sock, parts, start, len(parts), anc, deadline)


def _sendall_late(sock, parts, start, end, anc, deadline) -> None:
    try:
        _sendall(sock, parts[start:end], deadline, anc)
    except _Late as late:
        rest = late.rest + parts[end:]
        if late.anc is not None:  # its descriptors did not go: keep their marker
            rest.insert(0, parts[start - 1])
        late.rest = rest
        late.fds = sum(1 for p in rest if type(p) is Fds)
        raise


def _sendall(sock: socket.socket, parts: list, deadline: float | None = None,
             anc=None, counter=None) -> None:
    """Write every part, in order, with as few ``sendmsg`` calls as the kernel allows
    (``anc``: ancillary data for the first one).  Each call is non-blocking; a full
    socket is waited for until ``deadline`` (None: as long as it takes), and each
    wait that ends with room counts in ``counter.progress_out``.

    Raises:
        _Late: ``deadline`` passed; ``rest`` is what was not written (nothing lost:
            written bytes are gone, the rest of a half-written part is its tail).
        OSError: the write failed.
    """
    i, n = 0, len(parts)
    while i < n:
        chunk = parts[i:i + _IOV_MAX]
        try:
            if anc:
                sent = sock.sendmsg(chunk, anc, _DONTWAIT)
                anc = None
            else:
                sent = sock.sendmsg(chunk, (), _DONTWAIT)
        except BlockingIOError:
            sent = 0
        # consume `sent` bytes from the chunk
        j = 0
        for p in chunk:
            ln = len(p) if not isinstance(p, memoryview) else p.nbytes
            if sent >= ln:
                sent -= ln
                j += 1
            else:
                break
        i += j
        if sent:
            # partial part: keep the unsent tail
            head = parts[i]
            parts[i] = memoryview(head)[sent:]
        if i < n and (j < len(chunk)):
            if not _wait_writable(sock, deadline):
                late = _Late(parts[i:])
                late.fds, late.anc = 0, anc
                raise late
            if counter is not None:
                counter.progress_out += 1


def _wait_writable(sock: socket.socket, deadline: float | None) -> bool:
    """Wait until ``sock`` takes more bytes (or fails: the next write raises); False
    if ``deadline`` passed first."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    while True:
        if deadline is None:
            ms = None
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ms = max(1, int(left * 1000))
        if poller.poll(ms):
            return True
