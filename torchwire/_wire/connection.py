"""One socket to one peer: framing, the send API, closing.

A connection writes through its combining writer (``writer.py``: no writer thread;
the sending thread writes, or queues behind the one that is writing) and reads in
its read loop (``reader.py``), on a reader thread of its own or on whichever thread
the reading was handed to.  How each tensor buffer travels is its channels'
business (``channels/``): the connection only asks the set it was built with.

Closing: ``close()`` shuts the socket down, which wakes the reader; the reader
reports ``on_close(conn, exc)`` exactly once.
"""

from __future__ import annotations

import collections
import logging
import os
from functools import partial
import socket
import threading

from .._base import intraop as _intraop, threads as _threads
from .._base.errors import (ConnectionBrokenError, ConnectionClosedError, LinkError,
                            ProtocolError, RpcTimeoutError)
from . import frame as F
from . import reader
from .buffers import byte_view
from .channels import ChannelFailed, OutFrame
from .channels.link import ChannelSet
from .lending import ReadRole, lendable
from .polling import RestPoll
from .writer import Fds, Writer, close_fds

log = logging.getLogger("torchwire")


class Connection:
    """A framed, bidirectional connection to one peer.

    Args:
        sock: a connected socket whose handshake is done (a ``TlsSocket`` on a TLS link).
        peer_rank: the rank the handshake proved.
        on_frames: ``on_frames(conn, frames, at_rest) -> bool``, called on the reading
            thread with a list of ``(kind, flags, request_id, payload, tensors)``, which
            it owns from then on.  ``at_rest``: the batch ends what was read, so the
            callback may run requests on this thread, handing the reading to another
            one meanwhile (through :meth:`read_loop`); it then returns True, and this
            thread stops reading.  Otherwise it returns False.
        on_close: ``on_close(conn, exc_or_None)``; called once, on the reading thread.
        channels: how large buffers travel (default: the socket only).
        defer: ``defer(fn, *args)`` runs ``fn`` on a pool thread (default: at once).
        max_message_size: frames larger than this are a protocol error.
        initiated: this side opened the connection.
        transport: ``"unix"`` or ``"tcp"``.
        lane: this side opened it as a lane, for the second halves of large buffers
            (the other side learns it from the first DATA frame: ``lane`` turns True).
        poll_us: after serving requests, the reader polls for the next one for up to
            this long before it sleeps (``polling.py``); 0 never polls.
    """

    def __init__(self, sock: socket.socket, peer_rank: int, on_frames, on_close, *,
                 channels: ChannelSet | None = None, defer=None,
                 max_message_size: int = F.DEFAULT_MAX_MESSAGE_SIZE, initiated: bool,
                 transport: str, lane: bool = False, poll_us: float = 0) -> None:
        self.sock = sock
        # A lane's halves belong to frames the main connection counts whole: metrics
        # leave its bytes out.
        self.lane = lane
        self.peer_rank = peer_rank
        self.initiated = initiated
        self.transport = transport
        self.on_frames = on_frames
        self._on_close = on_close
        self.max_message_size = max_message_size
        self.defer = defer or (lambda fn, *args: fn(*args))
        self.channels = (channels or ChannelSet()).on_socket(isinstance(sock, socket.socket))
        self._large = self.channels.large_min  # a buffer this big leaves the socket
        self._writer = Writer(sock, peer_rank, self.defer, self._write_broken)
        self._lock = self._writer.lock
        self._enqueue = self._writer.enqueue
        self.send_nowait = self._writer.send_nowait
        self.closed = False
        self.goodbye_received = False
        self.close_reason: BaseException | None = None
        self.fds: collections.deque = collections.deque()  # received, not yet claimed
        self.frames_in = 0
        # Liveness evidence for the heartbeat (see _agent/liveness.py): heartbeat frames
        # received, and reads of large frames still in progress.
        self.heartbeats_in = 0
        self.progress_in = 0
        self.bytes_in = 0
        # Set by the heartbeat to the evidence mark it saw while nothing arrived (the
        # peer may have stopped reading): channels that hold memory for the peer hold
        # less until anything arrives again (see ``silent``).
        self.silent_mark: int | None = None
        self.poll = RestPoll(int(poll_us * 1000))
        # a caller waiting for its reply may read it itself (lending.py): connections
        # this side opened, on plain sockets, not lanes
        self.role = ReadRole() if (initiated and not lane and lendable()
                                   and isinstance(sock, socket.socket)) else None
        # a borrower's wait for its reply polls first too, with a window of its own
        self.reply_poll = RestPoll(int(poll_us * 1000)) if self.role is not None else None
        self._reader_done = threading.Event()
        self._reader = threading.Thread(target=self.read_loop, daemon=True,
                                        name=f"torchwire-reader-{peer_rank}")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        side = "out" if self.initiated else "in"
        return (f"<Connection peer={self.peer_rank} {self.transport} {side} {state} "
                f"channels={'+'.join(self.channels.send_names())} "
                f"frames_in={self.frames_in} frames_out={self.frames_out} "
                f"queued={len(self._writer.queue)}>")

    @property
    def evidence(self) -> int:
        """What shows the peer alive, as a count that grows: frames and heartbeats
        received, reads of large frames in progress, and writes the peer made room for
        (a full socket that drained)."""
        return (self.frames_in + self.heartbeats_in + self.progress_in
                + self._writer.progress_out)

    @property
    def silent(self) -> bool:
        """Nothing has arrived (nor drained) since the heartbeat found the connection
        silent."""
        mark = self.silent_mark
        return mark is not None and mark == self.evidence

    @property
    def frames_out(self) -> int:
        return self._writer.frames_out

    @property
    def bytes_out(self) -> int:
        return self._writer.bytes_out

    def start(self) -> None:
        """Start reading on a thread of the connection's own."""
        self._reader.start()

    # ------------------------------------------------------------------ sending

    def send_frame(self, kind: int, flags: int, request_id: int, payload: bytes,
                   tensors=(), deadline: float | None = None) -> None:
        """Send one frame: written at once unless another thread is writing.
        ``deadline`` (``time.monotonic()``) bounds this thread's wait on a full socket
        (see ``writer.py``).

        Raises:
            ConnectionClosedError: the connection is closed.
            ConnectionBrokenError: the write failed.
            RpcTimeoutError: the connection stayed full until ``deadline``; nothing sent.
        """
        if tensors:
            lens = [t.nbytes for t in tensors]
            if max(lens) >= self._large and self._send_large(kind, flags, request_id,
                                                             payload, tensors, lens, deadline):
                return
            parts = [F.encode_header(kind, flags, request_id, len(payload), lens), payload]
            for t, n in zip(tensors, lens):
                if n:
                    parts.append(byte_view(t, n))
            size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + sum(lens)
        else:
            parts = [F.pack_header(kind, flags, request_id, len(payload), 0), payload]
            size = F.HEADER_SIZE + len(payload)
        self._enqueue(parts, tensors, size, deadline)

    def _send_large(self, kind, flags, request_id, payload, tensors, lens, deadline) -> bool:
        """Send a frame through the first channel that takes its largest buffer (see
        ``channels/``); False if none does (the socket carries it all)."""
        big, total = max(lens), sum(lens)
        for ch in self.channels.send:
            if big < ch.min_size or not ch.begin(self):
                continue
            frame = OutFrame(flags, tensors, deadline, total)
            fds = Fds(frame.fds)  # (closing it twice is safe)
            try:
                for t, n in zip(tensors, lens):
                    if n < ch.min_size or not ch.encode(self, frame, t, n):
                        frame.add_inline(t, n)
            except ChannelFailed:
                ch.drop(self, frame)
                fds.close()
                continue
            except BaseException:
                ch.drop(self, frame)
                fds.close()
                raise
            parts = [fds] if frame.fds else []
            parts.append(F.encode_header(kind, frame.flags, request_id, len(payload),
                                         frame.lens))
            parts.append(payload)
            parts += frame.parts
            size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + total
            try:  # the channel's part goes once the connection takes the frame
                self._enqueue(parts, tensors, size, deadline, partial(ch.ready, self, frame))
            except (LinkError, RpcTimeoutError):
                ch.drop(self, frame)
                fds.close()
                raise
            return True
        return False

    def send_encoded(self, parts: list, tensors=()) -> None:
        """Send frames already encoded (headers and all), ``tensors`` alive until written.

        Raises:
            ConnectionClosedError, ConnectionBrokenError: as :meth:`send_frame`.
        """
        self._enqueue(parts, tensors, sum(len(p) for p in parts))

    def send_control(self, op: int) -> None:
        """Send a heartbeat frame (``frame.CTRL_PING`` or ``CTRL_PONG``); a closed
        connection is not an error here (its reader reports the loss)."""
        try:
            self._enqueue([F.encode_frame(F.K_CONTROL, 0, op)], (), F.HEADER_SIZE)
        except LinkError:
            pass

    def send_release(self, token: int, shm: bool = False, retire: bool = False,
                     forget: bool = False) -> None:
        """Tell the peer we have read the buffers of CMA ``token`` (it may free
        them), or (``shm``) unmapped one lease of its segment ``token`` (``retire``:
        a process we forked may still map it, so it must not be written again), or
        (``shm`` and ``forget``) closed our segment ``token`` that it may keep mapped."""
        flags = 0
        if shm:
            flags = F.F_SHM | (F.F_RETIRE if retire else 0) | (F.F_FORGET if forget else 0)
        try:
            self._enqueue([F.encode_frame(F.K_RELEASE, flags, token)], (), F.HEADER_SIZE)
        except LinkError:
            pass

    def release_from_reader(self, token: int) -> None:
        """Reading thread: send a CMA RELEASE without waking another thread (see
        :meth:`Writer.send_nowait`)."""
        if not self.send_nowait(F.encode_frame(F.K_RELEASE, 0, token)):
            self.defer(self.send_release, token)

    def send_goodbye(self) -> None:
        try:
            self.send_frame(F.K_GOODBYE, 0, 0, b"")
        except LinkError:
            pass

    # ------------------------------------------------------------------ reading

    def read_loop(self) -> None:
        """Read frames until the connection ends, or until ``on_frames`` hands the
        reading to another thread (which then calls this again: at rest there is no
        state to pass)."""
        _intraop.init_thread()  # requests may run here, in place
        _threads.set_io(True)
        try:
            exc = reader.run(self)
            if exc is not reader.HANDED_OFF:
                self._reading_ended(exc)
        finally:
            # this may be a pool thread, back to running user code
            _threads.set_io(False)

    def _reading_ended(self, exc: BaseException | None) -> None:
        if exc is not None and self.closed:  # closed here, on purpose: report why
            exc = self.close_reason or ConnectionClosedError(
                f"connection to rank {self.peer_rank} is closed")
        if isinstance(exc, ProtocolError):
            log.warning("torchwire: dropping connection to rank %s: %s", self.peer_rank, exc)
        self.close(exc)
        self.channels.reader_done(self, exc or ConnectionClosedError(
            f"connection to rank {self.peer_rank} closed"))
        while self.fds:  # descriptors the peer sent for frames never read
            try:
                os.close(self.fds.popleft())
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self._on_close(self, exc if exc is not None else self.close_reason)
        except Exception:
            log.exception("torchwire: on_close handler failed")
        self._reader_done.set()

    def join(self, timeout: float) -> None:
        """Wait until reading has ended (whichever thread holds the reader role)."""
        if threading.current_thread() is not self._reader:
            self._reader_done.wait(timeout)

    # ------------------------------------------------------------------ closing

    def close(self, reason: BaseException | None = None) -> None:
        """Close the socket (idempotent); the reader then reports ``on_close``.

        Args:
            reason: why, for ``on_close`` (None: closed in order).
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            dropped = self._writer.shut()
        if self.role is not None:  # a parked reader reads again, and finds the end
            self.role.wake()
        close_fds(dropped)
        self.channels.close(self)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _write_broken(self, exc: OSError) -> None:
        err = ConnectionBrokenError(str(exc))
        err.__cause__ = exc
        self.close(err)
