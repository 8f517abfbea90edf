"""Probe: where a staged CUDA round trip through host memory loses time at 1-4 MiB.

On an H200 (2026-11-28) staging through pinned memory made 64 and 256 MiB round trips
several times faster but added a fixed ~11 ms at 1 and 4 MiB, on every channel set,
while staging 1 MiB in one process took 0.05 ms out and 0.23 ms in; so
``cuda_host.MIN_BYTES`` is 8 MiB.  One suspect: the receiver's pageable-to-pinned
``copy_`` is a CPU op, parallel from 1 MiB (torch's grain: 32 768 elements), run on a
torchwire thread whose own OpenMP team is then woken per message.

Each variant runs a two-process job with ``TORCHWIRE_CUDA_IPC=0``, staging from
64 KiB, and times ``t * 2`` round trips at each size (median of 10 after a warm-up):

- ``direct``: no staging (``.to("cpu")``, ``.to(device)``: the path under 8 MiB);
- ``staged``: ``cuda_host`` as it is;
- ``staged-serial``: the receiver's CPU copy on one thread (``intraop.serial_for``);
- ``staged-memmove``: the receiver's CPU copy by ``ctypes.memmove`` (no torch op).

Run on a GPU machine: ``python bench/cuda_host_probe.py [--sizes-kib 128 1024 4096]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os

import torch

from cuda_roundtrip import run_pair, time_double

VARIANTS = ("direct", "staged", "staged-serial", "staged-memmove")


def _install(variant: str) -> None:
    from torchwire._base import intraop
    from torchwire._serialization import cuda_host

    cuda_host.MIN_BYTES = 1 << 62 if variant == "direct" else 1 << 16
    if variant in ("direct", "staged"):
        return

    def to_device(t, device):
        if t.numel() * t.element_size() < cuda_host.MIN_BYTES:
            return t.to(device)
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if variant == "staged-serial":
            saved = intraop.serial_for(1)
            try:
                pinned.copy_(t)
            finally:
                if saved is not None:
                    intraop.restore(saved)
        else:
            ctypes.memmove(pinned.data_ptr(), t.contiguous().data_ptr(),
                           t.numel() * t.element_size())
        out = pinned.to(device, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        return out

    cuda_host.to_device = to_device


def _worker(rank, variant, sizes, reps, port, queue):
    try:
        os.environ["TORCHWIRE_CUDA_IPC"] = "0"
        _install(variant)
        import torchwire.rpc as rpc
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=60)
        opts.set_device_map(f"w{1 - rank}", {0: 0})
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        if rank == 0:
            queue.put({kib: time_double(rpc, kib << 10, reps) for kib in sizes})
        rpc.shutdown()
    except Exception as exc:
        queue.put({"error": f"{variant} rank {rank}: {exc!r}"})
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for variant in VARIANTS:
        try:
            result = run_pair(_worker, variant, args.sizes_kib, args.reps, timeout=120)
        except RuntimeError as exc:
            print(f"{variant:15} failed: {exc}")
            continue
        print(f"{variant:15} " + "  ".join(f"{k} KiB {v:6.2f} ms" for k, v in result.items()))


if __name__ == "__main__":
    main()
