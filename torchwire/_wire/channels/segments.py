"""Shared-memory segments: the memory the shm channel (``shm.py``) moves tensors in.

A large tensor bound for a peer on this host is copied once into a *segment*
(a ``memfd`` this process owns and keeps mapped), and the segment's file
descriptor crosses the Unix socket with the frame (``SCM_RIGHTS``).  The
receiver maps it ``MAP_PRIVATE``: the tensor it builds reads the sender's pages
without copying them, its own writes go to private copy-on-write pages, and the
sender does not write the segment again until the receiver says its mapping is
gone (a RELEASE frame).  One copy end to end, and none on the receiving side.

Two cases need no copy at all:

* **Back-reference.** A received tensor sent back, unmodified, to the worker it
  came from (an echo, a parameter returned to its owner) travels as a reference
  to the owner's own segment; the owner maps it again.
* **Own segment.** A tensor that came back that way, sent on again unmodified,
  reuses the segment's descriptor.

"Unmodified" is read from ``/proc/self/pagemap``: a page of a private file
mapping that was never written is either not present or the segment's own page
(the file-page bit); a written page is an anonymous copy.

A segment's lease, on the owner (``_Segment``; ``leases``: mappings each peer
holds, ``local``: private mappings here)::

    FREE     --export (copy in, or an own segment sent on)-->  LEASED
    LEASED   --export again-->                                 LEASED (one more lease)
    LEASED   --RELEASE of its last lease, no local mapping-->  FREE
    LEASED   --its connection closes, or RELEASE with RETIRE-> TAINTED
    TAINTED  --nobody maps it here-->                          CLOSED
    FREE     --more than MAX_FREE free, or warm_limit-->       CLOSED

A FREE segment stays mapped for reuse (its pages faulted in, so the next copy runs
at memory speed) while mappings stay under ``warm_limit``; beyond it a leased one
is unmapped until it comes back.  A sender that needs a big segment while the one
its peer just sent back is still LEASED waits briefly for that RELEASE
(``_await_release``) rather than create a new one.  The kernel frees a segment's
pages when the last descriptor and mapping anywhere are gone, so a peer that dies
leaves nothing behind.

A fork copies this process's private mappings into the child, where no lease
covers them: a mapping alive at a fork is *retired* when it dies here (RELEASE
with RETIRE; an own segment is tainted), and a child never releases what it
inherited.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import os
import stat
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..._base.errors import ConnectionClosedError, ProtocolError
from ..._base.threads import in_io_thread

HOW_FD = 1  # the segment's descriptor travels with the frame
HOW_BACK = 2  # a segment of the receiver's own, returned unmodified

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PROT_RW = 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_POPULATE = 0x01, 0x02, 0x8000
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
MAX_FREE = 8  # released segments kept for reuse (oldest closed first)
_COPY_SPLIT = 8 << 20  # copies larger than this are split across threads
_WAIT_MIN = 16 << 20  # below this, a new segment costs less than waiting for a release
_VAIN_MAX = 2  # waits for a peer's releases that may time out before it is not waited for
_WAIT_MAX_S = 0.5  # the longest wait for a release
_FAULT_RATE = 2e9  # bytes/s, about: what creating a segment costs bounds a wait for one

_libc = None
if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.restype = ctypes.c_int
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        _libc = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def available() -> bool:
    """memfd, fd passing and pagemap: all the shm channel needs (Linux)."""
    return _libc is not None and os.path.exists("/proc/self/pagemap")


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _map(fd: int, length: int, flags: int, offset: int = 0) -> int:
    addr = _libc.mmap(None, length, _PROT_RW, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return addr


def _unmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


# ----------------------------------------------------------------- copying

_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def copy(dst: int, src: int, n: int) -> None:
    """memcpy ``n`` bytes, large ones on every core (memory bandwidth scales with
    threads on the machines measured; ctypes releases the GIL)."""
    global _copier
    parts = min(os.cpu_count() or 1, max(1, n // _COPY_SPLIT))
    if parts <= 1:
        ctypes.memmove(dst, src, n)
        return
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                         thread_name_prefix="torchwire-copy")
    step = _round_up(-(-n // parts))
    futs = [_copier.submit(ctypes.memmove, dst + off, src + off, min(step, n - off))
            for off in range(step, n, step)]
    ctypes.memmove(dst, src, min(step, n))
    for f in futs:
        f.result()


# ----------------------------------------------------------------- pagemap

_pagemap = (-1, -1)  # (pid, fd): /proc/self/pagemap names the opener's process


def _pagemap_fd() -> int:
    global _pagemap
    pid, fd = _pagemap
    if pid != os.getpid():  # first use, or a forked child holding the parent's
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        _pagemap = (os.getpid(), fd)
    return fd


def prepare() -> None:
    """Open what the channel keeps open for the life of the process (the pagemap,
    the release thread's pipe) now, at ``init_rpc``, not during a transfer."""
    _pagemap_fd()
    _releaser.start()


def unmodified(addr: int, n: int) -> bool:
    """Were the pages under ``[addr, addr + n)`` of a private file mapping never
    written (each either absent or still the file's page)?"""
    fd = _pagemap_fd()
    first, last = addr // PAGE, (addr + n - 1) // PAGE
    count = last - first + 1
    data = bytearray(os.pread(fd, 8 * count, 8 * first))
    if len(data) != 8 * count:
        return False
    e = torch.frombuffer(data, dtype=torch.int64)
    present = e < 0  # bit 63
    swapped = ((e >> 62) & 1).bool()
    file_page = ((e >> 61) & 1).bool()
    return not bool((present & ~file_page).any() or swapped.any())


# ----------------------------------------------------------------- segments

def _check_open(conn) -> None:
    """A lease is taken only while ``conn`` is open: ``connection_closed`` (which
    runs after ``conn.closed`` is set, under the same lock) ends them all."""
    if conn.closed:
        raise ConnectionClosedError(f"connection to rank {conn.peer_rank} is closed")


class _Segment:
    __slots__ = ("id", "fd", "size", "addr", "leases", "local", "tainted", "echoed")

    def __init__(self, seg_id: int, fd: int, size: int) -> None:
        self.id = seg_id
        self.fd = fd
        self.size = size
        self.addr = 0  # our shared read-write mapping, 0 while unmapped
        self.leases: dict = {}  # connection -> mappings the peer holds
        self.local = 0  # private mappings of it in this process
        self.tainted = False  # leased to a peer now gone: never written again
        self.echoed = False  # the peer sent it back to us: its release is likely on its way

    @property
    def busy(self) -> bool:
        return bool(self.leases) or self.local > 0


class _Mapping:
    """A private mapping this process holds of a segment (received or its own)."""

    __slots__ = ("base", "length", "seg_id", "seg_off", "conn", "own", "pid", "forked")

    def __init__(self, base, length, seg_id, seg_off, conn, own) -> None:
        self.base, self.length = base, length
        self.seg_id, self.seg_off = seg_id, seg_off
        self.conn, self.own = conn, own
        self.pid = os.getpid()  # a forked child's copy holds no lease
        self.forked = False  # alive at a fork: a child may still map it


class _Releaser:
    """Sends RELEASE frames for mappings that died.

    A mapping dies wherever its last tensor is freed: on any thread, possibly
    inside a lock that sending needs (a connection dropping sent tensors under
    its queue lock, or the cyclic garbage collector anywhere).  So the callback
    only appends to a deque and writes a byte to a pipe; this thread does the
    sending.
    """

    def __init__(self) -> None:
        self.pid = -1
        self.items: collections.deque = collections.deque()
        self.wfd = -1

    def post(self, conn, seg_id: int, retire: bool) -> None:
        self.items.append((conn, seg_id, retire))
        self.start()
        try:
            os.write(self.wfd, b"r")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def start(self) -> None:
        if self.pid == os.getpid():
            return
        with _start_lock:
            if self.pid == os.getpid():
                return
            rfd, wfd = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(wfd, False)
            self.wfd = wfd
            threading.Thread(target=self._run, args=(rfd,), daemon=True,
                             name="torchwire-shm-release").start()
            self.pid = os.getpid()

    def _run(self, rfd: int) -> None:
        while True:
            os.read(rfd, 4096)
            while self.items:
                conn, seg_id, retire = self.items.popleft()
                try:
                    conn.send_release(seg_id, shm=True, retire=retire)
                except Exception:  # a closed connection: its peer's leases ended with it
                    pass


_start_lock = threading.Lock()
_releaser = _Releaser()


class _Segments:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # weakref callbacks may run inside a locked section
        self.settled = threading.Condition(self.lock)  # a segment joined self.free
        self.vain: dict = {}  # connection -> waits for its releases that timed out
        self.segs: dict[int, _Segment] = {}
        self.free: list[_Segment] = []
        self.mapped = 0  # bytes of shared mappings this process holds
        self.warm_limit = 1 << 30
        self.next_id = 0
        self.bases: list[int] = []  # sorted bases of self.maps
        self.maps: dict[int, _Mapping] = {}
        self.views: dict[int, tuple] = {}  # id(view) -> (weakref, mapping)
        self.counters = dict(created=0, reused=0, copies=0, copied_bytes=0, sent_back=0,
                             sent_own=0, received=0, released=0, waits=0, vain_waits=0)

    # ------------------------------------------------------------ sending

    def export(self, t: torch.Tensor, n: int, conn):
        """How to send ``n`` bytes at ``t.data_ptr()`` to ``conn``'s peer.

        Returns:
            ``(seg_id, seg_size, offset, how, fd)``; ``fd`` (only for ``HOW_FD``)
            is a duplicate the caller owns and must close once sent.
        """
        addr = t.data_ptr()
        m = self._find(addr)
        if m is not None and addr + n <= m.base + m.length and unmodified(addr, n):
            offset = addr - m.base + m.seg_off
            with self.lock:
                _check_open(conn)
                if not m.own and m.conn is conn:
                    self.counters["sent_back"] += 1
                    return m.seg_id, 0, offset, HOW_BACK, None
                seg = self.segs.get(m.seg_id) if m.own else None
                if seg is not None:
                    seg.leases[conn] = seg.leases.get(conn, 0) + 1
                    self.counters["sent_own"] += 1
                    return seg.id, seg.size, offset, HOW_FD, os.dup(seg.fd)
        seg = self._acquire(n)
        try:
            copy(seg.addr, addr, n)
        except BaseException:
            with self.lock:
                self._settle(seg)
            raise
        with self.lock:
            try:
                _check_open(conn)
            except ConnectionClosedError:
                self._settle(seg)
                raise
            seg.leases[conn] = seg.leases.get(conn, 0) + 1
            self.counters["copies"] += 1
            self.counters["copied_bytes"] += n
            return seg.id, seg.size, 0, HOW_FD, os.dup(seg.fd)

    def _acquire(self, n: int) -> _Segment:
        size = _round_up(n)
        with self.lock:
            best = None
            for s in self.free:
                if size <= s.size < 2 * size and (best is None or s.size < best.size):
                    best = s
            if best is None and size >= _WAIT_MIN and not in_io_thread():
                best = self._await_release(size)
            if best is not None:
                self.free.remove(best)
                self.counters["reused"] += 1
                seg = best
                seg.echoed = False
            else:
                fd = os.memfd_create("torchwire", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                try:
                    os.ftruncate(fd, size)
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # no SIGBUS for mappers
                except BaseException:
                    os.close(fd)
                    raise
                self.next_id += 1
                seg = _Segment(self.next_id, fd, size)
                self.segs[seg.id] = seg
                self.counters["created"] += 1
            if not seg.addr:
                self._make_room(seg.size)
                seg.addr = _map(seg.fd, seg.size, _MAP_SHARED | _MAP_POPULATE)
                self.mapped += seg.size
            return seg

    def _await_release(self, size: int) -> _Segment | None:
        """Wait (briefly) for a leased segment that fits ``size`` to come back.

        The echo pattern (send a tensor, get it back, send again) races the peer's
        RELEASE, which leaves after its reply: losing the race means creating and
        faulting in a new segment, which costs far more than waiting for the release.
        Only a segment the peer already sent back and we no longer map qualifies, and
        the wait is bounded by about what creating one would cost.  A peer that keeps
        what it sends back (a parameter server returning a stored tensor) would make
        every such wait vain: after ``_VAIN_MAX`` vain waits for one connection, its
        segments are not waited for again.  Called with ``self.lock`` held.
        """
        cand = None
        for s in self.segs.values():
            if (size <= s.size < 2 * size and s.echoed and not s.local and not s.tainted
                    and len(s.leases) == 1):
                conn = next(iter(s.leases))
                if self.vain.get(conn, 0) < _VAIN_MAX:
                    cand = s
                    break
        if cand is None:
            return None
        self.counters["waits"] += 1
        self.settled.wait_for(lambda: cand in self.free or cand.id not in self.segs
                              or cand.tainted, timeout=min(_WAIT_MAX_S, size / _FAULT_RATE))
        if cand in self.free:
            self.vain.pop(conn, None)
            return cand
        self.vain[conn] = self.vain.get(conn, 0) + 1
        self.counters["vain_waits"] += 1
        return None

    def _make_room(self, size: int) -> None:
        """Close released segments, then unmap leased ones, until ``size`` more
        bytes of mappings fit under ``warm_limit``."""
        while self.mapped + size > self.warm_limit and self.free:
            self._close(self.free.pop(0))
        if self.mapped + size > self.warm_limit:
            for s in self.segs.values():
                if s.addr and s.busy:
                    _unmap(s.addr, s.size)
                    s.addr = 0
                    self.mapped -= s.size
                    if self.mapped + size <= self.warm_limit:
                        break

    def _close(self, seg: _Segment) -> None:
        if seg.addr:
            _unmap(seg.addr, seg.size)
            self.mapped -= seg.size
            seg.addr = 0
        os.close(seg.fd)
        self.segs.pop(seg.id, None)

    def _settle(self, seg: _Segment) -> None:
        """A segment nobody maps any more: recycle it, or close it if tainted."""
        if seg.busy or seg.id not in self.segs:
            return
        if seg.tainted or self.warm_limit == 0:
            self._close(seg)
        else:
            self.free.append(seg)
            while len(self.free) > MAX_FREE:  # bound descriptors and mappings too
                self._close(self.free.pop(0))
            self.settled.notify_all()

    def release(self, conn, seg_id: int, retire: bool = False) -> None:
        """``conn``'s peer has unmapped one lease of segment ``seg_id`` (``retire``:
        a process it forked may still map it: never write it again)."""
        with self.lock:
            seg = self.segs.get(seg_id)
            if seg is None or conn not in seg.leases:
                return  # idempotent: already settled by a close
            self.counters["released"] += 1
            if retire:
                seg.tainted = True
            if seg.leases[conn] <= 1:
                del seg.leases[conn]
            else:
                seg.leases[conn] -= 1
            self._settle(seg)

    def connection_closed(self, conn) -> None:
        """The peer of ``conn`` is gone or cut off: its leases end, and what it
        may still map is never written again."""
        with self.lock:
            for seg in list(self.segs.values()):
                if seg.leases.pop(conn, None) is not None:
                    seg.tainted = True
                    if seg in self.free:
                        self.free.remove(seg)
                    self._settle(seg)
            for m in self.maps.values():
                if m.conn is conn:
                    m.conn = None  # no back-references on another connection
            self.vain.pop(conn, None)
            self.settled.notify_all()  # a sender waiting for one of its segments gives up

    def leased_bytes(self, conn) -> int:
        """Bytes of the segments ``conn``'s peer holds leases on."""
        with self.lock:
            return sum(s.size for s in self.segs.values() if conn in s.leases)

    def leased_to(self, conn) -> int:
        """Leases ``conn``'s peer holds (mappings it has not released)."""
        with self.lock:
            return sum(s.leases.get(conn, 0) for s in self.segs.values())

    # ------------------------------------------------------------ receiving

    def import_fd(self, conn, fd: int, seg_id: int, seg_size: int, offset: int,
                  n: int) -> torch.Tensor:
        """Map a segment a peer sent (``fd`` is ours: always closed here)."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < seg_size or offset + n > seg_size:
                raise ProtocolError(f"shared-memory buffer of {n} bytes at {offset} does not "
                                    f"fit the segment sent ({st.st_size} bytes)")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise ProtocolError("shared-memory segment is not sealed against shrinking")
            start = offset // PAGE * PAGE
            length = _round_up(offset + n) - start
            base = _map(fd, length, _MAP_PRIVATE, start)
        except OSError as exc:
            raise ProtocolError(f"cannot map a shared-memory buffer: {exc}") from exc
        finally:
            os.close(fd)
        with self.lock:
            self.counters["received"] += 1
        return self._lend(_Mapping(base, length, seg_id, start, conn, False), offset - start, n)

    def import_back(self, conn, seg_id: int, offset: int, n: int) -> torch.Tensor:
        """Map our own segment ``seg_id``, returned unmodified by ``conn``'s peer."""
        with self.lock:
            seg = self.segs.get(seg_id)
            if seg is None or conn not in seg.leases or offset + n > seg.size:
                raise ProtocolError(f"peer returned shared-memory segment {seg_id}, which "
                                    f"it does not hold")
            start = offset // PAGE * PAGE
            length = _round_up(offset + n) - start
            try:
                base = _map(seg.fd, length, _MAP_PRIVATE, start)
            except OSError as exc:
                raise ProtocolError(f"cannot map shared-memory segment {seg_id}: {exc}") from exc
            seg.local += 1
            seg.echoed = True
        return self._lend(_Mapping(base, length, seg_id, start, None, True), offset - start, n)

    def _lend(self, m: _Mapping, skip: int, n: int) -> torch.Tensor:
        arr = (ctypes.c_ubyte * m.length).from_address(m.base)
        view = memoryview(arr).cast("B")[skip:skip + n]
        key = id(view)

        def unmapped(_ref, key=key) -> None:
            with self.lock:
                entry = self.views.pop(key, None)
                if entry is None:
                    return
                mp = entry[1]
                self.maps.pop(mp.base, None)
                i = bisect.bisect_left(self.bases, mp.base)
                if i < len(self.bases) and self.bases[i] == mp.base:
                    del self.bases[i]
                _unmap(mp.base, mp.length)
                if mp.pid != os.getpid():
                    return  # inherited through a fork: the lease is the parent's
                if mp.own:
                    seg = self.segs.get(mp.seg_id)
                    if seg is not None:
                        seg.local -= 1
                        seg.tainted = seg.tainted or mp.forked
                        self._settle(seg)
                    return
                conn = mp.conn
            if conn is not None:
                _releaser.post(conn, mp.seg_id, mp.forked)

        with self.lock:
            self.views[key] = (weakref.ref(view, unmapped), m)
            self.maps[m.base] = m
            bisect.insort(self.bases, m.base)
        return torch.frombuffer(view, dtype=torch.uint8)

    # ------------------------------------------------------------ fork

    def before_fork(self) -> None:
        """Mark every mapping alive now as forked; the lock is held across the fork
        so that no mapping appears in between."""
        self.lock.acquire()
        for m in self.maps.values():
            m.forked = True

    def after_fork_in_parent(self) -> None:
        self.lock.release()

    def after_fork_in_child(self) -> None:
        self.lock = threading.RLock()  # the parent's may be held by a thread not copied
        self.settled = threading.Condition(self.lock)

    def _find(self, addr: int) -> _Mapping | None:
        with self.lock:
            i = bisect.bisect_right(self.bases, addr) - 1
            if i < 0:
                return None
            m = self.maps[self.bases[i]]
            return m if addr < m.base + m.length else None

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters, segments=len(self.segs), free=len(self.free),
                        leased=sum(1 for s in self.segs.values() if s.leases),
                        mapped_bytes=self.mapped, mappings=len(self.maps),
                        own_mappings=sum(1 for m in self.maps.values() if m.own))

    def clear(self) -> None:
        """Close every released segment (at shutdown, and for tests)."""
        with self.lock:
            while self.free:
                self._close(self.free.pop())


_segments = _Segments()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_segments.before_fork,
                        after_in_parent=_segments.after_fork_in_parent,
                        after_in_child=_segments.after_fork_in_child)
export = _segments.export
release = _segments.release
connection_closed = _segments.connection_closed
import_fd = _segments.import_fd
import_back = _segments.import_back
stats = _segments.stats
leased_to = _segments.leased_to
leased_bytes = _segments.leased_bytes
clear = _segments.clear
