"""What every example shares: options, launching, progress bars, the summary, the plot.

An example is a function ``worker(job)`` run once per process.  :func:`launch`
starts those processes itself (``python -m torchwire.examples.NAME``) or, under
``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` in the environment),
runs the one this process is, with ``init_method="env://"``.  Only the public
API of torchwire is used here, as a user program would.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import traceback

import torch

import torchwire.rpc as rpc
from torchwire.launch import Supervisor


def parser(name: str, doc: str, *, world_size: int, steps: int, min_world: int = 2,
           lr: float | None = None, batch_size: int | None = None) -> argparse.ArgumentParser:
    """The options every example takes, with this example's defaults."""
    p = argparse.ArgumentParser(prog=f"python -m torchwire.examples.{name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=world_size,
                   help=f"processes to start (default {world_size}, at least {min_world}); "
                        "under torchrun WORLD_SIZE decides")
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    if lr is not None:
        p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    if batch_size is not None:
        p.add_argument("--batch-size", type=int, default=batch_size,
                       help=f"samples per step and trainer (default {batch_size})")
    p.add_argument("--plot", default=f"torchwire-{name}.png",
                   help="where to save the learning curve (PNG; default %(default)s; "
                        "'' for none)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: the processes share the cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--timeout", type=float, default=600,
                   help="give up after this many seconds (default 600)")
    p.add_argument("--results", default="",
                   help="also write the summary's figures to this JSON file")
    p.add_argument("--profile", default="", metavar="PATH",
                   help="write one stitched trace of every worker (Chrome/Perfetto JSON, "
                        "gzipped if PATH ends in .gz) over the first --profile-steps steps")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps the --profile trace covers (default 5)")
    p.set_defaults(min_world=min_world, example=name)
    return p


@dataclasses.dataclass
class Job:
    """What one process of an example knows about the job."""

    rank: int
    world_size: int
    args: argparse.Namespace
    rpc_init_method: str
    #: where a torch.distributed process group (gloo) meets; not the RPC store's address
    group_init_method: str
    torchrun: bool
    #: how many processes held this rank before this one (restarted after a crash)
    restart: int = 0

    def init_rpc(self, name: str) -> None:
        torch.manual_seed(self.args.seed * 1000 + self.rank)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=self.rpc_init_method,
                                               rpc_timeout=120, init_timeout=120)
        rpc.init_rpc(name, rank=self.rank, world_size=self.world_size,
                     rpc_backend_options=opts)
        if self.args.profile and self.rank == 0:
            _start_profile(self.args.profile)


_profile: list = []  # rank 0: the job profile while it runs
_profile_lock = threading.Lock()


def _start_profile(path: str) -> None:
    from torchwire.profiler import JobProfile
    with _profile_lock:
        _profile.append(JobProfile(path).start())


def _finish_profile() -> None:
    """Rank 0 (by RPC from the first trainer done with its profiled steps): stop the
    job profile and write the trace."""
    with _profile_lock:
        if not _profile:
            return
        job = _profile.pop()
        path = job.stop()
    print(f"stitched trace of {len(job.workers)} workers ({', '.join(job.workers)}): {path}",
          flush=True)


def drive_or_serve(job: Job, drive, driver: str, others: str) -> None:
    """Rank 0 joins as ``driver`` and runs ``drive(job)``; every other rank joins as
    ``<others><rank>`` and serves the calls made to it until the job shuts down."""
    job.init_rpc(driver if job.rank == 0 else f"{others}{job.rank}")
    if job.rank == 0:
        drive(job)
    rpc.shutdown()


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


# what the examples import from their extra (pyproject.toml, "examples"), by import name
_EXTRA = {"sklearn": "scikit-learn", "gymnasium": "gymnasium", "tqdm": "tqdm",
          "matplotlib": "matplotlib"}


def missing_extra(args: argparse.Namespace) -> list[str]:
    """The packages of the examples extra that are not installed (matplotlib only when
    a plot is asked for)."""
    return [pkg for mod, pkg in _EXTRA.items()
            if (mod != "matplotlib" or args.plot) and importlib.util.find_spec(mod) is None]


def launch(worker, args: argparse.Namespace) -> int:
    """Run ``worker(job)`` on every process of the job; return an exit status."""
    missing = missing_extra(args)
    if missing:  # one line here, rather than a traceback from each worker
        print(f"torchwire.examples needs the examples extra (missing: {', '.join(missing)}): "
              "pip install 'torchwire[examples]'", file=sys.stderr)
        return 2
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world < args.min_world:
            print(f"{args.example} needs at least {args.min_world} processes, torchrun "
                  f"started {world}", file=sys.stderr)
            return 2
        job = Job(int(os.environ["RANK"]), world, args, "env://", "env://", True,
                  int(os.environ.get("TORCHWIRE_RESTART_COUNT", "0")))
        _run_one(worker, job)
        return 0
    if args.world_size < args.min_world:
        print(f"--world-size must be at least {args.min_world}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix=f"torchwire-{args.example}-")
    rpc_init = f"file://{os.path.join(tmp, 'rpc')}"
    group_init = f"file://{os.path.join(tmp, 'group')}"
    # fork: the children start at once, with torch already imported (the parent ran no
    # torch op, so there is no thread pool to inherit)
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")

    def start(rank: int, restart: int = 0):
        p = ctx.Process(target=_run_one,
                        args=(worker, Job(rank, args.world_size, args, rpc_init, group_init,
                                          False, restart)),
                        name=f"rank{rank}")
        p.start()
        return p

    restarts = getattr(args, "max_restarts", 0)
    if restarts:  # a crashed rank starts again and rejoins; the others run on
        sup = Supervisor(lambda rank, restart: _Handle(start(rank, restart)),
                         args.world_size, restarts, report=_quiet)
        return sup.run(args.timeout)
    return _wait([start(r) for r in range(args.world_size)], args.timeout)


class _Handle:
    """A forked rank as the launcher's supervisor watches it."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


def _quiet(line: str) -> None:
    """The supervisor's report: restarts are the example's own news (its summary)."""
    if "giving up" in line:
        print(line, file=sys.stderr, flush=True)


def _run_one(worker, job: Job) -> None:
    torch.set_num_threads(job.args.threads)
    try:
        worker(job)
    except BaseException:
        print(f"rank {job.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _wait(procs, timeout: float) -> int:
    """Wait for every process; a failure gives the others 30 s to notice, then kills."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if any(p.exitcode not in (None, 0) for p in procs) and failed_at is None:
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 30):
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
            print(f"gave up: {'a process failed' if failed_at else 'timed out'}; "
                  "the others were killed", file=sys.stderr)
            return 1
        time.sleep(0.1)
    for p in procs:
        p.join(5)
    bad = [f"{p.name} (exit {p.exitcode})" for p in procs if p.exitcode != 0]
    if bad:
        print("failed: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ progress, summary, plot


class Progress:
    """A tqdm bar for one trainer: its metrics (loss...) and throughput as it goes."""

    def __init__(self, args, desc: str, position: int, total: int,
                 unit: str = "samples") -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, position=position, unit="step",
                        leave=True, mininterval=0.5, dynamic_ncols=True,
                        disable=args.no_progress, file=sys.stderr)
        self.t0 = time.perf_counter()
        self.unit = unit
        self.samples = 0
        self.args = args
        self.steps = 0

    def update(self, samples: int, **metrics: float) -> None:
        """One step done, of ``samples`` samples; ``metrics`` shown as they are now."""
        self.samples += samples
        rate = self.samples / max(time.perf_counter() - self.t0, 1e-9)
        post = {k: f"{v:.3f}" for k, v in metrics.items()}
        post[f"{self.unit}/s"] = f"{rate:,.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        self.steps += 1
        if self.args.profile and self.steps == self.args.profile_steps:
            rpc.rpc_sync(0, _finish_profile)

    def close(self) -> None:
        self.bar.close()
        if self.args.profile and self.steps < self.args.profile_steps:
            rpc.rpc_sync(0, _finish_profile)


def rpc_totals(world_size: int) -> tuple[int, int]:
    """Calls sent and bytes sent, summed over every worker (asked by RPC)."""
    futs = [rpc.rpc_async(r, rpc.stats) for r in range(world_size)]
    all_stats = [f.wait() for f in futs]
    return (sum(s["calls_sent"] for s in all_stats), sum(s["bytes_out"] for s in all_stats))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary(args, title: str, results: list[tuple[str, str]], elapsed: float,
            world_size: int, figures: dict) -> None:
    """Print the final summary (results, time, RPC traffic of the whole job); write
    ``figures`` with the time and traffic to ``args.results`` if given (JSON)."""
    calls, sent = rpc_totals(world_size)
    if args.results:
        with open(args.results, "w", encoding="utf-8") as f:
            json.dump(dict(figures, seconds=elapsed, rpc_calls=calls, rpc_bytes_sent=sent,
                           world_size=world_size), f, indent=1)
    rows = list(results) + [("time", f"{elapsed:.1f} s"),
                            ("rpc traffic", f"{calls:,} calls, {_fmt_bytes(sent)} sent "
                                            f"(all {world_size} workers)")]
    if args.plot:
        rows.append(("learning curve", args.plot))
    width = max(len(k) for k, _ in rows)
    sys.stderr.flush()
    print(f"\n== torchwire.examples.{args.example}: {title}")
    for k, v in rows:
        print(f"   {k:<{width}}  {v}")
    sys.stdout.flush()


def plot(args, title: str, series: dict, xlabel: str, ylabel: str,
         second: dict | None = None, second_label: str | None = None) -> None:
    """Save the learning curve(s) as a PNG at ``args.plot`` (headless)."""
    if not args.plot:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if second:
        ax2 = ax.twinx()
        for label, (xs, ys) in second.items():
            ax2.plot(xs, ys, "o--", label=label, color="black", markersize=3)
        ax2.set_ylabel(second_label or "")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="best", fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot)
    plt.close(fig)


def first_last(curves: list[list[float]], most: int = 20) -> tuple[int, float, float]:
    """``(k, first, last)``: the mean of the first and of the last ``k`` points over all
    ``curves`` (``k`` a tenth of a curve, at most ``most``) - "from ... to ..." figures."""
    k = max(1, min(most, len(curves[0]) // 10))
    return (k, sum(sum(c[:k]) / k for c in curves) / len(curves),
            sum(sum(c[-k:]) / k for c in curves) / len(curves))


def smooth(ys: list[float], k: int = 10) -> list[float]:
    """Moving average over the last ``k`` points (for noisy per-step losses)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out
