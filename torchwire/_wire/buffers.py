"""Receive buffers for large tensors, recycled when the tensor that used one dies.

Fresh memory is slow to receive into: every 4 KiB page faults the first time the
kernel copies into it, and on the VMs this was measured on that alone halves
the bandwidth of a large transfer.  Programs that move tensors over RPC move the
same sizes again and again (parameters, activations, gradients), so a buffer
whose tensor has been freed is kept and reused for the next tensor of a
similar size — as torch's CUDA caching allocator does for device memory.

How a buffer comes back: the tensor is built with ``torch.frombuffer`` on a
:class:`_Block` (a ``bytearray`` subclass).  When the last tensor or view over
it is freed, torch releases the buffer, the block's refcount drops to zero and
``_Block.__del__`` puts it back in the pool (Python allows an object to be
resurrected from ``__del__``).  The pool is bounded (``MAX_CACHED_BYTES``); a
block that does not fit is really freed.
"""

from __future__ import annotations

import threading

import torch

MIN_POOLED = 128 << 10  # smaller ones come from torch's allocator (glibc's heap, warm)
MAX_CACHED_BYTES = 1 << 30


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.RLock()  # __del__ may run on a thread already inside take()
        self.blocks: list[_Block] = []
        self.cached = 0
        self.limit = MAX_CACHED_BYTES
        self.hits = 0
        self.misses = 0

    def take(self, n: int) -> _Block | None:
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

    def give(self, block: _Block) -> bool:
        with self.lock:
            if self.cached + len(block) > self.limit:
                return False
            self.blocks.append(block)
            self.cached += len(block)
            return True

    def clear(self) -> None:
        with self.lock:
            blocks, self.blocks, self.cached = self.blocks, [], 0
        for b in blocks:
            b.retire()


class _Block(bytearray):
    """A bytearray that returns itself to the pool when its last user lets go."""

    __slots__ = ("_retired",)

    def retire(self) -> None:
        self._retired = True

    def __del__(self) -> None:
        if getattr(self, "_retired", False):
            return
        try:
            _pool.give(self)
        except Exception:  # at interpreter exit the pool may be gone
            pass


_pool = _Pool()


def receive_buffer(n: int) -> torch.Tensor:
    """A ``uint8`` tensor of ``n`` bytes to receive into (contents undefined)."""
    if n < MIN_POOLED:
        return torch.empty(n, dtype=torch.uint8)
    block = _pool.take(n)
    if block is None:
        block = _Block(n)  # zero-filled by bytearray: pages faulted in one pass
    return torch.frombuffer(block, dtype=torch.uint8, count=n)


def pool_stats() -> dict:
    """Hits, misses and bytes held by the receive-buffer pool."""
    return {"hits": _pool.hits, "misses": _pool.misses, "cached_bytes": _pool.cached}


def cached_bytes() -> int:
    """Bytes currently held in the pool (for tests and stats)."""
    return _pool.cached


def set_cache_limit(limit: int) -> None:
    """Cap the bytes kept for reuse; 0 disables recycling."""
    _pool.limit = limit
    if limit == 0:
        _pool.clear()
