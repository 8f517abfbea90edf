"""Memory primitives of the shared-memory channel: mapping, copying, and reading
which pages of a private file mapping were written.

``segments.py`` (the segments this process owns) and ``mappings.py`` (the
private mappings it holds of segments, its own or a peer's) both use them.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PROT_RW = 0x1 | 0x2
MAP_SHARED, MAP_PRIVATE, MAP_POPULATE = 0x01, 0x02, 0x8000
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14
# Pages faulted in per call when a new segment is populated: the kernel holds the
# process's memory-map lock (read) through each call, and any thread that maps
# memory meanwhile (a thread starting, malloc growing) waits for it, and every
# thread that faults waits behind that one.
POPULATE_CHUNK = 32 << 20
COPY_PART = 8 << 20  # the smallest part of a copy split across threads
COPY_PART_BULK = 1 << 20  # the same for the copies of a bulk transfer (copy(bulk=True))

_libc = None
if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.restype = ctypes.c_int
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.madvise.restype = ctypes.c_int
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _libc = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def available() -> bool:
    """memfd, fd passing and pagemap: all the shm channel needs (Linux)."""
    return _libc is not None and os.path.exists("/proc/self/pagemap")


def round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def map_fd(fd: int, length: int, flags: int, offset: int = 0) -> int:
    """``mmap`` read-write; returns the address.

    Raises:
        OSError: the kernel refused (no memory, no address space, a bad descriptor).
    """
    addr = _libc.mmap(None, length, PROT_RW, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return addr


def populate(addr: int, length: int) -> None:
    """Fault in ``[addr, addr + length)`` of a shared mapping for writing,
    :data:`POPULATE_CHUNK` at a time (the GIL released).  One ``MAP_POPULATE`` of
    3 GiB held the lock for 5 s: no thread of the process could start meanwhile,
    and a peer declared it lost.  Without ``MADV_POPULATE_WRITE`` (before Linux
    5.14) the pages fault in as they are written."""
    for off in range(0, length, POPULATE_CHUNK):
        if _libc.madvise(addr + off, min(POPULATE_CHUNK, length - off),
                         MADV_POPULATE_WRITE) != 0:
            return


def unmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


def discard(addr: int, length: int) -> None:
    """Drop the pages of a private file mapping in ``[addr, addr + length)``: written
    (copy-on-write) pages are freed, and the range reads the file again."""
    _libc.madvise(addr, length, MADV_DONTNEED)


# ----------------------------------------------------------------- copying

_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def copy(dst: int, src: int, n: int, bulk: bool = False) -> None:
    """memcpy ``n`` bytes, large ones on every core (memory bandwidth scales with
    threads on the machines measured; ctypes releases the GIL).  ``bulk``: the copy
    is one of a transfer large enough that splitting smaller copies pays too."""
    global _copier
    parts = min(os.cpu_count() or 1, max(1, n // (COPY_PART_BULK if bulk else COPY_PART)))
    if parts <= 1:
        ctypes.memmove(dst, src, n)
        return
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                         thread_name_prefix="torchwire-copy")
    step = round_up(-(-n // parts))
    futs = [_copier.submit(ctypes.memmove, dst + off, src + off, min(step, n - off))
            for off in range(step, n, step)]
    ctypes.memmove(dst, src, min(step, n))
    for f in futs:
        f.result()


# ----------------------------------------------------------------- pagemap

_pagemap = (-1, -1)  # (pid, fd): /proc/self/pagemap names the opener's process


def pagemap_fd() -> int:
    global _pagemap
    pid, fd = _pagemap
    if pid != os.getpid():  # first use, or a forked child holding the parent's
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        _pagemap = (os.getpid(), fd)
    return fd


def _written(addr: int, n: int) -> torch.Tensor | None:
    """Per page under ``[addr, addr + n)`` of a private file mapping: was it written?
    (a written page is an anonymous copy, present or swapped; an unwritten one is
    absent or the file's own page).  None if the pagemap could not be read."""
    fd = pagemap_fd()
    first, last = addr // PAGE, (addr + n - 1) // PAGE
    count = last - first + 1
    data = bytearray(os.pread(fd, 8 * count, 8 * first))
    if len(data) != 8 * count:
        return None
    # bits 63 present, 62 swapped, 61 file page: after the shift, 4, 2 and 1
    bits = (torch.frombuffer(data, dtype=torch.int64) >> 61) & 7
    return ((bits & 5) == 4) | ((bits & 2) != 0)


def unmodified(addr: int, n: int) -> bool:
    """Were the pages under ``[addr, addr + n)`` of a private file mapping never
    written (each either absent or still the file's page)?"""
    written = _written(addr, n)
    return written is not None and not bool(written.any())


def discard_written(addr: int, n: int) -> int:
    """Drop the written pages under ``[addr, addr + n)`` of a private file mapping, so
    that the range reads the file's pages again; the others stay mapped.  Returns
    how many pages were dropped (all of them if the pagemap could not be read)."""
    first = addr // PAGE * PAGE
    written = _written(addr, n)
    if written is None:
        length = round_up(addr + n) - first
        discard(first, length)
        return length // PAGE
    pages = written.nonzero().flatten().tolist()
    if not pages:
        return 0
    start = prev = pages[0]
    for p in pages[1:] + [None]:  # one madvise per run of written pages
        if p is not None and p == prev + 1:
            prev = p
            continue
        discard(first + start * PAGE, (prev - start + 1) * PAGE)
        if p is not None:
            start = prev = p
    return len(pages)
