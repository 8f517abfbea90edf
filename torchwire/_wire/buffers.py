"""Receive buffers for large tensors, recycled when the tensor that used one dies.

Fresh memory is slow to receive into: every 4 KiB page faults the first time the
kernel copies into it, and a fault taken inside ``recv`` or ``process_vm_readv``
can cost more than the copy itself.  Programs that move tensors over RPC move the
same sizes again and again (parameters, activations, gradients), so a buffer
whose tensor has been freed is kept and reused for the next tensor of a
similar size — as torch's CUDA caching allocator does for device memory.

How a buffer comes back: the pool keeps blocks (anonymous mappings; ``bytearray``s
where there are none); each use lends a fresh ``memoryview`` of one to
``torch.frombuffer``.  When the last tensor or view over it is freed, torch
releases the memoryview, and a weak-reference callback on it puts the block back
in the pool.  (A fresh view per use
matters: Python runs an object's finalizer at most once, so an object that
resurrected itself from ``__del__`` would be lost on its second death.)  The
pool is bounded (``MAX_CACHED_BYTES``): a returning buffer evicts the oldest
ones until it fits (one larger than the bound is freed).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import torch

MIN_POOLED = 128 << 10  # smaller ones come from torch's allocator (glibc's heap, warm)
MAX_CACHED_BYTES = 1 << 30
FAULT_CHUNK = 16 << 20  # fresh memory is faulted in and received this much at a time


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # a callback may run on a thread inside take()
        self.blocks: list = []  # mmap.mmap (or bytearray) objects
        self.cached = 0
        self.limit = MAX_CACHED_BYTES
        self.hits = 0
        self.misses = 0
        self.leases: dict[int, tuple] = {}

    def take(self, n: int):
        with self.lock:
            best = None
            for i, b in enumerate(self.blocks):
                size = len(b)
                if n <= size < 2 * n and (best is None or size < len(self.blocks[best])):
                    best = i
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            block = self.blocks.pop(best)
            self.cached -= len(block)
            return block

    def lend(self, block, n: int) -> memoryview:
        """A view of ``block`` whose death returns ``block`` to the pool."""
        view = memoryview(block)[:n]
        key = id(view)

        def returned(_ref, key=key) -> None:
            with self.lock:
                entry = self.leases.pop(key, None)
                if entry is None:
                    return
                blk = entry[1]
                if len(blk) > self.limit:
                    return
                # The most recent buffer is the likeliest to be needed again (the
                # same transfer repeating): make room for it by dropping the oldest.
                while self.blocks and self.cached + len(blk) > self.limit:
                    self.cached -= len(self.blocks.pop(0))
                self.blocks.append(blk)
                self.cached += len(blk)

        with self.lock:
            self.leases[key] = (weakref.ref(view, returned), block)
        return view


_pool = _Pool()


def receive_buffer(n: int) -> tuple[torch.Tensor, bool]:
    """A ``uint8`` tensor of ``n`` bytes to receive into (contents undefined), and
    whether its memory is fresh: not faulted in yet (see :func:`prefault`)."""
    if n < MIN_POOLED:
        return torch.empty(n, dtype=torch.uint8), False
    block = _pool.take(n)
    fresh = block is None
    if fresh:
        # An anonymous private mapping, faulted in by the receiver chunk by chunk.
        # (``bytearray(n)`` zero-fills it holding the GIL: on a machine whose page
        # faults were slow, a fresh 1 GiB buffer held every other thread of the
        # process, and the reading of the connection, for longer than the heartbeat
        # timeout; both peers declared the other frozen.)
        block = (mmap.mmap(-1, n, flags=_MAP_FLAGS) if _MAP_FLAGS is not None
                 else bytearray(n))
        fresh = _MAP_FLAGS is not None
    return torch.frombuffer(_pool.lend(block, n), dtype=torch.uint8), fresh


def receive_bytes(n: int) -> tuple[memoryview, bool]:
    """A writable buffer of ``n`` bytes for a large payload (a pickle), and whether it
    is fresh (see :func:`read_faulting`).  Not pooled: a payload's slices may outlive
    the view this returns, and the mapping lives as long as any of them."""
    if _MAP_FLAGS is None:
        return memoryview(bytearray(n)), False
    # (``bytearray(n)`` would zero-fill it holding the GIL: see receive_buffer)
    return memoryview(mmap.mmap(-1, n, flags=_MAP_FLAGS)), True


def prefault(view: memoryview) -> None:
    """Fault in the pages of ``view`` in one pass, by a torch op that releases the
    GIL (a fault taken inside ``recv`` or ``process_vm_readv`` costs more)."""
    if view.nbytes:
        torch.frombuffer(view, dtype=torch.uint8).fill_(0)


def read_faulting(read_exact_into, view: memoryview, fresh: bool) -> None:
    """``read_exact_into(view)``; into fresh memory, a chunk at a time, each faulted in
    first: the connection keeps being read (and the peer's writes drain) while a large
    buffer is faulted in, so neither side looks frozen to the heartbeat."""
    if not fresh:
        read_exact_into(view)
        return
    n = view.nbytes
    for off in range(0, n, FAULT_CHUNK):
        part = view[off:off + FAULT_CHUNK]
        prefault(part)
        read_exact_into(part)


_MAP_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
              if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MAP_PRIVATE") else None)


def pool_stats() -> dict:
    """Hits, misses, bytes held and buffers lent out by the receive-buffer pool."""
    return {"hits": _pool.hits, "misses": _pool.misses, "cached_bytes": _pool.cached,
            "lent": len(_pool.leases)}


def byte_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte memoryview over the first ``nbytes`` of ``t``'s data.

    The view does not keep ``t`` alive: the caller must hold ``t`` while the
    view is in use.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")
