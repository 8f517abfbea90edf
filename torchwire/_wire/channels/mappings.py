"""The receiving side of the shared-memory channel: private mappings of segments,
lent to the tensors built on them, and kept mapped for the next message.

A received buffer is a ``MAP_PRIVATE`` mapping of the sender's segment (or of one
of ours, sent back by reference): the tensor reads the sender's pages without a
copy, and its writes go to private copy-on-write pages.  Mapping a segment anew
for every message costs a page fault per 64 KiB read (the kernel maps a page and
its neighbours) and an ``munmap`` with its TLB flush; on a VM each fault costs
more than copying the page.  So a peer's segment stays mapped after its tensor
dies (the *cache*, one entry per connection and segment), and the next buffer
that arrives in it is lent at once: its page table is already filled, and the
sender's new bytes are in the very pages it maps.

Before a cached mapping is lent again, the pages the last tensor wrote (private
copies) are dropped so that it reads the segment's pages again
(``memory.discard_written``, from ``/proc/self/pagemap``); the release thread does
that before it sends the RELEASE, and the sender writes the segment again only
after that RELEASE, so a tensor never sees the next message's bytes.

A cached mapping's states (``_Mapping.state``)::

    LENT     --its tensor dies-->                        SCRUB (release thread posted)
    SCRUB    --written pages dropped, RELEASE sent-->    IDLE
    IDLE     --a buffer in the same segment arrives-->   LENT
    IDLE     --FORGET (the sender closed the segment),
               its connection closes, or evicted-->      unmapped
    LENT, SCRUB  --FORGET or close-->                    gone: unmapped when the
                                                         tensor dies / scrub ends

A mapping that cannot be cached (the entry is lent already, the cache is full, a
segment of our own) is unmapped when its tensor dies.  A mapping alive at a fork
is *retired* when it dies (RELEASE with RETIRE; not cached again): the child still
maps it.  A forked child never releases what it inherited.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import os
import stat
import threading
import weakref

import torch

from ..._base.errors import ProtocolError
from . import memory as M

LENT, SCRUB, IDLE = 1, 2, 3
CACHE_LIMIT = 1 << 30  # bytes of peers' segments kept mapped (lent or idle)
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)


class _Mapping:
    """A private mapping this process holds of a segment (received or its own)."""

    __slots__ = ("base", "length", "seg_id", "seg_off", "conn", "own", "pid", "forked",
                 "key", "ino", "state", "gone")

    def __init__(self, base, length, seg_id, seg_off, conn, own, key=None, ino=None) -> None:
        self.base, self.length = base, length
        self.seg_id, self.seg_off = seg_id, seg_off
        self.conn, self.own = conn, own
        self.pid = os.getpid()  # a forked child's copy holds no lease
        self.forked = False  # alive at a fork: a child may still map it
        self.key = key  # (connection, segment id) when cached, else None
        self.ino = ino  # the segment's (device, inode): a cached entry names one file
        self.state = LENT
        self.gone = False  # cached, but never to be lent again: unmap when done


class _Releaser:
    """Sends RELEASE frames, after dropping a cached mapping's written pages.

    A mapping dies wherever its last tensor is freed: on any thread, possibly
    inside a lock that sending needs (a connection dropping sent tensors under
    its queue lock, or the cyclic garbage collector anywhere).  So the callback
    only appends to a deque and writes a byte to a pipe; this thread does the rest.
    """

    def __init__(self) -> None:
        self.pid = -1
        self.items: collections.deque = collections.deque()
        self.wfd = -1
        self.scrub = None  # the mappings' scrub step, set below

    def post(self, conn, seg_id: int, retire: bool = False, forget: bool = False,
             scrub=None) -> None:
        self.items.append((conn, seg_id, retire, forget, scrub))
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
                conn, seg_id, retire, forget, scrub = self.items.popleft()
                if scrub is not None:
                    self.scrub(*scrub)
                try:
                    conn.send_release(seg_id, shm=True, retire=retire, forget=forget)
                except Exception:  # a closed connection: its peer's leases ended with it
                    pass
            # this thread outlives connections: its locals must not keep the last alive
            conn = None


_start_lock = threading.Lock()
releaser = _Releaser()


class Mappings:
    """Every private mapping of a segment in this process, and the cache."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # weakref callbacks may run inside a locked section
        self.bases: list[int] = []  # sorted bases of self.maps
        self.maps: dict[int, _Mapping] = {}  # lent mappings, by base
        self.views: dict[int, tuple] = {}  # id(view) -> (weakref, mapping)
        self.cache: dict[tuple, _Mapping] = {}  # (connection, segment id) -> mapping
        self.idle: collections.OrderedDict = collections.OrderedDict()  # LRU of IDLE
        self.cached_bytes = 0
        self.on_own_unmapped = None  # segments.py: (seg_id, forked) -> None
        self.counters = dict(received=0, cache_hits=0, scrubbed_pages=0)

    # ------------------------------------------------------------ receiving

    def import_fd(self, conn, fd: int, seg_id: int, seg_size: int, offset: int,
                  n: int) -> torch.Tensor:
        """Map (or lend again) a segment a peer sent (``fd`` is ours: always closed)."""
        try:
            if n <= 0:  # no sender makes one
                raise OSError(0, "an empty buffer")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < seg_size or offset + n > seg_size:
                raise ProtocolError(f"shared-memory buffer of {n} bytes at {offset} does not "
                                    f"fit the segment sent ({st.st_size} bytes)")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise ProtocolError("shared-memory segment is not sealed against shrinking")
            ino = (st.st_dev, st.st_ino)
            key = (conn, seg_id)
            with self.lock:
                self.counters["received"] += 1
                m = self.cache.get(key)
                if m is not None and m.state == IDLE:
                    if m.ino == ino and m.length == seg_size:
                        del self.idle[key]
                        m.state = LENT
                        self.counters["cache_hits"] += 1
                        return self._lend(m, offset, n)
                    self._drop(m)  # another file under the same id: never expected
                    m = None
                cacheable = m is None and not conn.closed and self._make_room(seg_size)
            if cacheable:
                base = M.map_fd(fd, seg_size, M.MAP_PRIVATE)
                m = _Mapping(base, seg_size, seg_id, 0, conn, False, key, ino)
                with self.lock:
                    if key in self.cache or conn.closed:  # raced: keep this one uncached
                        m.key = None
                    else:
                        self.cache[key] = m
                        self.cached_bytes += seg_size
                return self._lend(m, offset, n)
            start = offset // M.PAGE * M.PAGE
            length = M.round_up(offset + n) - start
            base = M.map_fd(fd, length, M.MAP_PRIVATE, start)
        except OSError as exc:
            raise ProtocolError(f"cannot map a shared-memory buffer: {exc}") from exc
        finally:
            os.close(fd)
        return self._lend(_Mapping(base, length, seg_id, start, conn, False), offset - start, n)

    def import_own(self, fd: int, seg_id: int, offset: int, n: int) -> torch.Tensor:
        """Map our own segment ``seg_id`` (descriptor ``fd``, not closed here) privately:
        a buffer of it a peer returned by reference."""
        start = offset // M.PAGE * M.PAGE
        length = M.round_up(offset + n) - start
        try:
            base = M.map_fd(fd, length, M.MAP_PRIVATE, start)
        except OSError as exc:
            raise ProtocolError(f"cannot map shared-memory segment {seg_id}: {exc}") from exc
        return self._lend(_Mapping(base, length, seg_id, start, None, True), offset - start, n)

    def _make_room(self, size: int) -> bool:
        """Unmap idle cached mappings, least recently used first, until ``size`` more
        bytes fit in the cache.  Called with the lock held."""
        while self.cached_bytes + size > CACHE_LIMIT and self.idle:
            _, m = self.idle.popitem(last=False)
            self._drop(m)
        return self.cached_bytes + size <= CACHE_LIMIT

    def _drop(self, m: _Mapping) -> None:
        """Take a cached mapping out of the cache and unmap it (lock held, not lent)."""
        if self.cache.get(m.key) is m:
            del self.cache[m.key]
        self.idle.pop(m.key, None)
        self.cached_bytes -= m.length
        M.unmap(m.base, m.length)

    def _lend(self, m: _Mapping, skip: int, n: int) -> torch.Tensor:
        arr = (ctypes.c_ubyte * m.length).from_address(m.base)
        view = memoryview(arr).cast("B")[skip:skip + n]
        key = id(view)

        def unlent(_ref, key=key) -> None:
            self._unlent(key)

        with self.lock:
            self.views[key] = (weakref.ref(view, unlent), m, m.base + skip, n)
            self.maps[m.base] = m
            bisect.insort(self.bases, m.base)
        return torch.frombuffer(view, dtype=torch.uint8)

    def _unlent(self, key: int) -> None:
        """The last tensor over a lent view died (any thread)."""
        with self.lock:
            entry = self.views.pop(key, None)
            if entry is None:
                return
            _, m, addr, n = entry
            self.maps.pop(m.base, None)
            i = bisect.bisect_left(self.bases, m.base)
            if i < len(self.bases) and self.bases[i] == m.base:
                del self.bases[i]
            if m.pid != os.getpid():  # inherited through a fork: the lease is the parent's
                M.unmap(m.base, m.length)
                return
            conn = m.conn
            if m.key is not None and not (m.gone or m.forked or conn is None or conn.closed):
                m.state = SCRUB
                releaser.post(conn, m.seg_id, scrub=(m, addr, n))
                return
            if m.key is not None:
                self._drop(m)
            else:
                M.unmap(m.base, m.length)
        if m.own:
            self.on_own_unmapped(m.seg_id, m.forked)
        elif conn is not None:
            releaser.post(conn, m.seg_id, retire=m.forked)

    def _scrub(self, m: _Mapping, addr: int, n: int) -> None:
        """Release thread: drop what the last tensor (over ``[addr, addr + n)``) wrote,
        then make ``m`` lendable again."""
        dropped = M.discard_written(addr, n) if n else 0
        with self.lock:
            self.counters["scrubbed_pages"] += dropped
            if m.gone or m.conn is None or m.conn.closed:
                self._drop(m)
            else:
                m.state = IDLE
                self.idle[m.key] = m

    # ------------------------------------------------------------ the sender's news

    def forget(self, conn, seg_id: int) -> None:
        """``conn``'s peer closed its segment ``seg_id``: unmap what we cache of it."""
        with self.lock:
            m = self.cache.get((conn, seg_id))
            if m is None:
                return
            if m.state == IDLE:
                self._drop(m)
            else:
                m.gone = True

    def connection_closed(self, conn) -> None:
        """``conn`` closed: its cached mappings go (lent ones when their tensors die),
        and what we map of it is never sent back by reference."""
        with self.lock:
            for key, m in list(self.cache.items()):
                if key[0] is conn:
                    if m.state == IDLE:
                        self._drop(m)
                    else:
                        m.gone = True
            for m in self.maps.values():
                if m.conn is conn:
                    m.conn = None  # no back-references on another connection

    # ------------------------------------------------------------ lookups

    def find(self, addr: int) -> _Mapping | None:
        """The lent mapping ``addr`` lies in, if any."""
        with self.lock:
            i = bisect.bisect_right(self.bases, addr) - 1
            if i < 0:
                return None
            m = self.maps[self.bases[i]]
            return m if addr < m.base + m.length else None

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters, mappings=len(self.maps),
                        own_mappings=sum(1 for m in self.maps.values() if m.own),
                        cached=len(self.cache), cached_bytes=self.cached_bytes,
                        idle=len(self.idle))

    def clear(self) -> None:
        """Unmap every idle cached mapping (at shutdown, and for tests)."""
        with self.lock:
            while self.idle:
                self._drop(self.idle.popitem(last=False)[1])

    # ------------------------------------------------------------ fork

    def before_fork(self) -> None:
        """Mark every lent mapping as forked; the lock is held across the fork so that
        no mapping appears in between."""
        self.lock.acquire()
        for m in self.maps.values():
            m.forked = True

    def after_fork_in_parent(self) -> None:
        self.lock.release()

    def after_fork_in_child(self) -> None:
        self.lock = threading.RLock()  # the parent's may be held by a thread not copied
        for m in self.idle.values():
            M.unmap(m.base, m.length)
        self.cache, self.idle, self.cached_bytes = {}, collections.OrderedDict(), 0


mappings = Mappings()
releaser.scrub = mappings._scrub
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=mappings.before_fork,
                        after_in_parent=mappings.after_fork_in_parent,
                        after_in_child=mappings.after_fork_in_child)
