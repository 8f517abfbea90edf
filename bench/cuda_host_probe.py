"""Probe: the staged CUDA path through host memory, against its alternatives.

On an H200 (2026-11-28) staging through pinned memory made 64 and 256 MiB round trips
several times faster but added a fixed ~11 ms at 1 and 4 MiB, on every channel set.
The cause (found on 2026-11-30): the receiver's pageable-to-pinned ``copy_``, a
parallel CPU op, run on a torchwire thread and waking its own OpenMP team per
message. By ``memmove`` 1 MiB took 1.6 ms instead of 14, but 256 MiB 101 ms instead
of 52: ``cuda_host`` copies by ``memmove`` under ``PARALLEL_COPY_MIN``, by ``copy_``
from it.

Each variant runs a two-process job with ``TORCHWIRE_CUDA_IPC=0`` and times ``t * 2``
round trips at each size (median of ``--reps`` after a warm-up):

- ``direct``: no staging (``.to("cpu")``, ``.to(device)``: the path under
  ``cuda_host.MIN_BYTES``);
- ``staged``: ``cuda_host`` as it is, from 64 KiB;
- ``staged-memmove``: the receiver's CPU copy by ``memmove`` at every size;
- ``staged-parallel``: the receiver's CPU copy by torch's ``copy_`` at every size.

Run on a GPU machine: ``python bench/cuda_host_probe.py [--sizes-kib 128 1024 4096]``.
"""

from __future__ import annotations

import argparse
import os

from cuda_roundtrip import run_pair, time_double

VARIANTS = ("direct", "staged", "staged-memmove", "staged-parallel")


def _install(variant: str) -> None:
    from torchwire._serialization import cuda_host

    cuda_host.MIN_BYTES = 1 << 62 if variant == "direct" else 1 << 16
    if variant == "staged-memmove":
        cuda_host.PARALLEL_COPY_MIN = 1 << 62
    elif variant == "staged-parallel":
        cuda_host.PARALLEL_COPY_MIN = 0


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
