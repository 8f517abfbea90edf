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

The receiving side (private mappings, kept mapped for the next message, and the
release thread) is ``mappings.py``; copying and the pagemap are ``memory.py``.
This module is the channel's interface to both.

A segment's lease, on the owner (``_Segment``; ``leases``: mappings each peer
holds, ``local``: private mappings here)::

    FREE     --export (copy in, or an own segment sent on)-->  LEASED
    LEASED   --export again-->                                 LEASED (one more lease)
    LEASED   --RELEASE of its last lease, no local mapping-->  FREE
    LEASED   --its connection closes, or RELEASE with RETIRE-> TAINTED
    TAINTED  --nobody maps it here-->                          CLOSED
    FREE     --more than MAX_FREE free, or warm_limit-->       CLOSED
    CLOSED   --FORGET to every open peer it was sent to: they unmap their cached
               mapping of it (mappings.py)

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

import fcntl
import os
import threading
import time

import torch

from ..._base.errors import ConnectionClosedError, ProtocolError
from ..._base.threads import in_io_thread
from . import memory as M
from .mappings import mappings as _mappings
from .mappings import releaser as _releaser

HOW_FD = 1  # the segment's descriptor travels with the frame
HOW_BACK = 2  # a segment of the receiver's own, returned unmodified

PAGE = M.PAGE
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
MAX_FREE = 128  # released segments kept for reuse (oldest closed first)
_WAIT_MIN = 16 << 20  # below this, a new segment costs less than waiting for a release
_VAIN_MAX = 2  # waits for a peer's releases that may time out before it is not waited for
_WAIT_MAX_S = 0.5  # the longest wait for a release
_FAULT_RATE = 2e9  # bytes/s, about: what creating a segment costs bounds a wait for one
_SOCKET_RATE = 1e9  # bytes/s, about: what the socket would cost bounds a wait for room
_ROOM_WAIT_S = (0.1, 1.0)  # the shortest and longest wait for room

available = M.available
unmodified = M.unmodified
copy = M.copy


def prepare() -> None:
    """Open what the channel keeps open for the life of the process (the pagemap,
    the release thread's pipe) now, at ``init_rpc``, not during a transfer."""
    M.pagemap_fd()
    _releaser.start()


def _check_open(conn) -> None:
    """A lease is taken only while ``conn`` is open: ``connection_closed`` (which
    runs after ``conn.closed`` is set, under the same lock) ends them all."""
    if conn.closed:
        raise ConnectionClosedError(f"connection to rank {conn.peer_rank} is closed")


class _Segment:
    __slots__ = ("id", "fd", "size", "addr", "leases", "local", "tainted", "echoed", "peers")

    def __init__(self, seg_id: int, fd: int, size: int) -> None:
        self.id = seg_id
        self.fd = fd
        self.size = size
        self.addr = 0  # our shared read-write mapping, 0 while unmapped
        self.leases: dict = {}  # connection -> mappings the peer holds
        self.local = 0  # private mappings of it in this process
        self.tainted = False  # leased to a peer now gone: never written again
        self.echoed = False  # the peer sent it back to us: its release is likely on its way
        self.peers: set = set()  # open connections it went to: they may keep it mapped

    @property
    def busy(self) -> bool:
        return bool(self.leases) or self.local > 0


class _Segments:
    """The segments this process owns.  Shares the mappings' lock: a tensor over
    one of our own segments may die (a weakref callback) inside a locked section of
    either."""

    def __init__(self) -> None:
        self.settled = threading.Condition(self.lock)  # a segment joined self.free
        self.vain: dict = {}  # connection -> waits for its releases that timed out
        self.vain_room: dict = {}  # connection -> waits for room under a limit, timed out
        self.segs: dict[int, _Segment] = {}
        self.free: list[_Segment] = []
        self.mapped = 0  # bytes of shared mappings this process holds
        self.warm_limit = 1 << 30
        self.next_id = 0
        self.counters = dict(created=0, reused=0, copies=0, copied_bytes=0, sent_back=0,
                             sent_own=0, released=0, waits=0, vain_waits=0,
                             room_waits=0, vain_room_waits=0)

    @property
    def lock(self):
        return _mappings.lock

    # ------------------------------------------------------------ sending

    def export(self, t: torch.Tensor, n: int, conn, bulk: bool = False):
        """How to send ``n`` bytes at ``t.data_ptr()`` to ``conn``'s peer (``bulk``:
        part of a large transfer, see :func:`memory.copy`).

        Returns:
            ``(seg_id, seg_size, offset, how, fd)``; ``fd`` (only for ``HOW_FD``)
            is a duplicate the caller owns and must close once sent.
        """
        addr = t.data_ptr()
        m = _mappings.find(addr)
        if m is not None and addr + n <= m.base + m.length and M.unmodified(addr, n):
            offset = addr - m.base + m.seg_off
            with self.lock:
                _check_open(conn)
                if not m.own and m.conn is conn:
                    self.counters["sent_back"] += 1
                    return m.seg_id, 0, offset, HOW_BACK, None
                seg = self.segs.get(m.seg_id) if m.own else None
                if seg is not None:
                    self._lease(seg, conn)
                    self.counters["sent_own"] += 1
                    return seg.id, seg.size, offset, HOW_FD, os.dup(seg.fd)
        seg = self._acquire(n)
        try:
            M.copy(seg.addr, addr, n, bulk)
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
            self._lease(seg, conn)
            self.counters["copies"] += 1
            self.counters["copied_bytes"] += n
            return seg.id, seg.size, 0, HOW_FD, os.dup(seg.fd)

    @staticmethod
    def _lease(seg: _Segment, conn) -> None:
        seg.leases[conn] = seg.leases.get(conn, 0) + 1
        seg.peers.add(conn)

    def _acquire(self, n: int) -> _Segment:
        size = M.round_up(n)
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
            chunked = False
            if not seg.addr:
                self._make_room(seg.size)
                # a large one is faulted in below, a chunk at a time, outside this lock
                chunked = seg.size > M.POPULATE_CHUNK
                seg.addr = M.map_fd(seg.fd, seg.size,
                                    M.MAP_SHARED | (0 if chunked else M.MAP_POPULATE))
                self.mapped += seg.size
        if chunked:  # ours alone until leased: no lock needed
            M.populate(seg.addr, seg.size)
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
                    M.unmap(s.addr, s.size)
                    s.addr = 0
                    self.mapped -= s.size
                    if self.mapped + size <= self.warm_limit:
                        break

    def _close(self, seg: _Segment) -> None:
        if seg.addr:
            M.unmap(seg.addr, seg.size)
            self.mapped -= seg.size
            seg.addr = 0
        os.close(seg.fd)
        self.segs.pop(seg.id, None)
        for conn in seg.peers:  # they may keep it mapped for the next message
            if not conn.closed:
                _releaser.post(conn, seg.id, forget=True)

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
            self.settled.notify_all()  # a sender waiting for room (await_room)

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
                seg.peers.discard(conn)
            self.vain.pop(conn, None)
            self.vain_room.pop(conn, None)
            self.settled.notify_all()  # a sender waiting for one of its segments gives up
        _mappings.connection_closed(conn)

    def leased_bytes(self, conn) -> int:
        """Bytes of the segments ``conn``'s peer holds leases on."""
        with self.lock:
            return self._leased_bytes(conn)

    def _leased_bytes(self, conn) -> int:
        return sum(s.size for s in self.segs.values() if conn in s.leases)

    def await_room(self, conn, n: int, limit: int, deadline: float | None = None) -> bool:
        """Wait (briefly) until ``n`` more bytes fit the leases of ``conn``'s peer
        under ``limit`` (or it holds none); whether they do.

        A peer that received a large buffer releases it after its reply, so a
        sender that sends again at once finds it still leased.  Waiting for the
        release costs far less than sending through the socket, and bounds the
        wait, within the sender's ``deadline`` (``time.monotonic()``).  A peer that
        keeps what it received (a parameter server) makes the waits vain: after
        ``_VAIN_MAX`` of them in a row for one connection, it is not waited for
        again while that connection lasts.
        """
        if in_io_thread():
            return False
        with self.lock:
            if self.vain_room.get(conn, 0) >= _VAIN_MAX:
                return False
            self.counters["room_waits"] += 1
            timeout = min(max(n / _SOCKET_RATE, _ROOM_WAIT_S[0]), _ROOM_WAIT_S[1])
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    return False

            def fits() -> bool:
                leased = self._leased_bytes(conn)
                return conn.closed or not leased or leased + n <= limit

            if self.settled.wait_for(fits, timeout=timeout) and not conn.closed:
                self.vain_room.pop(conn, None)
                return True
            self.vain_room[conn] = self.vain_room.get(conn, 0) + 1
            self.counters["vain_room_waits"] += 1
            return False

    def leased_to(self, conn) -> int:
        """Leases ``conn``'s peer holds (mappings it has not released)."""
        with self.lock:
            return sum(s.leases.get(conn, 0) for s in self.segs.values())


    # ------------------------------------------------------------ returned to us

    def import_back(self, conn, seg_id: int, offset: int, n: int) -> torch.Tensor:
        """Map our own segment ``seg_id``, returned unmodified by ``conn``'s peer."""
        with self.lock:
            seg = self.segs.get(seg_id)
            if seg is None or conn not in seg.leases or offset + n > seg.size:
                raise ProtocolError(f"peer returned shared-memory segment {seg_id}, which "
                                    f"it does not hold")
            t = _mappings.import_own(seg.fd, seg_id, offset, n)
            seg.local += 1
            seg.echoed = True
            return t

    def own_unmapped(self, seg_id: int, forked: bool) -> None:
        """A private mapping of our own segment died (``forked``: a child may still map
        it: never write it again)."""
        with self.lock:
            seg = self.segs.get(seg_id)
            if seg is not None:
                seg.local -= 1
                seg.tainted = seg.tainted or forked
                self._settle(seg)

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters, **_mappings.stats(), segments=len(self.segs),
                        free=len(self.free),
                        leased=sum(1 for s in self.segs.values() if s.leases),
                        mapped_bytes=self.mapped)

    def clear(self) -> None:
        """Close every released segment and unmap every idle cached mapping (at
        shutdown, and for tests)."""
        with self.lock:
            while self.free:
                self._close(self.free.pop())
        _mappings.clear()

    def after_fork_in_child(self) -> None:
        self.settled = threading.Condition(self.lock)  # on the child's new lock


_segments = _Segments()
_mappings.on_own_unmapped = _segments.own_unmapped
if hasattr(os, "register_at_fork"):  # after the mappings' handlers, which renew the lock
    os.register_at_fork(after_in_child=_segments.after_fork_in_child)
export = _segments.export
release = _segments.release
connection_closed = _segments.connection_closed
import_fd = _mappings.import_fd
import_back = _segments.import_back
forget = _mappings.forget
stats = _segments.stats
leased_to = _segments.leased_to
leased_bytes = _segments.leased_bytes
await_room = _segments.await_room
clear = _segments.clear
