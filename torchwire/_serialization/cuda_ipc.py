"""CUDA tensors between processes of one host: shared, not copied through host memory.

A CUDA tensor sent under a device map normally travels through host memory (the
sender copies it to the CPU, the receiver onto the mapped device): four copies over
the PCIe bus for a round trip.  Between two workers of one host that see the same
GPUs (their ``CUDA_VISIBLE_DEVICES`` agree), the sender instead shares the tensor's
memory with torch's CUDA IPC (``torch.multiprocessing.reductions``: a memory handle,
an event the receiver's stream waits on, and a reference counter that keeps the
block allocated until the receiver lets go), and the receiver copies it onto the
mapped device: one device-to-device copy, as TensorPipe's ``cuda_ipc`` channel does.

Tensors under :data:`MIN_BYTES` keep the host path, where the IPC set-up would cost
more than the copy.  ``TORCHWIRE_CUDA_IPC=0`` on a worker turns sharing off towards
it and from it (a container without a shared IPC namespace, say).

The reference counter is released by the receiver's unpickling: a message that is
shared and never unpickled (its receiver died first) keeps the sender's block until
the sender exits.

A worker's call to itself cannot open its own handle: its CUDA tensors stay on the
device (:func:`local`), and the loopback connection copies them there.
"""

from __future__ import annotations

import torch

from .._base.errors import SerializationError

MIN_BYTES = 1 << 18  # 256 KiB
shared_count = 0  # tensors this process shared (tests check the path was taken)
local_count = 0  # CUDA tensors this process sent to itself without leaving the device


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data for a message to this same process: dense, on its device (the
    loopback connection clones it)."""
    global local_count
    local_count += 1
    return t.detach().resolve_conj().resolve_neg().contiguous()


def worth_sharing(t: torch.Tensor) -> bool:
    return t.is_cuda and t.numel() * t.element_size() >= MIN_BYTES


def reduce(t: torch.Tensor, target: torch.device, requires_grad: bool):
    """The pickle reduction of ``t``'s memory shared with the receiver, or None (the
    allocator cannot share it: the caller sends it through host memory)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    data = t.detach().resolve_conj().resolve_neg()
    try:
        rebuild, args = reduce_tensor(data)
    except RuntimeError:  # memory of another allocator (a pool, expandable segments)
        return None
    if rebuild is not rebuild_cuda_tensor:  # a layout torch shares another way
        return None
    global shared_count
    shared_count += 1
    return rebuild_shared, (args, str(target), requires_grad)


def rebuild_shared(args: tuple, device: str, requires_grad: bool) -> torch.Tensor:
    """The receiver's side: open the sender's memory, copy it onto ``device``, let go.

    Raises:
        SerializationError: the shared memory could not be opened.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        shared = rebuild_cuda_tensor(*args)  # its stream waits for the sender's event
    except Exception as exc:
        raise SerializationError(
            f"could not open a CUDA tensor its sender shared (CUDA IPC): {exc}; set "
            "TORCHWIRE_CUDA_IPC=0 on every worker to send CUDA tensors through host "
            "memory") from exc
    out = shared.to(device, copy=True)
    # Dropping the shared view synchronizes this stream, then releases the sender's
    # block: the copy above is done before the sender may reuse it.
    del shared
    if requires_grad:
        out.requires_grad_(True)
    return out
