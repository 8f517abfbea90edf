"""The read loop of one connection.

One ``recv_into`` fills a 256 KiB buffer and every complete frame in it is decoded,
so a burst of small messages costs one system call.  A buffer of up to
``SMALL_BUFFER`` bytes that is already whole in the read buffer is copied into a
``bytearray`` right here (no torch call, no Python call: each costs microseconds
with the caches cold between messages); any other buffer goes to its channel: the
socket channel receives one larger than what is buffered straight into its final
tensor storage, and a buffer with a channel bit goes to the channel registered for
that bit on the connection.

The frames decoded from one read are handed to ``on_frames`` as one batch.  When a
batch ends the buffer (the reader is *at rest*), ``on_frames`` may run requests on
this thread and hand the reading to another one meanwhile; it then returns True and
this loop stops (``HANDED_OFF``).  The other thread starts afresh: at rest there is
no state to pass.  A batch that held requests and ended at rest is followed by a
short poll of the socket before the reader sleeps (``polling.py``): the next request
is often close behind.

A caller waiting for its reply may borrow the reading of a resting connection
(``lending.py``): :func:`read_borrowed` runs the same loop on the caller's thread,
reading exact sizes (never past a frame's end) and only when the socket is readable
before its reply's deadline, and dispatching every frame with ``at_rest`` False
(requests go to the pool) until its reply is in.

Errors end the loop: the end of the stream or an ``OSError`` becomes a
``ConnectionBrokenError`` (the ``OSError`` as its cause), except that the end of the
stream after the peer's GOODBYE is an orderly close (no error).
"""

from __future__ import annotations

import array
import logging
import math
import select
import _signal  # signal's C functions: its Python wrappers cost ~10 µs a call
import socket
import threading
import time

from .._base import threads as _threads
from .._base.errors import ConnectionBrokenError, LinkError, ProtocolError
from . import frame as F
from .buffers import read_faulting, receive_bytes
from .channels.socket import SOCKET

log = logging.getLogger("torchwire")

READ_BUF = 256 * 1024
SMALL_BUFFER = 64 << 10  # buffers up to this size, already read, become bytearrays
HANDED_OFF = object()  # run(): another thread reads this connection now
_LEFT = object()  # _read(): a borrower's wait ended (its reply is in, or it gave up)
_WAIT_SLICE_MS = 50  # a borrower re-checks its reply at least this often
_ANC_SPACE = socket.CMSG_SPACE(253 * 4) if hasattr(socket, "CMSG_SPACE") else 0
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_CTRUNC = int(getattr(socket, "MSG_CTRUNC", 0))
_DONTWAIT = int(getattr(socket, "MSG_DONTWAIT", 0))
_SIGINT = _signal.SIGINT
_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)
RCVLOWAT = 256 << 10  # a long read over TCP wakes once per this many bytes ...
BATCHED_MIN = 4 << 20  # ... when this many or more are left to read
_MAIN_IDENT = threading.main_thread().ident


class Stream:
    """What a channel's decoder may do with the stream it reads a buffer from.

    Attributes:
        read_exact_into: ``read_exact_into(view)``: fill ``view`` from the stream
            (what is buffered first, then straight from the socket).
        read_ref: ``read_ref(struct) -> tuple``: read and unpack a channel reference.
        deliver: hand the frames decoded so far to ``on_frames`` (before a wait).
        ack: a token to RELEASE once the frame's buffers are read (0: none).
    """

    __slots__ = ("read_exact_into", "read_ref", "deliver", "ack")

    def __init__(self, read_exact_into, read_ref, deliver) -> None:
        self.read_exact_into = read_exact_into
        self.read_ref = read_ref
        self.deliver = deliver
        self.ack = 0


def run(conn):
    """Read ``conn`` until it ends or its reading is handed off.

    Returns:
        ``HANDED_OFF``; or why reading ended: None after the peer's GOODBYE, else a
        torchwire error (``ConnectionBrokenError``, ``ProtocolError``, a
        ``LinkError`` of a channel) or, for a bug here, the exception itself.
    """
    try:
        return _read(conn)
    except EOFError as exc:
        if conn.goodbye_received:
            return None
        return _broken(exc)
    except OSError as exc:
        return _broken(exc)
    except (ProtocolError, LinkError) as exc:
        return exc
    except BaseException as exc:  # a bug (or a SystemExit) must not leave the peer hanging
        log.exception("torchwire: reader for rank %s failed", conn.peer_rank)
        return exc


def _broken(exc: BaseException) -> ConnectionBrokenError:
    err = ConnectionBrokenError(str(exc))
    err.__cause__ = exc
    return err


class _BorrowerBuffer(threading.local):
    buf: bytearray | None = None


_borrower = _BorrowerBuffer()


def read_borrowed(conn, role, done, deadline: float | None, idle, loop_fd: int = -1,
                  until: float | None = None) -> None:
    """A caller's thread, holding ``role`` borrowed (``lending.py``): read ``conn``
    until ``done()``, then give the reading back: lent on if ``idle()`` (no call
    pending on ``conn``), else to the reader.

    Waits for the socket only until ``deadline`` (``time.monotonic()``; the reply's
    own deadline, when its timer completes it) and re-checks ``done()`` every
    ``_WAIT_SLICE_MS``.  The end of the stream, or an error inside a frame, goes
    back to the reader, which ends the connection (failing the pending calls, this
    one's too).  Raises only what interrupts the thread (``KeyboardInterrupt``).

    An idle event loop's thread passes its selector's descriptor (``loop_fd``) and
    its next timer (``until``): it stops waiting as soon as either is due (the loop
    has something else to do), and the reader reads the reply.
    """
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    if loop_fd >= 0:
        poller.register(loop_fd, select.POLLIN)
    monotonic = time.monotonic
    waiting = conn.reply_poll  # polls for a window before it sleeps (polling.py)

    def poll_now(_ms):
        events = poller.poll(0)
        if not events:
            raise BlockingIOError
        return events

    # [between frames (stopping inside one breaks the stream), Ctrl-C came inside one]
    clean = [True, False]

    def ready() -> bool:
        if clean[1]:  # Ctrl-C came inside the last frame
            raise KeyboardInterrupt
        while not done():
            if role.closing:
                return False
            ms = _WAIT_SLICE_MS
            if deadline is not None:
                ms = min(ms, max(1, math.ceil((deadline - monotonic()) * 1000)))
            if until is not None:
                left = until - monotonic()
                if left <= 0:
                    return False
                ms = min(ms, max(1, math.ceil(left * 1000)))
            events = waiting.read(poll_now, poller.poll, ms)
            if events:
                return loop_fd < 0 or all(fd != loop_fd for fd, _ev in events)
        return False

    buf = _borrower.buf
    if buf is None:
        buf = _borrower.buf = bytearray(READ_BUF)
    was_io = _threads.in_io_thread()
    _threads.set_io(True)  # as on a reader: user callbacks go to the pool
    sigint = _defer_sigint(clean)
    try:
        _read(conn, ready, clean, buf)
        wake = not idle()
    except EOFError:  # the reader finds the end too, and ends the connection
        wake = True
    except BaseException as exc:
        if clean[0]:  # interrupted waiting for a frame: nothing is half-read
            role.give_back(True)
            raise
        if isinstance(exc, OSError):
            error: BaseException = _broken(exc)
        elif isinstance(exc, (ProtocolError, LinkError)):
            error = exc
        else:
            if isinstance(exc, Exception):
                log.exception("torchwire: reading rank %s on a caller's thread failed",
                              conn.peer_rank)
            error = ConnectionBrokenError(
                f"reading from rank {conn.peer_rank} stopped inside a frame: {exc!r}")
            error.__cause__ = exc
        role.give_back(True, error)
        if not isinstance(exc, Exception):
            raise
        return
    finally:
        _threads.set_io(was_io)
        if sigint is not None:
            _signal.signal(_SIGINT, sigint)
    role.give_back(wake)


def _read_batched(sock: socket.socket, dst: memoryview, off: int, conn) -> int:
    """Receive ``dst[off:]`` but its last bytes with ``SO_RCVLOWAT`` at ``RCVLOWAT``:
    the kernel then wakes the reader once per that many bytes instead of once per
    segment, and the reader copies them in larger pieces (BENCHMARKS.md, fourteenth
    session).  Returns the new offset; the caller reads the rest as usual.

    The kernel wakes a waiting ``recv`` only when ``RCVLOWAT`` bytes are queued,
    however many it has copied already, so each ``recv`` asks for all but the last
    ``RCVLOWAT`` bytes of the buffer: whenever it waits, at least that many more are
    still to come.  Not on a connection whose receive buffer is still small: there
    setting the mark would also clamp its window to it."""
    n = len(dst)
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < 4 * RCVLOWAT:
            return off
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, RCVLOWAT)
    except OSError:
        return off  # the read that follows reports a broken socket
    try:
        last = n - RCVLOWAT
        while last - off >= RCVLOWAT:
            got = sock.recv_into(dst[off:last])
            if not got:
                raise EOFError(f"rank {conn.peer_rank} closed the connection mid-frame")
            off += got
            conn.progress_in += 1  # a long transfer is not a silent peer
    finally:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        except OSError:
            pass
    return off


def _defer_sigint(clean):
    """On the main thread under Python's own SIGINT handler: a handler that raises
    ``KeyboardInterrupt`` between frames (``clean[0]``), as Python's would, but only
    notes one that comes while a frame is read (``clean[1]``: the stream would
    break); returns the handler to restore, or None where nothing was changed."""
    if threading.get_ident() != _MAIN_IDENT:
        return None
    previous = _signal.getsignal(_SIGINT)
    if previous is not _signal.default_int_handler:
        return None

    def on_sigint(signum, frame):
        if clean[0]:
            raise KeyboardInterrupt
        clean[1] = True

    _signal.signal(_SIGINT, on_sigint)
    return previous


def _read(conn, ready=None, clean=None, buf=None):  # noqa: C901 - the hot loop, in one piece
    """The read loop; a borrower's (``read_borrowed``) passes ``ready()``, asked
    before each frame (False: stop), ``clean`` (``clean[0]``: between frames) and its
    buffer, and reads exact sizes."""
    sock = conn.sock
    exact = ready is not None
    if buf is None:
        buf = bytearray(READ_BUF)
    mv = memoryview(buf)
    start = end = 0
    frames: list = []
    on_frames = conn.on_frames
    maxsize = conn.max_message_size
    channels = conn.channels
    decoders = channels.receive
    socket_decode = SOCKET.decode
    header_size = F.HEADER_SIZE
    unpack_header = F.HEADER.unpack_from
    decode_buffer_lens = F.decode_buffer_lens
    magic, version, max_buffers = F.MAGIC, F.VERSION, F.MAX_BUFFERS
    k_first, k_last = F.K_HELLO, F.K_DATA
    k_data, k_release, k_control, k_goodbye = F.K_DATA, F.K_RELEASE, F.K_CONTROL, F.K_GOODBYE
    ping, pong = F.CTRL_PING, F.CTRL_PONG
    channel_bits, len_mask = F.CHANNEL_BITS, F.LEN_MASK
    small = SMALL_BUFFER
    fdq = conn.fds
    peer = conn.peer_rank
    if channels.fd_passing:  # descriptors may ride with the bytes: read them too
        def take_fds(anc, msg_flags) -> None:
            for level, typ, data in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                    fdq.extend(fds)
            if msg_flags & _CTRUNC:
                raise ProtocolError("descriptors from the peer were truncated")

        def recv_into(view) -> int:
            got, anc, msg_flags, _ = sock.recvmsg_into([view], _ANC_SPACE, _CLOEXEC)
            take_fds(anc, msg_flags)
            return got

        def recv_nowait(view) -> int:
            got, anc, msg_flags, _ = sock.recvmsg_into([view], _ANC_SPACE,
                                                       _CLOEXEC | _DONTWAIT)
            take_fds(anc, msg_flags)
            return got
    else:
        recv_into = sock.recv_into

        def recv_nowait(view) -> int:
            return recv_into(view, 0, _DONTWAIT)
    # a long read over TCP (not TLS: its reads are its own) wakes per RCVLOWAT bytes
    batched = (type(sock) is socket.socket and not channels.fd_passing
               and sock.family in _TCP_FAMILIES)
    # after serving, poll before sleeping (not over TLS: its reads are its own)
    poll = conn.poll if (conn.poll.max_ns and _DONTWAIT and not exact
                         and isinstance(sock, socket.socket)) else None

    def deliver() -> None:
        nonlocal frames
        if frames:
            batch, frames = frames, []
            on_frames(conn, batch, False)

    def fill(need: int) -> None:
        """Make ``need`` bytes available at ``start`` (need <= len(buf))."""
        nonlocal start, end
        if frames:
            deliver()
        if len(buf) - start < need:
            n = end - start
            mv[0:n] = mv[start:end]
            start, end = 0, n
        while end - start < need:
            got = recv_into(mv[end:start + need] if exact else mv[end:])
            if not got:
                raise EOFError(f"rank {peer} closed the connection")
            end += got

    def read_exact_into(dst: memoryview) -> None:
        """Copy what is buffered into ``dst``, then receive the rest directly."""
        nonlocal start
        n = len(dst)
        have = min(end - start, n)
        if have:
            dst[0:have] = mv[start:start + have]
            start += have
        off = have
        if off < n and frames:
            deliver()
        if batched and n - off >= BATCHED_MIN:
            off = _read_batched(sock, dst, off, conn)
        while off < n:
            got = recv_into(dst[off:])
            if not got:
                raise EOFError(f"rank {peer} closed the connection mid-frame")
            off += got
            conn.progress_in += 1  # a long transfer is not a silent peer

    def read_ref(ref):
        data = bytearray(ref.size)
        read_exact_into(memoryview(data))
        return ref.unpack(data)

    rx = Stream(read_exact_into, read_ref, deliver)
    k_request = F.K_REQUEST
    served = False  # the batch being read holds a request

    while True:
        if end - start < header_size:
            if exact:  # (a borrower: always between frames here)
                clean[0] = True
                if not ready():
                    return _LEFT
                clean[0] = False
            fill(header_size)
        m, ver, kind, flags, rid, plen, nbufs = unpack_header(buf, start)
        if m != magic or ver != version:
            F.decode_header(mv[start:start + header_size], maxsize)  # raises the precise error
        if kind > k_last or kind < k_first:
            raise ProtocolError(f"unknown frame kind {kind}")
        if plen > maxsize or nbufs > max_buffers:
            F.decode_header(mv[start:start + header_size], maxsize)
        start += header_size
        tensors: list = []
        if nbufs:
            need = 8 * nbufs
            if need <= READ_BUF:
                if end - start < need:
                    fill(need)
                lens = decode_buffer_lens(mv[start:start + need], nbufs, plen, maxsize)
                start += need
            else:  # a table larger than the read buffer (> 32768 tensors)
                table = bytearray(need)
                read_exact_into(memoryview(table))
                lens = decode_buffer_lens(table, nbufs, plen, maxsize)
        else:
            lens = ()
        if end - start >= plen:
            payload = bytes(mv[start:start + plen])
            start += plen
        elif plen <= READ_BUF:
            fill(plen)
            payload = bytes(mv[start:start + plen])
            start += plen
        else:
            payload, fresh = receive_bytes(plen)
            read_faulting(read_exact_into, payload, fresh)
        if kind == k_data:  # on a lane: the second part of a split buffer
            channels.read_data(conn, rx, rid, lens, payload)
            conn.lane = True
            conn.bytes_in += header_size + 8 + plen + lens[0]
            continue
        by_channel = False
        for n in lens:
            if 0 < n <= small and end - start >= n:
                t = bytearray(mv[start:start + n])
                start += n
            elif n & channel_bits:
                ch = decoders.get(n & channel_bits)
                if ch is None:
                    raise channels.unknown(n & channel_bits)
                t = ch.decode(conn, rx, n & len_mask)
                by_channel = True
            else:
                t = socket_decode(conn, rx, n)
            tensors.append(t)
        if by_channel and rx.ack:
            token, rx.ack = rx.ack, 0
            conn.release_from_reader(token)
        if kind == k_release:
            channels.released(conn, rid, flags)
            continue
        if kind == k_control and (rid == ping or rid == pong):
            conn.heartbeats_in += 1
            if rid == ping:
                conn.defer(conn.send_control, pong)
            continue
        conn.frames_in += 1
        size = header_size + 8 * nbufs + plen
        for n in lens:
            size += n & len_mask
        conn.bytes_in += size
        if kind == k_request:
            served = True
        elif kind == k_goodbye:
            conn.goodbye_received = True
        frames.append((kind, flags, rid, payload, tensors))
        payload = tensors = t = None  # the frame owns them now
        if start == end:
            batch, frames = frames, []
            start = end = 0
            if on_frames(conn, batch, not exact):
                return HANDED_OFF
            batch = None
            if served and poll is not None:  # the next request may be close
                served = False
                end = poll.read(recv_nowait, recv_into, mv)
                if not end:
                    raise EOFError(f"rank {peer} closed the connection")
