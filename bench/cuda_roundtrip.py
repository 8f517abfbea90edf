"""CUDA round trip under a device map, torchwire against torch.distributed.rpc.

Two processes on one GPU machine, ``cuda:0 -> cuda:0`` mapped both ways.  The caller
sends a CUDA tensor; the callee returns a new one (``t * 2``, on its GPU); the caller
synchronizes on the reply.  Rounds alternate the libraries; medians in ms.  Run on a
machine with a GPU:  ``python bench/cuda_roundtrip.py [--sizes-mib 1 64 256] [--rounds 5]``.

Not part of ``./run bench`` (CI has no GPU): its figures go in BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def double(t):
    return t * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, lib, sizes, reps, port, queue):
    try:
        _measure(rank, lib, port, sizes, reps, queue)
    except Exception as exc:  # the parent reports it rather than waiting
        queue.put({"error": f"{lib} rank {rank}: {exc!r}"})
        raise


def _measure(rank, lib, port, sizes, reps, queue):
    extra = {}
    if lib == "torchwire-host":  # torchwire with CUDA IPC off: through host memory
        os.environ["TORCHWIRE_CUDA_IPC"] = "0"
        lib = "torchwire"
    elif lib == "torch-host":  # TensorPipe's channel between hosts: through host memory
        extra = {"_channels": ["basic", "cuda_basic"]}
        lib = "torch"
    rpc = importlib.import_module(f"{lib}.distributed.rpc" if lib == "torch" else f"{lib}.rpc")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=120, **extra)
    opts.set_device_map(f"w{1 - rank}", {0: 0})
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        queue.put({mib: time_double(rpc, mib * 2**20, reps) for mib in sizes})
    rpc.shutdown()


def time_double(rpc, nbytes: int, reps: int) -> float:
    """Median ms of ``reps`` synchronized ``double`` round trips to ``w1`` with a CUDA
    float32 tensor of ``nbytes``, after one warm-up (allocator, channels)."""
    t = torch.ones(nbytes // 4, device="cuda:0")
    rpc.rpc_sync("w1", double, args=(t,))
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        y = rpc.rpc_sync("w1", double, args=(t,))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert y.device == t.device and float(y[-1]) == 2.0
    return statistics.median(times) * 1e3


def run_pair(worker, *args, timeout: float = 300) -> dict:
    """``worker(rank, *args, port, queue)`` in two spawned processes; what rank 0 puts
    on the queue (RuntimeError if a worker reported ``{"error": ...}``)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, *args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def one_round(lib: str, sizes, reps) -> dict:
    return run_pair(_worker, lib, sizes, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--libs", default="torch,torchwire,torch-host,torchwire-host",
                    help="torchwire-host: torchwire with TORCHWIRE_CUDA_IPC=0; torch-host: "
                         "torch with only TensorPipe's cuda_basic channel (through host "
                         "memory, as between hosts)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'default')}")
    libs = args.libs.split(",")
    per = {lib: {m: [] for m in args.sizes_mib} for lib in libs}
    for r in range(args.rounds):
        for lib in (libs if r % 2 == 0 else libs[::-1]):
            for mib, ms in one_round(lib, args.sizes_mib, args.reps).items():
                per[lib][mib].append(ms)
    for mib in args.sizes_mib:
        for lib in libs:
            ref = "torch-host" if lib.endswith("-host") else "torch"
            torch_ms = statistics.median(per[ref][mib]) if ref in per else None
            ms = statistics.median(per[lib][mib])
            ratio = f"  ratio {ms / torch_ms:5.2f}x" if torch_ms and lib != ref else ""
            print(f"cuda t*2 round trip {mib:>4} MiB  {lib:15} {ms:8.2f} ms{ratio}  "
                  f"rounds {[round(x, 2) for x in per[lib][mib]]}")


if __name__ == "__main__":
    main()
