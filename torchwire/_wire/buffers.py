"""Receive buffers for large tensors, recycled when the tensor that used one dies.

Fresh memory is slow to receive into: every 4 KiB page faults the first time the
kernel copies into it, and a fault taken inside ``recv`` or ``process_vm_readv``
can cost more than the copy itself.  Programs that move tensors over RPC move the
same sizes again and again (parameters, activations, gradients), so a buffer
whose tensor has been freed is kept and reused for the next tensor of a
similar size — as torch's CUDA caching allocator does for device memory.

How a buffer comes back: the pool keeps plain ``bytearray``s; each use lends a
fresh ``memoryview`` of one to ``torch.frombuffer``.  When the last tensor or
view over it is freed, torch releases the memoryview, and a weak-reference
callback on it puts the bytearray back in the pool.  (A fresh view per use
matters: Python runs an object's finalizer at most once, so an object that
resurrected itself from ``__del__`` would be lost on its second death.)  The
pool is bounded (``MAX_CACHED_BYTES``): a returning buffer evicts the oldest
ones until it fits (one larger than the bound is freed).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

MIN_POOLED = 128 << 10  # smaller ones come from torch's allocator (glibc's heap, warm)
MAX_CACHED_BYTES = 1 << 30


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # a callback may run on a thread inside take()
        self.blocks: list[bytearray] = []
        self.cached = 0
        self.limit = MAX_CACHED_BYTES
        self.hits = 0
        self.misses = 0
        self.leases: dict[int, tuple] = {}

    def take(self, n: int) -> bytearray | None:
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

    def lend(self, block: bytearray, n: int) -> memoryview:
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


def receive_buffer(n: int) -> torch.Tensor:
    """A ``uint8`` tensor of ``n`` bytes to receive into (contents undefined)."""
    if n < MIN_POOLED:
        return torch.empty(n, dtype=torch.uint8)
    block = _pool.take(n)
    if block is None:
        block = bytearray(n)  # zero-filled: pages faulted in one pass, not inside recv
    return torch.frombuffer(_pool.lend(block, n), dtype=torch.uint8)


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
