"""One socket to one peer: a reader thread and a combining writer.

Reading: a reader thread per connection fills a 256 KiB buffer with one
``recv_into`` and decodes every complete frame in it, so a burst of small
messages costs one system call; a tensor buffer larger than what is buffered
is read with ``recv_into`` straight into its final tensor storage.  Frames
decoded from one read are handed to ``on_frames`` as one batch.

Writing: there is no writer thread.  A sender appends its frame's parts to the
connection's queue; if no other thread is flushing, it becomes the flusher and
writes everything queued (its own frame and any that arrive meanwhile) with
``sendmsg`` scatter/gather, straight from tensor memory.  Idle, a frame goes out
at once from the caller's thread; under load, frames coalesce.

Closing: ``close()`` shuts the socket down, which wakes the reader; the reader
reports ``on_close(conn, exc)`` exactly once.
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from .._base import intraop as _intraop, threads as _threads
from .._base.errors import ConnectionClosedError, ProtocolError
from . import cma, shm
from . import frame as F
from .buffers import byte_view, receive_buffer

log = logging.getLogger("torchwire")

READ_BUF = 256 * 1024
_IOV_MAX = 1000
CMA_MIN = 256 * 1024  # smaller buffers are cheaper inline than a syscall + a RELEASE
SHM_MIN = 2 << 20  # below this, mapping + unmapping costs more than CMA's copy
_MAX_FDS = 250  # descriptors per frame (the kernel takes at most 253 per sendmsg)
LANE_MIN = 8 << 20  # TCP buffers from this size are split over the connection and a lane
_LANE_PENDING_MAX = 256  # split buffers a peer may have half-sent at once
_ANC_SPACE = socket.CMSG_SPACE(253 * 4) if hasattr(socket, "CMSG_SPACE") else 0
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CTRUNC = int(socket.MSG_CTRUNC)
_DONTWAIT = int(getattr(socket, "MSG_DONTWAIT", 0))
# Buffers up to this size that arrive whole in the read buffer are handed on as
# bytearrays (typed by torch.frombuffer when unpickled), not torch tensors.
_SMALL_BUFFER = 64 << 10


class _Fds:
    """In a connection's queue, just before a frame's header: the descriptors
    that frame's shared-memory buffers need.  They go with the first ``sendmsg``
    that carries the frame, so they reach the reader no later than the header.
    The queue owns them (duplicates) and closes them once sent or dropped."""

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


class _Transfer:
    __slots__ = ("tensor", "view", "parts", "error", "done")

    def __init__(self, n: int) -> None:
        self.tensor = receive_buffer(n)
        self.view = byte_view(self.tensor, n)
        self.parts = 0
        self.error: BaseException | None = None
        self.done = threading.Event()


class LaneRegistry:
    """Large TCP buffers being received in two parts, on two connections with the
    same peer (a "lane": a second TCP connection whose reader runs in parallel
    with the first's, so that both cores copy).  Whichever part arrives first
    allocates the buffer; the reader of the main part waits for the other.

    One registry per agent, shared by every connection.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], _Transfer] = {}

    def get(self, peer: int, tid: int, n: int) -> _Transfer:
        with self._lock:
            tr = self._pending.get((peer, tid))
            if tr is None:
                if sum(1 for p, _ in self._pending if p == peer) >= _LANE_PENDING_MAX:
                    raise ProtocolError(f"rank {peer} has too many split buffers in flight")
                tr = self._pending[(peer, tid)] = _Transfer(n)
            elif len(tr.view) != n:
                raise ProtocolError(f"split buffer {tid} from rank {peer}: sizes disagree")
            return tr

    def part_done(self, peer: int, tid: int, tr: _Transfer) -> bool:
        """One part is in; True (and forgotten) when both are."""
        with self._lock:
            tr.parts += 1
            if tr.parts < 2:
                return False
            self._pending.pop((peer, tid), None)
        tr.done.set()
        return True

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        """A connection with ``peer`` closed: no split buffer from it can complete."""
        with self._lock:
            gone = [k for k in self._pending if k[0] == peer]
            trs = [self._pending.pop(k) for k in gone]
        for tr in trs:
            tr.error = exc
            tr.done.set()


def _close_fds(parts) -> None:
    for p in parts:
        if type(p) is _Fds:
            p.close()
_PREFAULT_MIN = 1 << 20
_PREFAULT_CHUNK = 2 << 20  # stay under Linux's IOV_MAX (1024)


class Connection:
    """A framed, bidirectional connection to one peer.

    Args:
        sock: a connected socket whose handshake is done (a ``TlsSocket`` on a TLS link).
        peer_rank: the rank the handshake proved.
        on_frames: ``on_frames(conn, frames)`` with a list of
            ``(kind, flags, request_id, payload, tensors)``; called on the reader thread
            with ``inline_ok``: whether it may return requests to run in place.
        on_close: ``on_close(conn, exc_or_None)``; called once, on the reader thread.
        max_message_size: frames larger than this are a protocol error.
    """

    def __init__(self, sock: socket.socket, peer_rank: int, on_frames, on_close, *,
                 max_message_size: int = F.DEFAULT_MAX_MESSAGE_SIZE, initiated: bool,
                 transport: str, cma_pid: int | None = None, defer=None,
                 spawn=None, shm_send: bool = False, shm_recv: bool = False,
                 channel_min: int = CMA_MIN, shm_min: int = SHM_MIN,
                 lanes: LaneRegistry | None = None, lane_factory=None) -> None:
        self.sock = sock
        self.peer_rank = peer_rank
        self.initiated = initiated
        self.transport = transport
        self._on_frames = on_frames
        self._on_close = on_close
        self._max = max_message_size
        self._qlock = threading.Lock()
        self._queue: list = []
        self._keep: list = []
        self._flushing = False
        self.closed = False
        self.goodbye_received = False
        self.close_reason: BaseException | None = None
        # Same-host peer whose memory we may read (and who may read ours): large
        # buffers then travel by process_vm_readv instead of through the socket.
        self.cma_pid = cma_pid
        self._defer = defer or (lambda fn, *args: fn(*args))
        self._cma_hold: dict[int, list] = {}
        self._cma_tokens = 0
        # Same-host peer that reads descriptors from the socket: large buffers then
        # travel in shared-memory segments (see shm.py).  Plain sockets only.
        plain = isinstance(sock, socket.socket)
        self._plain = plain and bool(_DONTWAIT)
        self.shm_send = bool(shm_send and plain and shm.available())
        self.shm_recv = bool(shm_recv and plain and shm.available())
        self.channel_min = max(1, channel_min)
        self.shm_min = max(1, shm_min)
        # TCP lanes: the registry of split buffers being received, and (on a
        # connection we send requests on) how to open our lane to the peer.
        self.lanes = lanes
        self._lane_factory = lane_factory if plain else None
        self._lane: Connection | None = None
        self._lane_lock = threading.Lock()
        self._fd_frames = 0  # frames in the queue that carry descriptors
        self._fdq: collections.deque = collections.deque()  # received, not yet used
        self.frames_in = 0
        # Liveness evidence for the heartbeat (see _liveness.py): heartbeat frames
        # received, and reads of large frames still in progress.
        self.heartbeats_in = 0
        self.progress_in = 0
        self.frames_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._spawn = spawn
        self._fast_runs = 0  # consecutive quick inline runs (see _Watchdog)
        # A TLS link encrypts part by part; a plain socket takes them all in one sendmsg.
        self._sendall = getattr(sock, "sendall_parts", None) or partial(_sendall, sock)
        self._reader_done = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"torchwire-reader-{peer_rank}")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        side = "out" if self.initiated else "in"
        return (f"<Connection peer={self.peer_rank} {self.transport} {side} {state} "
                f"frames_in={self.frames_in} frames_out={self.frames_out} "
                f"queued={len(self._queue)}>")

    def start(self) -> None:
        self._reader.start()

    # ------------------------------------------------------------------ writing

    def send_frame(self, kind: int, flags: int, request_id: int, payload: bytes,
                   tensors=()) -> None:
        """Queue one frame and flush unless another thread is already flushing.

        Raises:
            ConnectionClosedError: the connection is closed or the write failed.
        """
        token = 0
        if tensors:
            lens = [t.nbytes for t in tensors]
            big = max(lens)
            if big >= LANE_MIN and self._lane_factory is not None and self._send_lane_frame(
                    kind, flags, request_id, payload, tensors, lens):
                return
            if big >= self.channel_min:
                if self.shm_send and big >= self.shm_min and self._send_shm_frame(
                        kind, flags, request_id, payload, tensors, lens):
                    return
                if self.cma_pid is not None:
                    return self._send_cma_frame(kind, flags, request_id, payload, tensors, lens)
            parts = [F.encode_header(kind, flags, request_id, len(payload), lens), payload]
            for t, n in zip(tensors, lens):
                if n:
                    parts.append(byte_view(t, n))
            size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + sum(lens)
        else:
            parts = [F.HEADER.pack(F.MAGIC, F.VERSION, kind, flags, request_id, len(payload),
                                   0, 0), payload]
            size = F.HEADER_SIZE + len(payload)
        self._enqueue(parts, tensors, size, token)

    def _get_lane(self):
        lane = self._lane
        if lane is not None and not lane.closed:
            return lane
        with self._lane_lock:
            if self._lane is None or self._lane.closed:
                try:
                    self._lane = self._lane_factory()
                except Exception as exc:  # no lane: the whole buffer goes on this connection
                    log.debug("torchwire: no lane to rank %s: %s", self.peer_rank, exc)
                    self._lane_factory = None
                    return None
            return self._lane

    def _send_lane_frame(self, kind, flags, request_id, payload, tensors, lens) -> bool:
        """Split large buffers: the first half here, the second on the lane, written
        by another thread at the same time.  False if there is no lane."""
        lane = self._get_lane()
        if lane is None:
            return False
        wire_lens, refs, data = [], [], []
        for t, n in zip(tensors, lens):
            if n >= LANE_MIN:
                tid = next(_transfer_ids)  # unique per process: a peer keys them by our rank
                split = n // 2 // 4096 * 4096
                view = byte_view(t, n)
                wire_lens.append(n | F.LANE_BIT)
                refs += [F.LANE_REF.pack(tid, split), view[:split]]
                data.append((tid, n, split, view[split:]))
            else:
                wire_lens.append(n)
                refs.append(byte_view(t, n) if n else b"")
        parts = [F.encode_header(kind, flags, request_id, len(payload), wire_lens), payload]
        parts.extend(r for r in refs if len(r))
        size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + sum(lens)
        lane_parts = []
        for tid, n, split, rest in data:
            lane_parts += [F.encode_header(F.K_DATA, 0, tid, F.LANE_DATA.size, [n - split]),
                           F.LANE_DATA.pack(n, split), rest]
        # The lane's half goes from a copier thread while this one writes its own half;
        # both hold the tensors until written.
        _lane_writer().submit(_write_lane, lane, lane_parts, tensors)
        self._enqueue(parts, tensors, size, 0)
        return True

    def _send_shm_frame(self, kind, flags, request_id, payload, tensors, lens) -> bool:
        """Send large buffers through shared-memory segments; False (nothing sent)
        if the channel failed, so the caller falls back to another."""
        wire_lens, refs, fds, leased = [], [], [], []
        try:
            for t, n in zip(tensors, lens):
                if n >= self.shm_min and len(fds) < _MAX_FDS:
                    seg_id, seg_size, offset, how, fd = shm.export(t, n, self)
                    if fd is not None:
                        fds.append(fd)
                        leased.append(seg_id)
                    wire_lens.append(n | F.SHM_BIT)
                    refs.append(F.SHM_REF.pack(seg_id, seg_size, offset, how))
                else:
                    wire_lens.append(n)
                    refs.append(byte_view(t, n) if n else b"")
        except ConnectionClosedError:
            for seg_id in leased:
                shm.release(self, seg_id)
            _close_fds([_Fds(fds)])
            raise
        except OSError as exc:  # no memory for a segment, descriptors exhausted, ...
            for seg_id in leased:
                shm.release(self, seg_id)
            _close_fds([_Fds(fds)])
            log.warning("torchwire: shared-memory channel to rank %s failed (%s); "
                        "sending through the socket", self.peer_rank, exc)
            return False
        parts = [_Fds(fds)] if fds else []
        parts.append(F.encode_header(kind, flags, request_id, len(payload), wire_lens))
        parts.append(payload)
        parts.extend(r for r in refs if len(r))
        size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + sum(lens)
        try:
            self._enqueue(parts, tensors, size, 0)
        except ConnectionClosedError:
            _close_fds(parts)
            raise
        return True

    def _send_cma_frame(self, kind, flags, request_id, payload, tensors, lens) -> None:
        with self._qlock:
            self._cma_tokens += 1
            token = self._cma_tokens
        wire_lens, refs = [], []
        for t, n in zip(tensors, lens):
            if n >= CMA_MIN:
                wire_lens.append(n | F.REMOTE_BIT)
                refs.append(F.REMOTE_REF.pack(t.data_ptr(), token))
            else:
                wire_lens.append(n)
                refs.append(byte_view(t, n) if n else b"")
        parts = [F.encode_header(kind, flags | F.F_CMA, request_id, len(payload), wire_lens),
                 payload]
        parts.extend(r for r in refs if len(r))
        size = F.HEADER_SIZE + 8 * len(lens) + len(payload) + sum(lens)
        self._enqueue(parts, tensors, size, token)

    def send_control(self, op: int) -> None:
        """Send a heartbeat frame (``frame.CTRL_PING`` or ``CTRL_PONG``); a closed
        connection is not an error here (its reader reports the loss)."""
        try:
            self._enqueue([F.HEADER.pack(F.MAGIC, F.VERSION, F.K_CONTROL, 0, op, 0, 0, 0)],
                          (), F.HEADER_SIZE, 0)
        except ConnectionClosedError:
            pass

    def send_release(self, token: int, shm: bool = False, retire: bool = False) -> None:
        """Tell the peer we have read the buffers of CMA ``token`` (it may free
        them), or (``shm``) unmapped one lease of its segment ``token`` (``retire``:
        a process we forked may still map it, so it must not be written again)."""
        flags = (F.F_SHM | (F.F_RETIRE if retire else 0)) if shm else 0
        try:
            self._enqueue([_release_frame(token, flags)], (), F.HEADER_SIZE, 0)
        except ConnectionClosedError:
            pass

    def _release_from_reader(self, token: int) -> None:
        """Reader thread: send a CMA RELEASE without waking another thread (see
        :meth:`send_nowait`)."""
        if not self.send_nowait(_release_frame(token, 0)):
            self._defer(self.send_release, token)

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
        if not self._plain:
            return False
        with self._qlock:
            if self.closed:
                return True
            self.frames_out += 1
            self.bytes_out += len(frame)
            if self._flushing:  # the writing thread sends it with what it has
                self._queue.append(frame)
                return True
            self._flushing = True
        try:
            sent = self.sock.send(frame, _DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            with self._qlock:
                self._flushing = False
            self.close(exc)
            return True
        with self._qlock:
            if sent < len(frame):
                self._queue.insert(0, frame[sent:])
            elif not self._queue:
                self._flushing = False
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
            self._flush()
        except ConnectionClosedError:
            pass  # the reader reports the loss

    def _enqueue(self, parts, tensors, size: int, token: int) -> None:
        with self._qlock:
            if self.closed:
                raise ConnectionClosedError(f"connection to rank {self.peer_rank} is closed")
            self.frames_out += 1
            self.bytes_out += size
            if token:
                self._cma_hold[token] = tensors  # until the peer's RELEASE
            # Nobody writing (so nothing queued) and no descriptors: this thread writes
            # its frame straight away, without the queue (``tensors``, a local here,
            # keeps the buffers alive meanwhile).
            direct = not self._flushing and type(parts[0]) is not _Fds
            if not direct:
                self._queue.extend(parts)
                if type(parts[0]) is _Fds:
                    self._fd_frames += 1
                if tensors and not token:
                    self._keep.append(tensors)
                if self._flushing:
                    return
            self._flushing = True
        if direct:
            try:
                self._sendall(parts)
            except OSError as exc:
                self._write_failed(exc)
            with self._qlock:
                if not self._queue:  # (nobody queued a frame meanwhile)
                    self._flushing = False
                    return
        self._flush()

    def _flush(self) -> None:
        while True:
            with self._qlock:
                parts = self._queue
                if not parts:
                    self._flushing = False
                    self._keep = []
                    return
                self._queue = []
                keep = self._keep
                self._keep = []
                with_fds, self._fd_frames = self._fd_frames, 0
            try:
                if with_fds:
                    _sendall_fds(self.sock, parts)
                else:
                    self._sendall(parts)
            except OSError as exc:
                if with_fds:
                    _close_fds(parts)
                self._write_failed(exc)
            if with_fds:
                _close_fds(parts)
            del keep

    def _write_failed(self, exc: OSError) -> None:
        """The writing thread's write failed: drop what is queued, close, and raise."""
        with self._qlock:
            self._flushing = False
            dropped, self._queue = self._queue, []
            self._fd_frames = 0
            self._keep = []
        _close_fds(dropped)
        self.close(exc)
        raise ConnectionClosedError(f"write to rank {self.peer_rank} failed: {exc}") from exc

    # ------------------------------------------------------------------ reading

    def _read_loop(self) -> None:
        """Read until the connection ends, or until the reading is handed off.

        Inline runs (leader/follower, lazily): when a read leaves a few requests
        and an empty buffer, ``on_frames`` may return them (``(function, args)``), and this
        thread runs them itself, in order: they skip the reader -> pool hand-off on
        their way to execution.  Meanwhile nobody reads, so the reading is handed
        to another thread (``spawn``; a fresh buffer, as there is no state to pass;
        the requests not started go to the pool) when a request blocks on a
        torchwire result (``_threads.before_blocking``) or runs longer than
        ``INLINE_MAX_S`` (the watchdog).  Requests that finish first, the usual
        case, cost no thread wake-up at all; after a hand-off this thread is done.
        """
        _intraop.init_thread()  # requests may run here, in place
        _threads.set_io(True)
        try:
            self._read_until_closed()
        finally:
            # this may be a pool thread, back to running user code
            _threads.set_io(False)

    def _read_until_closed(self) -> None:
        exc: BaseException | None = None
        try:
            if self._read_frames() is _HANDED_OFF:
                return
        except (OSError, EOFError, ProtocolError, ConnectionClosedError) as e:
            exc = e
        except Exception as e:  # a bug in decoding must not leave the peer hanging
            log.exception("torchwire: reader for rank %s failed", self.peer_rank)
            exc = e
        if isinstance(exc, EOFError) and self.goodbye_received:
            exc = None
        elif exc is not None and self.closed and self.close_reason is not None:
            exc = self.close_reason  # closed here, on purpose: report why, not the EOF
        if isinstance(exc, ProtocolError):
            log.warning("torchwire: dropping connection to rank %s: %s", self.peer_rank, exc)
        self.close(exc)
        if self.lanes is not None:
            self.lanes.fail_peer(self.peer_rank, exc or ConnectionClosedError(
                f"connection to rank {self.peer_rank} closed"))
        while self._fdq:  # descriptors the peer sent for frames never read
            try:
                os.close(self._fdq.popleft())
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

    def _read_frames(self):  # noqa: C901 - the hot loop, kept in one piece
        sock = self.sock
        buf = bytearray(READ_BUF)
        mv = memoryview(buf)
        start = end = 0
        frames: list = []
        on_frames = self._on_frames
        maxsize = self._max
        header_size = F.HEADER_SIZE
        unpack_header = F.HEADER.unpack_from
        magic, version = F.MAGIC, F.VERSION
        fdq = self._fdq
        if self.shm_recv:  # descriptors may ride with the bytes: read them too
            def recv_into(view) -> int:
                got, anc, msg_flags, _ = sock.recvmsg_into([view], _ANC_SPACE, _CLOEXEC)
                for level, typ, data in anc:
                    if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                        fdq.extend(fds)
                if msg_flags & _CTRUNC:
                    raise ProtocolError("descriptors from the peer were truncated")
                return got
        else:
            recv_into = sock.recv_into

        def fill(need: int) -> None:
            """Make ``need`` bytes available at ``start`` (need <= len(buf))."""
            nonlocal start, end, frames
            if frames:
                batch, frames = frames, []
                on_frames(self, batch, False)
                del batch
            if len(buf) - start < need:
                n = end - start
                mv[0:n] = mv[start:end]
                start, end = 0, n
            while end - start < need:
                got = recv_into(mv[end:])
                if not got:
                    raise EOFError(f"rank {self.peer_rank} closed the connection")
                end += got

        def read_exact_into(dst: memoryview) -> None:
            """Copy what is buffered into ``dst``, then receive the rest directly."""
            nonlocal start, end, frames
            n = len(dst)
            have = min(end - start, n)
            if have:
                dst[0:have] = mv[start:start + have]
                start += have
            off = have
            if off < n and frames:
                batch, frames = frames, []
                on_frames(self, batch, False)
            while off < n:
                got = recv_into(dst[off:])
                if not got:
                    raise EOFError(f"rank {self.peer_rank} closed the connection mid-frame")
                off += got
                self.progress_in += 1  # a long transfer is not a silent peer

        while True:
            if end - start < header_size:
                fill(header_size)
            m, ver, kind, flags, rid, plen, nbufs, _ = unpack_header(buf, start)
            if m != magic or ver != version:
                F.decode_header(mv[start:start + header_size], maxsize)  # raises the precise error
            if kind > F.K_DATA or kind < F.K_HELLO:
                raise ProtocolError(f"unknown frame kind {kind}")
            if plen > maxsize or nbufs > F.MAX_BUFFERS:
                F.decode_header(mv[start:start + header_size], maxsize)
            start += header_size
            tensors: list = []
            if nbufs:
                need = 8 * nbufs
                if need <= len(buf):
                    if end - start < need:
                        fill(need)
                    lens = F.decode_buffer_lens(mv[start:start + need], nbufs, plen, maxsize)
                    start += need
                else:  # a table larger than the read buffer (> 32768 tensors)
                    table = bytearray(need)
                    read_exact_into(memoryview(table))
                    lens = F.decode_buffer_lens(table, nbufs, plen, maxsize)
            else:
                lens = ()
            # payload
            if end - start >= plen:
                payload = bytes(mv[start:start + plen])
                start += plen
            elif plen <= len(buf):
                fill(plen)
                payload = bytes(mv[start:start + plen])
                start += plen
            else:
                big = bytearray(plen)
                read_exact_into(memoryview(big))
                payload = big
            if kind == F.K_DATA:  # the second part of a split buffer
                if self.lanes is None or nbufs != 1 or plen != F.LANE_DATA.size:
                    raise ProtocolError("unexpected DATA frame")
                total, split = F.LANE_DATA.unpack(payload)
                if split > total or lens[0] != total - split or total > maxsize:
                    raise ProtocolError("malformed DATA frame")
                tr = self.lanes.get(self.peer_rank, rid, total)
                read_exact_into(tr.view[split:])
                self.lanes.part_done(self.peer_rank, rid, tr)
                tr = None  # kept, it would hold the buffer from the pool until the next frame
                self.bytes_in += header_size + 8 + plen + lens[0]
                continue
            release = 0
            for n in lens:
                if n & F.LANE_BIT:
                    if self.lanes is None:
                        raise ProtocolError("peer sent a split buffer on a connection "
                                            "without lanes")
                    n &= F.LEN_MASK
                    ref = bytearray(F.LANE_REF.size)
                    read_exact_into(memoryview(ref))
                    tid, split = F.LANE_REF.unpack(ref)
                    if split > n:
                        raise ProtocolError("malformed split buffer")
                    tr = self.lanes.get(self.peer_rank, tid, n)
                    read_exact_into(tr.view[:split])
                    if not self.lanes.part_done(self.peer_rank, tid, tr):
                        if frames:  # deliver what is complete before waiting
                            batch, frames = frames, []
                            on_frames(self, batch, False)
                            batch = None
                        while not tr.done.wait(0.5):
                            self.progress_in += 1
                            if self.closed:
                                raise ConnectionClosedError("closed while waiting for a lane")
                    if tr.error is not None:
                        raise ProtocolError(f"lane from rank {self.peer_rank} failed: "
                                            f"{tr.error}")
                    t = tr.tensor
                    tr = None
                elif n & F.SHM_BIT:
                    if not self.shm_recv:
                        raise ProtocolError("peer sent a shared-memory buffer on a connection "
                                            "without that channel")
                    n &= F.LEN_MASK
                    ref = bytearray(F.SHM_REF.size)
                    read_exact_into(memoryview(ref))
                    seg_id, seg_size, offset, how = F.SHM_REF.unpack(ref)
                    if how == shm.HOW_FD:
                        if not fdq:
                            raise ProtocolError("shared-memory buffer arrived without its "
                                                "descriptor")
                        t = shm.import_fd(self, fdq.popleft(), seg_id, seg_size, offset, n)
                    elif how == shm.HOW_BACK:
                        t = shm.import_back(self, seg_id, offset, n)
                    else:
                        raise ProtocolError(f"unknown shared-memory buffer mode {how}")
                elif n & F.REMOTE_BIT:
                    if self.cma_pid is None:
                        raise ProtocolError("peer sent a CMA buffer on a connection without CMA")
                    n &= ~F.REMOTE_BIT
                    ref = bytearray(F.REMOTE_REF.size)
                    read_exact_into(memoryview(ref))
                    addr, release = F.REMOTE_REF.unpack(ref)
                    t = receive_buffer(n)
                    try:
                        cma.read(self.cma_pid, addr, t.data_ptr(), n)
                    except OSError as exc:
                        raise ProtocolError(f"cannot read a buffer from rank "
                                            f"{self.peer_rank}'s memory: {exc}") from exc
                elif 0 < n <= _SMALL_BUFFER and end - start >= n:
                    # already read: a bytearray copy costs no torch call (each costs
                    # microseconds with cold caches); the unpickler types it
                    t = bytearray(mv[start:start + n])
                    start += n
                else:
                    t = receive_buffer(n)
                    if n:
                        read_exact_into(byte_view(t, n))
                tensors.append(t)
            if release:
                self._release_from_reader(release)
            if kind == F.K_RELEASE:
                if flags & F.F_SHM:
                    shm.release(self, rid, bool(flags & F.F_RETIRE))
                else:
                    with self._qlock:
                        self._cma_hold.pop(rid, None)
                continue
            if kind == F.K_CONTROL and (rid == F.CTRL_PING or rid == F.CTRL_PONG):
                self.heartbeats_in += 1
                if rid == F.CTRL_PING:
                    self._defer(self.send_control, F.CTRL_PONG)
                continue
            self.frames_in += 1
            size = header_size + 8 * nbufs + plen
            for n in lens:
                size += n & F.LEN_MASK
            self.bytes_in += size
            if kind == F.K_GOODBYE:
                self.goodbye_received = True
            frames.append((kind, flags, rid, payload, tensors))
            payload = tensors = t = None  # the frame owns them now
            if start == end:
                batch, frames = frames, []
                start = end = 0
                inline = on_frames(self, batch, self._spawn is not None)
                batch = None
                if inline is not None:
                    if self._run_inline(inline):
                        return _HANDED_OFF
                    inline = None

    def _run_inline(self, requests) -> bool:
        """Run ``requests`` (``(function, args)``) in order on this reader thread; True if the
        reading was handed off meanwhile (this thread must then stop reading; the
        requests not started by then went to the pool)."""
        _intraop.share_thread()
        run = _InlineRun(self, requests)
        t0 = run.started
        # the first request is taken before the watchdog sees the run (nobody else can)
        fn, args = run.rest.popleft()
        _watchdog.begin(run, self._fast_runs >= _TRUST_AFTER)
        local = _threads._local  # (set_io / set_inline_run, without two calls each)
        local.io = False
        local.inline = run
        try:
            while fn is not None:
                try:
                    fn(*args)
                except Exception:  # requests report their own errors; this is a bug
                    log.exception("torchwire: request from rank %s failed in place",
                                  self.peer_rank)
                fn = args = None
                fn, args = run.next()
        finally:
            local.inline = None
            local.io = True
            if not run.done:  # left by an exception: the run is over all the same
                _watchdog.end(run)
        handed = run.handed
        if handed or time.monotonic() - t0 >= _FAST_S:
            self._fast_runs = 0
        else:
            self._fast_runs += 1
        return handed

    # ------------------------------------------------------------------ closing

    def close(self, reason: BaseException | None = None) -> None:
        """Close the socket (idempotent); the reader then reports ``on_close``."""
        with self._qlock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            dropped, self._queue = self._queue, []
            self._fd_frames = 0
            self._keep = []
            self._cma_hold.clear()
        _close_fds(dropped)
        if self.shm_send or self.shm_recv:
            shm.connection_closed(self)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_goodbye(self) -> None:
        try:
            self.send_frame(F.K_GOODBYE, 0, 0, b"")
        except ConnectionClosedError:
            pass

    def join(self, timeout: float) -> None:
        """Wait until reading has ended (whichever thread holds the reader role)."""
        if threading.current_thread() is not self._reader:
            self._reader_done.wait(timeout)


_HANDED_OFF = object()  # _read_frames: another thread reads this connection now
INLINE_MAX_S = 0.002  # a request running in place longer than this hands the reading off
# A connection whose last _TRUST_AFTER inline runs each took under _FAST_S runs the
# next ones without waking the watchdog (see _Watchdog); one slower run ends that.
_FAST_S = INLINE_MAX_S / 2
_TRUST_AFTER = 16
_IDLE_POLL_S = 0.05  # the watchdog's poll between runs (bounds a trusted run's stall)
_DEEP_AFTER_S = 1.0  # without any run this long, the watchdog sleeps until the next


class _InlineRun:
    """Requests a reader thread runs in place (see ``Connection._read_loop``)."""

    __slots__ = ("conn", "rest", "started", "handed", "done")

    def __init__(self, conn: Connection, requests) -> None:
        self.conn = conn
        self.rest = collections.deque(requests)
        self.started = time.monotonic()  # of the request running now
        self.handed = False
        self.done = False

    def next(self) -> tuple:
        """``(function, args)`` of the next request to run here; or ``(None, None)``
        when all are done or the rest were handed off: the run is then over."""
        with _watchdog.lock:
            if self.handed or not self.rest:
                self.done = True
                _watchdog.runs.discard(self)
                return None, None
            self.started = time.monotonic()
            return self.rest.popleft()

    def hand_off(self) -> None:
        """Have another thread go on reading the connection (at most once); the
        requests not started yet go to the pool."""
        with _watchdog.lock:
            if self.handed or self.done:
                return
            self.handed = True
            _watchdog.runs.discard(self)
            _watchdog.handed += 1
            rest, self.rest = list(self.rest), collections.deque()
        try:
            for fn, args in rest:
                self.conn._defer(fn, *args)
            self.conn._spawn(self.conn._read_loop)
        except Exception:  # the pool is shut down: the connection is closing anyway
            log.debug("torchwire: no thread to go on reading rank %s", self.conn.peer_rank,
                      exc_info=True)


class _Watchdog:
    """Hands the reading off for inline runs that take longer than ``INLINE_MAX_S``.

    One thread per process, polling every ``INLINE_MAX_S / 2`` while some request
    runs in place.  Waking it costs a thread switch and a GIL hand-over on the
    critical path of the call, so most runs do not: a connection whose recent runs
    all finished quickly is *trusted* (see ``Connection._run_inline``), and its runs
    only register.  Between runs the thread polls every ``_IDLE_POLL_S``, so a
    trusted run that blocks after all is still handed off, at most that much later;
    after ``_DEEP_AFTER_S`` without a run it sleeps until the next one begins.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.runs: set = set()
        self.idle = False  # between runs, polling slowly: wake it for untrusted runs
        self.deep = False  # asleep until a run begins: wake it for every run
        self.pid = -1
        self.started = 0  # inline runs begun
        self.woken = 0  # of which woke the thread
        self.handed = 0  # of which handed their reading off

    def begin(self, run: _InlineRun, trusted: bool) -> None:
        if self.pid != _pid[0]:
            self._start()
        with self.lock:
            self.started += 1
            self.runs.add(run)
            if self.deep or (self.idle and not trusted):
                self.idle = self.deep = False
                self.woken += 1
                self.cond.notify()

    def end(self, run: _InlineRun) -> bool:
        with self.lock:
            run.done = True
            self.runs.discard(run)
            return run.handed

    def _start(self) -> None:
        with _start_lock:
            if self.pid == _pid[0]:
                return
            self.lock = threading.Lock()  # after a fork: the parent's may be held
            self.cond = threading.Condition(self.lock)
            self.runs = set()
            self.idle = self.deep = False
            threading.Thread(target=self._run, daemon=True, name="torchwire-watchdog").start()
            self.pid = _pid[0]

    def _run(self) -> None:
        _threads.mark_io_thread()
        period = INLINE_MAX_S / 2
        while True:
            with self.lock:
                quiet_since = None
                while not self.runs:
                    now = time.monotonic()
                    if quiet_since is None:
                        quiet_since = now
                    if now - quiet_since >= _DEEP_AFTER_S:
                        self.deep = True
                        self.cond.wait()
                        quiet_since = None
                    else:
                        self.idle = True
                        self.cond.wait(_IDLE_POLL_S)
                    self.idle = self.deep = False
            time.sleep(period)
            now = time.monotonic()
            with self.lock:
                late = [r for r in self.runs if now - r.started >= INLINE_MAX_S]
            for run in late:
                run.hand_off()


def _release_frame(token: int, flags: int) -> bytes:
    return F.HEADER.pack(F.MAGIC, F.VERSION, F.K_RELEASE, flags, token, 0, 0, 0)


_pid = [os.getpid()]  # this process's pid (os.getpid() is a system call)
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))
_watchdog = _Watchdog()


def inline_stats() -> dict:
    """Inline runs (requests run in place by a reader), how many of them woke the
    watchdog, and how many handed the reading off."""
    return {"runs": _watchdog.started, "woke_watchdog": _watchdog.woken,
            "handed_off": _watchdog.handed}


_start_lock = threading.Lock()
_transfer_ids = itertools.count(1)  # next() is atomic under the GIL
_lane_pool = None
_lane_pool_lock = threading.Lock()


def _lane_writer():
    global _lane_pool
    with _lane_pool_lock:
        if _lane_pool is None:
            _lane_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torchwire-lane")
        return _lane_pool


def _write_lane(lane, parts, tensors) -> None:
    """Write a lane's DATA frames (``tensors`` held until then).  A failed lane
    closes: the peer's reader of the main part then fails the frame."""
    try:
        lane._enqueue(parts, tensors, sum(len(p) for p in parts), 0)
    except ConnectionClosedError:
        pass


def _sendall_fds(sock: socket.socket, parts: list) -> None:
    """``_sendall`` for a queue holding ``_Fds`` markers: each marker starts a
    new ``sendmsg`` that carries its descriptors with the frame that follows."""
    start, anc = 0, None
    for i, p in enumerate(parts):
        if type(p) is _Fds:
            if i > start:
                _sendall(sock, parts[start:i], anc)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", p.fds))]
            start = i + 1
    if start < len(parts):
        _sendall(sock, parts[start:], anc)


def _sendall(sock: socket.socket, parts: list, anc=None) -> None:
    """Write every part, in order, with as few ``sendmsg`` calls as the kernel allows
    (``anc``: ancillary data for the first one)."""
    i, n = 0, len(parts)
    while i < n:
        chunk = parts[i:i + _IOV_MAX]
        if anc:
            sent = sock.sendmsg(chunk, anc)
            anc = None
        else:
            sent = sock.sendmsg(chunk)
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
