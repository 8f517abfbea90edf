#!/usr/bin/env python
"""Side-by-side benchmark of torch.distributed.rpc and torchwire.rpc.

Usage:
    python bench/bench.py [--quick] [--rounds N] [--short-rounds N] [--libs torch,torchwire]
                          [--threads default,omp1] [--out BENCHMARKS.md]
    python bench/bench.py --scale [--rounds N] [--sizes 8,32,64]   # init_rpc at scale
    python bench/bench.py --libs torchwire@PATH torchwire [--out FILE]   # A/B of two versions:
        torchwire from the checkout at PATH vs this checkout; ratios second / first, each
        metric flagged when worse by more than 3 %; the report goes to stdout and to FILE
        (default: a new torchwire-ab-*.md in the temp directory, named at the end, not
        BENCHMARKS.md)

Each round of a library starts fresh processes (multiprocessing 'spawn' context) on
127.0.0.1.  Rounds alternate between the libraries (torch, torchwire, torch, ...) and
between the thread settings (torch's default intra-op threads, OMP_NUM_THREADS=1), and
every reported number is the median over that library's rounds under that setting.
Every wait has a timeout: a round that hangs is killed and reported as an error
instead of hanging the benchmark.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _p in (BENCH_DIR, REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# noqa: E402 below: the bench directory must be on sys.path first (and the modules
# importable by reference in the spawned children).
import _bench_report as R  # noqa: E402
from _bench_procs import SETTING_TITLES, THREAD_SETTINGS  # noqa: E402
from _bench_ps import TRAINERS, run_ps  # noqa: E402
from _bench_rounds import _merge_network_round, run_interleaved, run_round  # noqa: E402
from _bench_scale import SCALE_SIZES, run_scale  # noqa: E402
from _bench_worker import FRESH_OPS, NET_OPTIONS, split_spec  # noqa: E402


PARTS = ("short", "long", "net", "ps")


def make_cfg(quick: bool) -> dict:
    cfg = {
        "sync_n": 2000, "sync_warmup": 200,
        "async_n": 10_000, "async_reps": 3, "async_warmup": 1000,
        "mp_steps": 500, "mp_warmup": 50,
        "echo_warmup": 1,
        "echo_iters": {"1KiB": 1000, "1MiB": 200, "16MiB": 40, "64MiB": 12, "256MiB": 3,
                       "1GiB": 2},
        "fresh_iters": {"1MiB": 100, "16MiB": 20, "64MiB": 8, "256MiB": 5},
        "sd_iters": 8,
        "rpc_timeout": 120,
        "il_blocks": 8, "il_block": 500, "il_warmup": 100,
        "il_mp_steps": 200, "il_mp_warmup": 30,
        "ps_steps": 40, "ps_warmup": 5, "ps_timeout": 300,
        "scale_timeout": 240,
    }
    if quick:
        cfg.update({
            "sync_n": 300, "sync_warmup": 50, "async_reps": 1, "async_warmup": 500,
            "mp_steps": 100, "mp_warmup": 20,
            "echo_iters": {"1KiB": 100, "1MiB": 20, "16MiB": 5, "64MiB": 3, "256MiB": 2,
                           "1GiB": 1},
            "fresh_iters": {"1MiB": 20, "16MiB": 5, "64MiB": 3, "256MiB": 3},
            "sd_iters": 3,
            "il_blocks": 2, "il_block": 150, "il_warmup": 50,
            "il_mp_steps": 60, "il_mp_warmup": 20,
            "ps_steps": 10, "ps_warmup": 3,
        })
    return cfg


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
            mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration):
        pass
    try:
        from importlib.metadata import version
        torch_version = version("torch")
    except Exception:
        torch_version = "unknown"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"cpu": cpu, "cores": cores, "mem": mem, "python": platform.python_version(),
            "torch": torch_version, "os": f"{platform.system()} {platform.release()}",
            "torchwire": R.describe_checkout(REPO_ROOT)}


def _how_measured(cfg, libs, settings, rounds) -> list:
    titles = R.lib_titles(libs)
    order = ", ".join(titles[lib] for lib in libs)
    echo_iters = ", ".join(f"{k}: {v}" for k, v in cfg["echo_iters"].items())
    fresh_iters = ", ".join(f"{k}: {v}" for k, v in cfg["fresh_iters"].items())
    ops = " and ".join(f"`{e}`" for e in FRESH_OPS.values())
    return [
        "- Processes on 127.0.0.1, started with the multiprocessing `spawn` context; "
        "rendezvous via `init_method=tcp://127.0.0.1:<free port>`, "
        "`TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)` for both "
        "libraries.",
        "- **Thread settings**: every round runs under each of "
        + ", ".join(f"*{SETTING_TITLES[s]}*" for s in settings)
        + " (the processes' environment: `OMP_NUM_THREADS` unset, so torch's default "
        "intra-op threads, or `OMP_NUM_THREADS=1`, what `torchrun` sets when it starts "
        "several processes per host), alternating, for both libraries. Each target is "
        "judged on the **worse** of the settings' ratios.",
        f"- A long round = 2 fresh processes (worker0 drives, worker1 serves), `init_rpc`, "
        f"all metrics, `shutdown()`. Rounds alternate between libraries ({order}) and "
        f"settings, {rounds} round(s) per library and setting. Every figure is the "
        "**median over rounds** (per-round values further down).",
        "- Remote functions are module-level functions of `bench/_bench_funcs.py` "
        "(pickled by reference).",
        "- Short alternating rounds (the latency and model-parallel step targets are judged "
        f"here): {cfg['il_blocks']} per library and setting, before the long rounds. A short "
        f"round = 2 fresh processes, `init_rpc`, the four latency metrics ({cfg['il_warmup']} "
        f"warm-up + {cfg['il_block']} timed calls each, each call timed), then the "
        f"model-parallel step ({cfg['il_mp_warmup']} warm-up + {cfg['il_mp_steps']} timed "
        "steps), `shutdown()`; each library runs alone, and both sample the machine seconds "
        "apart (its speed drifts several-fold over minutes). Median of each short round, "
        "then the median over short rounds.",
        f"- rpc_async throughput: {cfg['async_n']:,} `rpc_async(noop)` calls issued back to "
        "back, then `torch.futures.wait_all`; calls / elapsed time, median of "
        f"{cfg['async_reps']} repetition(s) per round.",
        "- Model-parallel step: EmbeddingBag(1000, 32) and Linear(32, 1000) on worker1, "
        "Linear(32, 32) on worker0; one step = a distributed autograd context, two rpc_sync "
        "forwards, cross-entropy, distributed backward, DistributedOptimizer(SGD).step.",
        f"- **Fresh tensor round trips** (what programs move): a float32 tensor sent with "
        f"`rpc_sync` to a function that returns a new tensor ({ops}), and the caller reads "
        "every element of the reply (`y.sum().item()`) inside the timed region; the caller "
        "keeps the previous reply until the next one arrives (`y = rpc_sync(...)` in a loop). "
        f"2 warm-up calls (the first checked), then per size: {fresh_iters}; median. "
        "The **floor** of a row is measured in the caller's process right after it: "
        "the callee's own op on the same tensor plus one copy of its result into memory "
        "already faulted in; the ratio of the round trip to its floor is taken per round.",
        "- **State dict** rows: 250 float32 tensors of ResNet-like sizes (50 convolutions "
        "of 64–512 channels, 3×3, each with 4 per-channel vectors; 173 MiB). Pull: the "
        "callee returns a fresh copy of the one it keeps and the caller reads every "
        "tensor; push: the caller sends fresh copies and the callee reads every tensor. "
        f"1 checked warm-up, then {cfg['sd_iters']} calls; median.",
        "- **Tensor echo by reference**: the callee returns the very tensor it received (a "
        "best case: torchwire sends its shared-memory buffer back without a copy); "
        "bandwidth = 2 × bytes / median call time (1 warm-up call, then per size: "
        f"{echo_iters}); the caller drops each reply unread. Default channels (same host: "
        "torchwire shared memory, TensorPipe shm/cma).",
        "- Network channel forced: after each long round, 2 more processes of the same "
        f"library with `{NET_OPTIONS}` (TensorPipe's TCP transport and through-the-socket "
        "channel; torchwire: TCP, buffers through the socket) run the echo and fresh sweeps "
        "from 1 MiB.",
        f"- **Parameter server**: 1 server + {TRAINERS} trainers (5 processes), one job per "
        "round and setting. The server holds an MLP of 16 MiB of float32 (Linear(1024, 2048), "
        "ReLU, Linear(2048, 1024)); each trainer repeats: pull the parameters (the server "
        "returns clones taken under its lock), compute the gradient of an MSE loss on its "
        f"batch of 16 with them, push the gradients (the server applies SGD). "
        f"{cfg['ps_warmup']} warm-up steps, a barrier, then {cfg['ps_steps']} steps each; "
        "samples/s = all trainers' samples / (last end - first start).",
        "- Ratio is torchwire / torch of the medians; for latency lower is better, for "
        "throughput and bandwidth higher is better.",
    ]


def build_report(summary, libs, settings, rounds, cfg, args, machine, started, elapsed,
                 scale_section) -> str:
    titles = R.lib_titles(libs)
    want = {"round": rounds, "ps": rounds, "il": cfg["il_blocks"]}
    worse = []
    if R.is_ab(libs):
        title = f"# torchwire A/B benchmark: {titles[libs[0]]} vs {titles[libs[1]]}"
        versions = [f"- Python {machine['python']}, torch {machine['torch']}"] + [
            f"- {titles[lib]}: {R.describe_checkout(R.checkout_of(lib, REPO_ROOT))}; workers "
            f"imported torchwire from {', '.join(summary[settings[0]][lib]['imported'])}"
            for lib in libs]
        table, worse = R.build_ab_table(summary, libs, settings, want)
    else:
        title = "# torchwire vs torch.distributed.rpc benchmark"
        versions = [f"- Python {machine['python']}, torch {machine['torch']}, "
                    f"torchwire {machine['torchwire']}"]
        table = R.build_table(summary, libs, settings, want)
    parts = [
        title, "",
        f"- Date: {started.strftime('%Y-%m-%d %H:%M:%S %Z').strip()}",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['mem']} RAM, "
        f"{machine['os']}",
    ] + versions + [
        "- Command: `" + " ".join(["python bench/bench.py"] + list(args)) + "`",
        f"- Mode: {'quick' if cfg['sync_n'] < 2000 else 'full'}; total wall time {elapsed:.0f} s",
        "", "## How it was measured", "",
    ] + _how_measured(cfg, libs, settings, rounds) + ["", "## Results", "", table, ""]
    if R.is_ab(libs):
        parts += [f"Worse by more than {R.AB_TOLERANCE * 100:g} %: "
                  + ("; ".join(worse) if worse else "none") + ".", ""]
    notes = []
    for st in settings:
        for lib in libs:
            notes += [f"- {titles[lib]}, {SETTING_TITLES[st]}: {e}"
                      for e in summary[st][lib]["errors"] + summary[st][lib]["notes"]]
    if notes:
        parts += ["## Errors and notes", ""] + notes + [""]
    parts += ["## Per-round values", "", R.build_per_round(summary, libs, settings), ""]
    if scale_section:
        parts += [scale_section, ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------- main

def _parse_lib_spec(ap, name: str) -> str:
    """``torch``, ``torchwire``, or ``torchwire@PATH`` with PATH made absolute (a checkout
    of this repository: PATH/torchwire/__init__.py must exist)."""
    base, path = split_spec(name)
    if base not in R.LIB_TITLES:
        ap.error(f"unknown library {name!r}; choose from {', '.join(R.LIB_TITLES)}, "
                 "torchwire@PATH")
    if path is None:
        return base
    if base != "torchwire":
        ap.error(f"{name!r}: only torchwire can be taken from another checkout (@PATH)")
    path = os.path.realpath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(path, "torchwire", "__init__.py")):
        ap.error(f"{name!r}: {path}/torchwire/__init__.py does not exist")
    return f"torchwire@{path}"


def _split_list(items) -> list:
    return [x.strip() for item in items for x in item.split(",") if x.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 round per library and smaller iteration counts")
    ap.add_argument("--scale", action="store_true",
                    help="only init_rpc at scale (--sizes); replaces that section of --out")
    ap.add_argument("--sizes", nargs="+", default=[",".join(map(str, SCALE_SIZES))],
                    help="world sizes of --scale (default 8,32,64)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per library and setting (default 3, or 1 with --quick)")
    ap.add_argument("--short-rounds", type=int, default=None,
                    help="short alternating rounds per library and setting (default 8, or 2 "
                    "with --quick)")
    ap.add_argument("--threads", nargs="+", default=[",".join(THREAD_SETTINGS)],
                    help="thread settings: default, omp1 (default: both)")
    ap.add_argument("--libs", "--lib", dest="libs", nargs="+", default=["torch", "torchwire"],
                    help="libraries to run, comma or space separated (torch, torchwire); "
                    "torchwire@PATH: torchwire from the checkout at PATH, for an A/B of two "
                    "torchwire versions (e.g. torchwire@/work/base torchwire)")
    ap.add_argument("--out", default=None,
                    help="markdown report path (default: BENCHMARKS.md at the repo root; "
                    "in A/B mode a new torchwire-ab-*.md in the temp directory)")
    ap.add_argument("--stall-timeout", type=float, default=90.0,
                    help="kill a round after this many seconds without progress (default 90)")
    ap.add_argument("--round-timeout", type=float, default=300.0,
                    help="kill a round after this many seconds in total (default 300)")
    ap.add_argument("--only", nargs="+", default=[",".join(PARTS)],
                    help="parts to run (a partial report, for development): short (the short "
                    "alternating latency rounds), long (the long rounds), net (their "
                    "network-forced sweeps), ps (the parameter server); default: all")
    ap.add_argument("--json", default=None, help="also dump raw per-round results to this file")
    args = ap.parse_args(argv)
    args.libs = list(dict.fromkeys(_parse_lib_spec(ap, n) for n in _split_list(args.libs)))
    if R.is_ab(args.libs) and (len(args.libs) != 2 or any(
            split_spec(lib)[0] != "torchwire" for lib in args.libs)):
        ap.error("torchwire@PATH is for an A/B of two torchwire versions: give exactly two, "
                 "e.g. --libs torchwire@/work/base torchwire")
    args.only = set(_split_list(args.only))
    if not args.only or args.only - set(PARTS):
        ap.error(f"--only: choose from {', '.join(PARTS)}")
    args.threads = tuple(_split_list(args.threads))
    if not args.threads or any(t not in THREAD_SETTINGS for t in args.threads):
        ap.error(f"--threads: choose from {', '.join(THREAD_SETTINGS)}")
    try:
        args.sizes = tuple(int(n) for n in _split_list(args.sizes))
    except ValueError:
        ap.error("--sizes: world sizes, e.g. 8,32,64")
    if args.out is None:
        if R.is_ab(args.libs):
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            args.out = os.path.join(tempfile.gettempdir(), f"torchwire-ab-{stamp}.md")
        else:
            args.out = os.path.join(REPO_ROOT, "BENCHMARKS.md")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1 or (args.short_rounds is not None and args.short_rounds < 1):
        ap.error("--rounds and --short-rounds must be >= 1")
    return args


def _log(t0):
    def log(msg):
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}" if not msg.startswith("    ") else msg,
              file=sys.stderr, flush=True)
    return log


def main_scale(args, cfg, ctx, started, log) -> int:
    scale = {n: {lib: [] for lib in args.libs} for n in args.sizes}
    for n in args.sizes:
        for rnd in range(args.rounds):
            for lib in (args.libs if rnd % 2 == 0 else args.libs[::-1]):
                log(f"init at scale: {n} workers, {lib}, round {rnd + 1}/{args.rounds}")
                res = run_scale(ctx, lib, n, cfg, log)
                log(f"    init {res['init_s']} s, shutdown {res['shutdown_s']} s"
                    + (f"; errors: {res['errors']}" if res["errors"] else ""))
                scale[n][lib].append(res)
    section = R.build_scale_section(scale, args.libs, args.sizes, args.rounds, started,
                                    machine_info())
    print(section)
    with open(args.out + ".tmp", "w") as f:
        f.write(R.replace_scale_section(args.out, section))
    os.replace(args.out + ".tmp", args.out)
    log(f"wrote the init-at-scale section of {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scale, f, indent=1, default=str)
    return 0


def _long_round(ctx, lib, st, cfg, args, log) -> dict | None:
    """A long round and (unless it hung) its network-forced sweeps, as ``--only`` asks."""
    r = None
    if "long" in args.only:
        r = run_round(ctx, lib, st, cfg, args.stall_timeout, args.round_timeout,
                      shutdown_timeout=60.0, log=log)
    if "net" in args.only and not (r and r["timed_out"]):
        log(f"    network channel forced ({NET_OPTIONS})")
        net = run_round(ctx, lib, st, dict(cfg, network=True), args.stall_timeout,
                        args.round_timeout, shutdown_timeout=60.0, log=log)
        if r is None:
            r = net
        else:
            _merge_network_round(r, net)
    if r is not None:
        status = "ok" if not r["errors"] else "FAILED: " + "; ".join(r["errors"])
        log(f"    round took {r['wall_s']:.1f} s, {status}")
    return r


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cfg = make_cfg(args.quick)
    if args.short_rounds is not None:
        cfg["il_blocks"] = args.short_rounds
    started = _dt.datetime.now().astimezone()
    t0 = time.monotonic()
    log = _log(t0)
    # Make TensorPipe / Gloo use the loopback interface (same for both libraries).
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    if args.scale:
        return main_scale(args, cfg, ctx, started, log)
    libs, settings = args.libs, args.threads
    titles = R.lib_titles(libs)
    interleaved = {st: {lib: {} for lib in libs} for st in settings}
    if "short" in args.only:
        log("short alternating latency rounds: " + ", ".join(titles[lib] for lib in libs))
        interleaved = run_interleaved(ctx, libs, settings, cfg, log)
    results = {st: {lib: [] for lib in libs} for st in settings}
    ps = {st: {lib: [] for lib in libs} for st in settings}
    for rnd in range(args.rounds):
        for st in (settings if rnd % 2 == 0 else settings[::-1]):
            for lib in (libs if rnd % 2 == 0 else libs[::-1]):
                log(f"round {rnd + 1}/{args.rounds}: {titles[lib]}, {SETTING_TITLES[st]}")
                r = _long_round(ctx, lib, st, cfg, args, log)
                if r is not None:
                    results[st][lib].append(r)
                if "ps" in args.only:
                    log("    parameter server")
                    p = run_ps(ctx, lib, st, cfg, cfg["ps_timeout"], log)
                    log(f"    {p['metrics']} {p['errors'] or ''}")
                    ps[st][lib].append(p)
    elapsed = time.monotonic() - t0
    summary = {st: {lib: R.summarize(results[st][lib], interleaved[st][lib], ps[st][lib])
                    for lib in libs} for st in settings}
    machine = machine_info()
    report = build_report(summary, libs, settings, args.rounds, cfg, argv, machine, started,
                          elapsed, R.keep_scale_section(args.out))
    print(report)
    with open(args.out, "w") as f:
        f.write(report)
    log(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cfg": cfg, "machine": machine, "results": results, "ps": ps,
                       "interleaved": interleaved}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
