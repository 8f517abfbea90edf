"""``./run bench --scale``: how long ``init_rpc`` takes for 8, 32 and 64 workers on one host.

A *zygote* process (spawned) imports the library, then forks the N workers, so that
import time is not counted; the workers wait until all are forked, then call
``init_rpc`` together (forking 64 processes of this size takes seconds).  Each worker notes the
wall clock when it calls ``init_rpc`` and when it returns; init time = last return -
first call.  Then every worker shuts down (graceful), and the zygote reports.  The
libraries alternate, round by round.

The zygote calls ``gc.freeze()`` before it forks, as CPython's docs advise for a
process that forks without exec: otherwise the first full collection in each worker
writes to every object inherited from the zygote (their GC headers), copying each
page of them: on a small host, with many workers, those copies outweigh the init
being measured, and a worker started by a launcher never pays them (BENCHMARKS.md,
thirteenth session).
"""

from __future__ import annotations

import gc
import os
import queue as _queue
import select
import time
import traceback

import _bench_worker
from _bench_procs import free_port, kill_all

SCALE_SIZES = (8, 32, 64)


def _worker(rpc, rank, n, port, w, go) -> None:
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the zygote
        os.read(go, 1)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        t0 = time.time()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=n, rpc_backend_options=opts)
        t1 = time.time()
        os.write(w, f"init {rank} {t0!r} {t1!r}\n".encode())
        rpc.shutdown()
        os.write(w, f"down {rank} {time.time()!r}\n".encode())
    except BaseException as exc:
        os.write(w, f"error {rank} {type(exc).__name__}: {exc}\n"[:500].encode())
    finally:
        os._exit(0)


def zygote_main(lib, n, port, cfg, q) -> None:
    _bench_worker._bench_paths_first()
    pids = []
    try:
        rpc, _ = _bench_worker._load_lib(lib, cfg)
        r, w = os.pipe()
        go_r, go_w = os.pipe()
        gc.freeze()  # see the module docstring
        for rank in range(n):
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _worker(rpc, rank, n, port, w, go_r)
            pids.append(pid)
        os.close(w)
        os.write(go_w, b"g" * n)
        inits, downs, errors, buf = {}, {}, [], b""
        deadline = time.monotonic() + cfg["scale_timeout"]
        while len(downs) + len(errors) < n and time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                kind, rank, rest = line.decode().split(" ", 2)
                if kind == "init":
                    inits[int(rank)] = tuple(float(v) for v in rest.split())
                elif kind == "down":
                    downs[int(rank)] = float(rest)
                else:
                    errors.append(f"worker{rank}: {rest}")
        if len(inits) == n:
            first = min(t0 for t0, _ in inits.values())
            last = max(t1 for _, t1 in inits.values())
            q.put(("init", last - first))
        if len(downs) == n:
            q.put(("shutdown", max(downs.values()) - max(t1 for _, t1 in inits.values())))
        missing = n - len(inits)
        if errors or missing:
            q.put(("error", "; ".join(errors[:3])
                   or f"{missing} of {n} workers did not finish init_rpc in time"))
    except BaseException as exc:
        q.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        q.put(("done",))


def run_scale(ctx, lib, n, cfg, log) -> dict:
    """One job of ``n`` workers of ``lib``: ``{"init_s": ..., "shutdown_s": ..., "errors"}``."""
    q = ctx.Queue()
    p = ctx.Process(target=zygote_main, args=(lib, n, free_port(), cfg, q),
                    name=f"bench-scale-{lib}-{n}", daemon=False)
    res = {"init_s": None, "shutdown_s": None, "errors": []}
    try:
        p.start()
        deadline = time.monotonic() + cfg["scale_timeout"] + 60
        while True:
            try:
                msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except _queue.Empty:
                res["errors"].append("no answer from the job in time")
                break
            if msg[0] == "done":
                break
            if msg[0] == "error":
                res["errors"].append(msg[1].splitlines()[0])
            else:
                res[f"{msg[0]}_s"] = msg[1]
    finally:
        kill_all([p])
    return res
