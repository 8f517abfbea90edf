"""Child-process side of the benchmark.

``child_main`` is the entry point of each of the two spawned processes of one
round.  Rank 0 ("worker0") drives every metric against rank 1 ("worker1"),
which only serves.  Results are streamed back to the parent through a
multiprocessing queue as they are produced, so a round that later hangs or
crashes still reports what it measured before.

Messages put on the queue (all tuples, first item is the kind):
  ("imported", rank, path)        (torchwire specs: the torchwire/__init__.py it loaded)
  ("ready", rank, init_seconds)
  ("metric", name, value, extra_dict)
  ("note", text)
  ("error", rank, where, text)
  ("shutdown", rank, seconds)
  ("done", rank)
"""

from __future__ import annotations

import os
import sys
import time
import traceback

LIB_MODULES = {
    "torch": "torch.distributed.rpc",
    "torchwire": "torchwire.rpc",
}

# (label, bytes) of the tensor-echo bandwidth sweep.
ECHO_SIZES = [
    ("1KiB", 1 << 10),
    ("1MiB", 1 << 20),
    ("16MiB", 16 << 20),
    ("64MiB", 64 << 20),
    ("256MiB", 256 << 20),
    ("1GiB", 1 << 30),
]
# The same sweep with the network channel forced (TCP, buffers through the socket).
NET_ECHO_SIZES = ECHO_SIZES[1:]
# The fresh-tensor rows: the callee returns a tensor it creates (``FRESH_OPS``), and the
# caller reads every element of the reply; same host and TCP forced.
FRESH_SIZES = [
    ("1MiB", 1 << 20),
    ("16MiB", 16 << 20),
    ("64MiB", 64 << 20),
    ("256MiB", 256 << 20),
]
FRESH_OPS = {"clone": "t.clone()", "mul2": "t * 2"}
# Options that force it, understood by both libraries (torch's names: "uv" is
# TensorPipe's TCP transport, "basic" its through-the-socket channel).
NET_OPTIONS = {"_transports": ["uv"], "_channels": ["basic"]}


def split_spec(lib: str) -> tuple[str, str | None]:
    """``"torchwire@/some/checkout"`` -> ``("torchwire", "/some/checkout")``;
    ``"torch"`` -> ``("torch", None)``."""
    name, at, path = lib.partition("@")
    return name, (path if at else None)


def _import_lib(lib: str, cfg: dict):
    import importlib

    # cfg may override the module (used to test the bench's failure handling).
    module = cfg.get("lib_modules", {}).get(lib) or LIB_MODULES[split_spec(lib)[0]]
    return importlib.import_module(module)


def _repo_root() -> str:
    """This bench's checkout: where plain ``torchwire`` must come from."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_paths_first() -> None:
    """This bench's directory (for ``_bench_funcs``) and its checkout on sys.path."""
    for p in (os.path.dirname(os.path.abspath(__file__)), _repo_root()):
        if p not in sys.path:
            sys.path.insert(0, p)


def _put_checkout_first(lib: str) -> None:
    """For ``torchwire@PATH``, put PATH first on sys.path, ahead of this bench's checkout
    and of the editable install's finder (which comes after sys.path), before anything
    imports torchwire."""
    path = split_spec(lib)[1]
    if path is None:
        return
    if "torchwire" in sys.modules:
        raise ImportError(f"{lib}: torchwire was imported before {path} was put on sys.path")
    while path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


def _check_origin(lib: str) -> str | None:
    """The torchwire/__init__.py this process loaded (None for torch); raises ImportError
    unless it lies in the checkout ``lib`` names: PATH for ``torchwire@PATH``, this bench's
    own checkout for plain ``torchwire``."""
    name, path = split_spec(lib)
    if name != "torchwire":
        return None
    import torchwire

    want = os.path.join(os.path.realpath(path or _repo_root()), "torchwire")
    got = os.path.realpath(torchwire.__file__)
    if os.path.commonpath([want, got]) != want:
        raise ImportError(f"{lib}: torchwire was imported from {got}, not from {want}")
    return got


def _load_lib(lib: str, cfg: dict):
    """Import ``lib``'s rpc module from the checkout it names; returns ``(rpc, origin)``
    (origin: see ``_check_origin``)."""
    _put_checkout_first(lib)
    rpc = _import_lib(lib, cfg)
    return rpc, _check_origin(lib)


def _percentile(sorted_vals, p):
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def _median(vals):
    s = sorted(vals)
    return _percentile(s, 50)


def _sync_latency(rpc, fn, args, n, warmup):
    return _latency(lambda: rpc.rpc_sync("worker1", fn, args=args), n, warmup)


def _latency(call, n, warmup):
    """Sorted per-call times of ``call()`` in microseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    pc = time.perf_counter_ns
    samples = []
    append = samples.append
    for _ in range(n):
        t0 = pc()
        call()
        append(pc() - t0)
    samples.sort()
    return [s / 1e3 for s in samples]


def _mp_step_times(rpc, steps, warmup):
    """Milliseconds of each model-parallel training step (sorted): remote embedding ->
    local layer -> remote decoder, distributed backward, distributed optimizer step."""
    import importlib

    import torch

    from _bench_funcs import (MP_BAG, MP_BATCH, MP_DIM, MP_VOCAB, mp_decoder, mp_embedding,
                              mp_forward, mp_param_rrefs)

    if rpc.__name__.startswith("torchwire"):
        dist_autograd = importlib.import_module("torchwire.autograd")
        optim = importlib.import_module("torchwire.optim")
    else:
        dist_autograd = importlib.import_module("torch.distributed.autograd")
        optim = importlib.import_module("torch.distributed.optim")
    torch.manual_seed(0)
    emb = rpc.remote("worker1", mp_embedding)
    dec = rpc.remote("worker1", mp_decoder)
    hidden = torch.nn.Linear(MP_DIM, MP_DIM)
    params = (rpc.rpc_sync("worker1", mp_param_rrefs, args=(emb,))
              + [rpc.RRef(p) for p in hidden.parameters()]
              + rpc.rpc_sync("worker1", mp_param_rrefs, args=(dec,)))
    opt = optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    tokens = torch.randint(0, MP_VOCAB, (MP_BATCH * MP_BAG,))
    offsets = torch.arange(0, MP_BATCH * MP_BAG, MP_BAG)
    target = torch.randint(0, MP_VOCAB, (MP_BATCH,))
    pc = time.perf_counter_ns
    samples = []
    for i in range(warmup + steps):
        t0 = pc()
        with dist_autograd.context() as context_id:
            x = rpc.rpc_sync("worker1", mp_forward, args=(emb, tokens, offsets))
            x = torch.relu(hidden(x))
            logits = rpc.rpc_sync("worker1", mp_forward, args=(dec, x))
            loss = criterion(logits, target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        if i >= warmup:
            samples.append(pc() - t0)
    samples.sort()
    return [s / 1e6 for s in samples]


def _run_metrics(rpc, cfg, q):
    import torch

    from _bench_funcs import echo, noop

    def metric(name, value, **extra):
        q.put(("metric", name, value, extra))

    # 1. rpc_sync no-op latency ---------------------------------------------
    lat = _sync_latency(rpc, noop, (), cfg["sync_n"], cfg["sync_warmup"])
    metric("sync_noop_median_us", _percentile(lat, 50), n=len(lat))
    metric("sync_noop_p99_us", _percentile(lat, 99), n=len(lat))

    # 2. rpc_sync echo of a 16-float tensor -----------------------------------
    t16 = torch.randn(16)
    back = rpc.rpc_sync("worker1", echo, args=(t16,))
    if not (isinstance(back, torch.Tensor) and torch.equal(back, t16)):
        raise AssertionError(f"16-float echo returned a wrong value: {back!r}")
    lat = _sync_latency(rpc, echo, (t16,), cfg["sync_n"], cfg["sync_warmup"])
    metric("sync_tensor16_median_us", _percentile(lat, 50), n=len(lat))

    # 2b. remote() + to_here(), and an RRef proxy call ---------------------------
    from _bench_funcs import Box, one

    if rpc.remote("worker1", one).to_here() != 1:
        raise AssertionError("remote(one).to_here() did not return 1")
    lat = _latency(lambda: rpc.remote("worker1", one).to_here(), cfg["sync_n"],
                   cfg["sync_warmup"])
    metric("remote_to_here_median_us", _percentile(lat, 50), n=len(lat))
    box = rpc.remote("worker1", Box, args=(7,))
    if box.rpc_sync().get() != 7:
        raise AssertionError("rref.rpc_sync().get() did not return 7")
    lat = _latency(box.rpc_sync().get, cfg["sync_n"], cfg["sync_warmup"])
    metric("rref_proxy_median_us", _percentile(lat, 50), n=len(lat))

    # 3. model-parallel training step -----------------------------------------
    times = _mp_step_times(rpc, cfg["mp_steps"], cfg["mp_warmup"])
    metric("mp_step_median_ms", _percentile(times, 50), n=len(times),
           p99_ms=_percentile(times, 99))

    # 4. rpc_async throughput --------------------------------------------------
    n_async = cfg["async_n"]
    wait_all_failed = None

    def wait_all(futs):
        nonlocal wait_all_failed
        if wait_all_failed is None:
            try:
                return torch.futures.wait_all(futs)
            except TypeError as exc:  # futures are not torch.futures.Future
                wait_all_failed = f"{type(exc).__name__}: {exc}"
                q.put(("note", "torch.futures.wait_all rejected the returned futures "
                       f"({wait_all_failed}); waited on each future individually"))
        return [f.wait() for f in futs]

    warm = [rpc.rpc_async("worker1", noop) for _ in range(cfg["async_warmup"])]
    wait_all(warm)
    rates = []
    for _ in range(cfg["async_reps"]):
        t0 = time.perf_counter()
        futs = [rpc.rpc_async("worker1", noop) for _ in range(n_async)]
        wait_all(futs)
        dt = time.perf_counter() - t0
        rates.append(n_async / dt)
        del futs
    metric("async_noop_calls_per_s", _median(rates), reps=[round(r) for r in rates],
           n=n_async)

    # 4b. asyncio: await latency, concurrent awaits (torch: fut.wait() in an executor)
    import _bench_asyncio
    for name, value in _bench_asyncio.measure(rpc, cfg["sync_n"], cfg["sync_warmup"],
                                              n_async, cfg["async_reps"]).items():
        metric(name, value)

    _echo_sweep(rpc, cfg, q, ECHO_SIZES, "")
    _fresh_sweep(rpc, cfg, q, "")


def _floor_ms(op, x, warm, iters):
    """Milliseconds of the callee's own op on ``x`` plus one copy of its result into warm
    memory, here in the caller's process: what a round trip cannot go below."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        warm.copy_(op(x))
        times.append(time.perf_counter() - t0)
    return _median(times) * 1e3


def _fresh_sweep(rpc, cfg, q, prefix):
    """Round trips where the callee returns a new tensor (``FRESH_OPS``) and the caller
    reads every element of the reply, for each of ``FRESH_SIZES``; metrics
    ``{prefix}fresh_{op}_{label}_ms``, and (same host) the floor of each in this
    process, ``floor_{op}_{label}_ms``, and the ratio of the two."""
    import torch

    import _bench_funcs

    def metric(name, value, **extra):
        q.put(("metric", name, value, extra))

    for label, nbytes in FRESH_SIZES:
        iters = cfg["fresh_iters"][label]
        x = torch.empty(nbytes // 4).uniform_()
        for op in FRESH_OPS:
            fn = getattr(_bench_funcs, f"fresh_{op}")
            y = rpc.rpc_sync("worker1", fn, args=(x,))
            if not torch.equal(y, fn(x)):
                raise AssertionError(f"{label} {op} returned a wrong value")
            # a second warm-up call while the first reply is still held: a loop's steady
            # state holds one reply while the next arrives
            y = rpc.rpc_sync("worker1", fn, args=(x,))
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                y = rpc.rpc_sync("worker1", fn, args=(x,))
                y.sum().item()  # the caller reads every element of the reply
                times.append(time.perf_counter() - t0)
            del y
            med = _median(times) * 1e3
            metric(f"{prefix}fresh_{op}_{label}_ms", med, iters=iters,
                   times_ms=[round(t * 1e3, 2) for t in times])
            if not prefix:
                floor = _floor_ms(fn, x, torch.empty_like(x).fill_(0), iters)
                metric(f"floor_{op}_{label}_ms", floor, iters=iters)
                metric(f"fresh_{op}_{label}_over_floor", med / floor)
        del x
    _state_dict_rows(rpc, cfg, metric, prefix)


def _state_dict_rows(rpc, cfg, metric, prefix):
    """A 250-tensor, 173 MiB state dict pulled (the callee returns a fresh copy; the
    caller reads every tensor) and pushed (fresh copies; the callee reads every one)."""
    import _bench_funcs
    sd = _bench_funcs.state_dict_make()
    expected = {k: v.sum().item() for k, v in sd.items()}
    for name in ("pull", "push"):
        times = []
        for i in range(cfg["sd_iters"] + 1):  # the first, checked, is a warm-up
            t0 = time.perf_counter()
            if name == "pull":
                got = rpc.rpc_sync("worker1", _bench_funcs.state_dict_pull)
                sums = {k: v.sum().item() for k, v in got.items()}
                del got
            else:
                fresh = {k: v.clone() for k, v in sd.items()}
                total = rpc.rpc_sync("worker1", _bench_funcs.state_dict_push, args=(fresh,))
                del fresh
            if i:
                times.append(time.perf_counter() - t0)
            elif (sums != expected if name == "pull"  # (a sum's rounding: its threads)
                  else abs(total - sum(expected.values())) > 1.0):
                raise AssertionError(f"state dict {name} returned a wrong value")
        metric(f"{prefix}sd_{name}_ms", _median(times) * 1e3, iters=len(times),
               times_ms=[round(t * 1e3, 2) for t in times])


def _echo_sweep(rpc, cfg, q, sizes, prefix):
    """Tensor echo bandwidth for each ``(label, bytes)``; metrics named
    ``{prefix}echo_{label}_GBps``; the 1 GiB same-host echo also records peak RSS."""
    import torch

    from _bench_funcs import echo, reset_peak_rss, rss_mib

    def metric(name, value, **extra):
        q.put(("metric", name, value, extra))

    for label, nbytes in sizes:
        iters = cfg["echo_iters"][label]
        x = torch.empty(nbytes // 4).uniform_()
        track_rss = label == "1GiB" and not prefix
        if track_rss:  # peak RSS of both processes during this echo, above idle
            idle = (rss_mib()[0], rpc.rpc_sync("worker1", rss_mib)[0])
            reset_peak_rss()
            rpc.rpc_sync("worker1", reset_peak_rss)
        for _ in range(cfg["echo_warmup"]):
            y = rpc.rpc_sync("worker1", echo, args=(x,))
        if not (isinstance(y, torch.Tensor) and y.shape == x.shape and torch.equal(y, x)):
            raise AssertionError(f"{label} echo returned a wrong value")
        del y
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            y = rpc.rpc_sync("worker1", echo, args=(x,))
            times.append(time.perf_counter() - t0)
            # Checked outside the timed region.
            if y.numel() != x.numel():
                raise AssertionError(f"{label} echo returned {y.numel()} elements")
            del y
        med = _median(times)
        metric(f"{prefix}echo_{label}_GBps", 2 * nbytes / med / 1e9, iters=iters,
               median_s=med, times_s=[round(t, 6) for t in times])
        if track_rss:
            peak = (rss_mib()[1], rpc.rpc_sync("worker1", rss_mib)[1])
            metric("echo_1GiB_caller_peak_rss_MiB", peak[0] - idle[0], idle=idle[0])
            metric("echo_1GiB_callee_peak_rss_MiB", peak[1] - idle[1], idle=idle[1])
        del x


def child_main(lib, rank, port, cfg, q):
    """Entry point of one spawned benchmark process."""
    _bench_paths_first()
    where = "import"
    try:
        rpc, origin = _load_lib(lib, cfg)
        if origin is not None:
            q.put(("imported", rank, origin))
        where = "init_rpc"
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}",
            num_worker_threads=16,
            rpc_timeout=cfg["rpc_timeout"],
            **(NET_OPTIONS if cfg.get("network") else {}),
        )
        t0 = time.perf_counter()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        q.put(("ready", rank, time.perf_counter() - t0))
        if rank == 0:
            where = "metrics"
            if cfg.get("network"):
                _echo_sweep(rpc, cfg, q, NET_ECHO_SIZES, "net_")
                _fresh_sweep(rpc, cfg, q, "net_")
            else:
                _run_metrics(rpc, cfg, q)
        where = "shutdown"
        t0 = time.perf_counter()
        rpc.shutdown()
        q.put(("shutdown", rank, time.perf_counter() - t0))
        q.put(("done", rank))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        tb = traceback.format_exc(limit=8)
        q.put(("error", rank, where, f"{type(exc).__name__}: {exc}\n{tb}"))
        # Give the queue's feeder thread a chance to flush before exiting.
        try:
            q.close()
            q.join_thread()
        except Exception:
            pass
        os._exit(1)
    try:
        q.close()
        q.join_thread()
    except Exception:
        pass


INTERLEAVED = ("sync_noop", "sync_tensor16", "remote_to_here", "rref_proxy")


def interleaved_main(lib, rank, port, cfg, cmd_q, res_q):
    """A process of a short latency round (see ``bench.run_interleaved``).

    worker0 answers ``("block", metric, n, warmup)`` commands with the sorted
    per-call microseconds of ``n`` calls, and ``("mp", steps, warmup)`` with the
    sorted milliseconds of ``steps`` model-parallel training steps, until
    ``("stop",)``; worker1 serves.  worker0's ``("ready", lib, origin)`` names the
    torchwire/__init__.py it loaded (None for torch); worker1 only checks its own.
    The parent runs one such pair at a time (a short round), then stops it.
    """
    _bench_paths_first()
    try:
        rpc, origin = _load_lib(lib, cfg)
        import torch

        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               num_worker_threads=16,
                                               rpc_timeout=cfg["rpc_timeout"])
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        if rank == 0:
            from _bench_funcs import Box, echo, noop, one
            t16 = torch.randn(16)
            box = rpc.remote("worker1", Box, args=(7,))
            calls = {
                "sync_noop": lambda: rpc.rpc_sync("worker1", noop),
                "sync_tensor16": lambda: rpc.rpc_sync("worker1", echo, args=(t16,)),
                "remote_to_here": lambda: rpc.remote("worker1", one).to_here(),
                "rref_proxy": box.rpc_sync().get,
            }
            if not (torch.equal(calls["sync_tensor16"](), t16) and calls["rref_proxy"]() == 7
                    and calls["remote_to_here"]() == 1):
                raise AssertionError("an interleaved latency call returned a wrong value")
            res_q.put(("ready", lib, origin))
            while True:
                cmd = cmd_q.get()
                if cmd[0] == "stop":
                    break
                if cmd[0] == "mp":  # model-parallel steps: sorted milliseconds
                    _, steps, warmup = cmd
                    res_q.put(("samples", lib, "mp_step", _mp_step_times(rpc, steps, warmup)))
                    continue
                _, metric, n, warmup = cmd
                res_q.put(("samples", lib, metric, _latency(calls[metric], n, warmup)))
        rpc.shutdown()
    except BaseException as exc:
        res_q.put(("error", lib, f"worker{rank}: {type(exc).__name__}: {exc}\n"
                   f"{traceback.format_exc(limit=8)}"))
        try:
            res_q.close()
            res_q.join_thread()
        except Exception:
            pass
        os._exit(1)
