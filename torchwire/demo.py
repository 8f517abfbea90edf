"""``python -m torchwire.demo``: a local 4-worker job that shows what the runtime does.

worker0 drives; worker1..3 serve.  It prints, per peer, the no-op call latency,
async throughput and tensor echo bandwidth, then a chain of calls across workers,
a remote error as the caller sees it, and every worker's counters.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch

import torchwire.rpc as rpc

WORLD = 4


def noop():
    return None


def echo(x):
    return x


def whoami():
    info = rpc.get_worker_info()
    return f"{info.name} (pid {os.getpid()})"


def fail(msg):
    raise KeyError(msg)


@rpc.functions.async_execution
def relay(path, x):
    """Pass x along ``path``, adding 1 at each hop; the reply travels back the same way."""
    if not path:
        fut = torch.futures.Future()
        fut.set_result(x)
        return fut
    return rpc.rpc_async(path[0], relay, args=(path[1:], x + 1))


def my_stats():
    return rpc.stats()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def drive(quick: bool) -> None:
    peers = [f"worker{r}" for r in range(1, WORLD)]
    print(f"torchwire demo: {WORLD} local workers, worker0 drives\n")
    for p in peers:
        print(f"  {p:8s} -> {rpc.rpc_sync(p, whoami)}")
    print()
    n_sync = 200 if quick else 1000
    n_async = 2000 if quick else 10000
    sizes = [1 << 20, 16 << 20] if quick else [1 << 20, 16 << 20, 64 << 20]
    head = f"  {'peer':8s} {'no-op p50':>10s} {'p99':>9s} {'async calls/s':>14s}"
    head += "".join(f" {'echo ' + _fmt_bytes(s):>13s}" for s in sizes)
    print(head)
    for p in peers:
        for _ in range(50):
            rpc.rpc_sync(p, noop)
        lat = []
        for _ in range(n_sync):
            t0 = time.perf_counter()
            rpc.rpc_sync(p, noop)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        t0 = time.perf_counter()
        torch.futures.wait_all([rpc.rpc_async(p, noop) for _ in range(n_async)])
        rate = n_async / (time.perf_counter() - t0)
        row = (f"  {p:8s} {statistics.median(lat) * 1e6:8.0f}µs "
               f"{lat[int(len(lat) * 0.99)] * 1e6:7.0f}µs {rate:14,.0f}")
        for size in sizes:
            x = torch.randn(size // 4)
            best = []
            for _ in range(3):
                t0 = time.perf_counter()
                y = rpc.rpc_sync(p, echo, args=(x,))
                best.append(time.perf_counter() - t0)
            assert torch.equal(x, y)
            row += f" {2 * size / statistics.median(best) / 1e9:9.2f} GB/s"
        print(row)
    print()
    out = rpc.rpc_sync("worker1", relay, args=(["worker2", "worker3", "worker0"], torch.zeros(2)))
    print(f"  relay worker0 -> worker1 -> worker2 -> worker3 -> worker0: {out.tolist()} "
          "(async_execution: no thread held while waiting)")
    try:
        rpc.rpc_sync("worker2", fail, args=("no such key",))
    except KeyError as exc:
        first = exc.args[0].splitlines()[0]
        print(f"  remote error re-raised as KeyError: {first} ...")
    print()
    print(f"  {'worker':8s} {'calls sent':>10s} {'served':>8s} {'bytes out':>11s} "
          f"{'bytes in':>11s}  transports")
    for r in range(WORLD):
        s = rpc.rpc_sync(f"worker{r}", my_stats)
        print(f"  {s['name']:8s} {s['calls_sent']:10d} {s['calls_served']:8d} "
              f"{_fmt_bytes(s['bytes_out']):>11s} {_fmt_bytes(s['bytes_in']):>11s}  "
              f"{', '.join(s['transports']) or '-'}")


def _worker(rank: int, init_method: str, quick: bool, q) -> None:
    try:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=120)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=opts)
        if rank == 0:
            drive(quick)
        rpc.shutdown()
        q.put((rank, None))
    except BaseException as exc:  # report, never hang the parent
        q.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls, smaller tensors")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    path = os.path.join(tempfile.mkdtemp(prefix="torchwire-demo-"), "rendezvous")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, f"file://{path}", args.quick, q))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    failed = []
    for _ in procs:
        try:
            rank, err = q.get(timeout=300)
        except Exception:
            failed.append("timed out")
            break
        if err:
            failed.append(f"worker{rank}: {err}")
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if failed:
        print("demo failed:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
