"""CUDA tensors through host memory: staged in pinned (page-locked) memory.

Between hosts, between workers that do not share GPUs, and when CUDA IPC is turned
off, a CUDA tensor under a device map crosses host memory: the sender copies it off
its GPU, the wire moves the bytes, the receiver copies them onto the mapped device.
Copies between a GPU and pageable memory are slow (the driver stages them itself,
piece by piece), and a fresh pageable buffer per message is faulted in page by page.
Instead both sides stage through torch's pinned-memory cache (``pin_memory=True``,
blocks reused across messages, as TensorPipe's ``cuda_basic`` channel does):

- the sender copies the tensor into a pinned block, which is what the wire sends;
- the receiver copies the received bytes into a pinned block and from there onto
  the device.

Both wait for their copy's stream before going on, as a copy through pageable memory
does: the tensor a callee receives is complete whatever stream it reads on.

The receiver's copy into the pinned block runs on a torchwire thread. As torch's
parallel ``copy_`` it wakes that thread's own OpenMP team per message, a fixed cost
of about 10 ms on an H200's 16-core host that outweighs the copy until tens of MiB:
under :data:`PARALLEL_COPY_MIN` the copy is one ``memmove`` (no GIL held), from it
torch's ``copy_``, whose threads then pay for themselves (BENCHMARKS.md, 2026-11-30).
Tensors under :data:`MIN_BYTES` are copied directly (no faster staged).
"""

from __future__ import annotations

import ctypes

import torch

MIN_BYTES = 1 << 20  # 1 MiB
PARALLEL_COPY_MIN = 32 << 20  # 32 MiB
staged_count = 0  # tensors this process staged (tests check the path was taken)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` (on a GPU) as a dense CPU tensor, in a pinned block when it is large."""
    data = t.detach().resolve_conj().resolve_neg()
    if data.numel() * data.element_size() < MIN_BYTES:
        return data.to("cpu").contiguous()
    global staged_count
    staged_count += 1
    data = data.contiguous()  # on the device, where it is cheap
    pinned = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    pinned.copy_(data, non_blocking=True)
    torch.cuda.current_stream(data.device).synchronize()
    return pinned


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """The received CPU tensor ``t`` copied onto the CUDA ``device``."""
    if t.numel() * t.element_size() < MIN_BYTES or t.is_pinned():
        return t.to(device)
    global staged_count
    staged_count += 1
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    nbytes = t.numel() * t.element_size()
    if nbytes < PARALLEL_COPY_MIN and t.is_contiguous():
        ctypes.memmove(pinned.data_ptr(), t.data_ptr(), nbytes)
    else:
        pinned.copy_(t)
    out = pinned.to(device, non_blocking=True)
    torch.cuda.current_stream(out.device).synchronize()
    return out
