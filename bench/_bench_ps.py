"""The parameter-server throughput row: one server, four trainers, one host.

The server (rank 0) holds a 16 MiB MLP (``_bench_funcs.ps_model``).  Each trainer, as
fast as it can, pulls the parameters (fresh tensors: a snapshot the server clones),
computes the gradient of its own batch with them (fresh tensors), and pushes it; the
server applies it with SGD.  The trainers meet at a barrier on the server after their
warm-up steps, then run ``steps`` timed steps each.  Throughput = all trainers' samples
of the timed steps / (last trainer's end - first trainer's start), wall clock of one
host.
"""

from __future__ import annotations

import os
import queue as _queue
import time
import traceback

import _bench_worker
from _bench_procs import free_port, kill_all, thread_env

TRAINERS = 4


def _train_step(rpc, fn, x, y):
    import torch

    import _bench_funcs as F
    params = rpc.rpc_sync("worker0", F.ps_pull)
    for p in params:
        p.requires_grad_(True)
    out = fn(x, params)
    loss = torch.nn.functional.mse_loss(out, y)
    grads = torch.autograd.grad(loss, params)
    rpc.rpc_sync("worker0", F.ps_push, args=(list(grads),))


def _forward(x, params):
    import torch
    w1, b1, w2, b2 = params
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)


def ps_main(lib, rank, port, cfg, q):
    """A process of the job: rank 0 serves, ranks 1.. train."""
    _bench_worker._bench_paths_first()
    try:
        rpc, _ = _bench_worker._load_lib(lib, cfg)
        import torch

        import _bench_funcs as F
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               num_worker_threads=16,
                                               rpc_timeout=cfg["rpc_timeout"])
        if rank == 0:  # before init_rpc, which returns once every worker has joined
            F.ps_setup(TRAINERS)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=TRAINERS + 1,
                     rpc_backend_options=opts)
        if rank:
            torch.manual_seed(rank)
            x, y = torch.randn(F.PS_BATCH, F.PS_IN), torch.randn(F.PS_BATCH, F.PS_OUT)
            for _ in range(cfg["ps_warmup"]):
                _train_step(rpc, _forward, x, y)
            rpc.rpc_sync("worker0", F.ps_meet)
            t0 = time.time()
            for _ in range(cfg["ps_steps"]):
                _train_step(rpc, _forward, x, y)
            q.put(("trained", rank, t0, time.time()))
        rpc.shutdown()
        q.put(("done", rank))
    except BaseException as exc:
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        os._exit(1)


def run_ps(ctx, lib, setting, cfg, timeout, log) -> dict:
    """One job of ``lib`` under thread ``setting``; returns ``{"metrics": {...},
    "errors": [...]}``."""
    port = free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=ps_main, args=(lib, rank, port, cfg, q),
                         name=f"bench-ps-{lib}-worker{rank}", daemon=True)
             for rank in range(TRAINERS + 1)]
    res = {"metrics": {}, "errors": []}
    spans, done = {}, set()
    deadline = time.monotonic() + timeout
    try:
        with thread_env(setting):
            for p in procs:
                p.start()
        while len(done) < len(procs):
            try:
                msg = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except _queue.Empty:
                if time.monotonic() > deadline:
                    res["errors"].append(f"parameter-server job exceeded {timeout:.0f} s")
                    break
                if any(p.exitcode not in (None, 0) for p in procs):
                    res["errors"].append("a parameter-server process died")
                    break
                continue
            if msg[0] == "trained":
                spans[msg[1]] = (msg[2], msg[3])
            elif msg[0] == "done":
                done.add(msg[1])
            elif msg[0] == "error":
                res["errors"].append(f"worker{msg[1]}: {msg[2].splitlines()[0]}")
                log(f"    ERROR parameter server worker{msg[1]}:\n{msg[2]}")
                break
    finally:
        kill_all(procs)
    if len(spans) == TRAINERS:
        import _bench_funcs as F
        wall = max(e for _, e in spans.values()) - min(s for s, _ in spans.values())
        samples = TRAINERS * cfg["ps_steps"] * F.PS_BATCH
        res["metrics"]["ps_samples_per_s"] = samples / wall
    return res
