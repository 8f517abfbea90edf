"""Pipeline parallelism: a model split into stages on several workers, micro-batches overlapped.

An MLP classifying scikit-learn's digits is cut into consecutive stages, one per
worker (ranks 1..; rank 0 drives).  Each step splits the batch into
micro-batches; for each, the driver chains the stages with RRefs
(``stage.remote().forward(x)`` for all but the last, ``rpc_async`` for the
last) and does not wait: while stage 2 works on micro-batch 1, stage 1 already
works on micro-batch 2.  The outputs are gathered with
``torch.futures.wait_all``; ``torchwire.autograd.backward`` and a
``DistributedOptimizer`` train every stage inside one context.

Then the same model runs as one stage on one worker, the whole batch at once,
and the summary compares the two throughputs.

    python -m torchwire.examples.pipeline               # 2 stages
    torchrun --nproc-per-node 3 -m torchwire.examples.pipeline
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from torchwire.examples import _common, _data
from torchwire.optim import DistributedOptimizer


def layers(seed: int, hidden: int, depth: int) -> list[nn.Module]:
    """The whole model's layers, the same on every worker for a seed."""
    torch.manual_seed(seed)
    out: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        out += [nn.Linear(hidden, hidden), nn.ReLU()]
    return out + [nn.Linear(hidden, 10)]


def cut(sizes: list[int], n_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each stage: consecutive layers, about the same number of
    parameters (so of work) in each."""
    total, acc, bounds = sum(sizes), 0, [0]
    for i, size in enumerate(sizes):
        acc += size
        if len(bounds) < n_stages and acc >= total * len(bounds) / n_stages:
            bounds.append(i + 1)
    while len(bounds) < n_stages:  # fewer layers with parameters than stages
        bounds.append(bounds[-1])
    return list(zip(bounds, bounds[1:] + [len(sizes)]))


class Stage(nn.Module):
    """A slice of the model, on one worker.  One micro-batch at a time (the lock):
    the overlap is between stages, each of which has one core to itself."""

    def __init__(self, seed: int, hidden: int, depth: int, start: int, end: int) -> None:
        super().__init__()
        self.seq = nn.Sequential(*layers(seed, hidden, depth)[start:end])
        self.lock = threading.Lock()

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self.lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.parameters()]


class DistPipeline:
    """The driver's view of the stages: forward over micro-batches, parameters."""

    def __init__(self, workers: list[str], args) -> None:
        sizes = [sum(p.numel() for p in m.parameters())
                 for m in layers(args.seed, args.hidden, args.depth)]
        spans = cut(sizes, len(workers))
        self.stages = [rpc.remote(w, Stage, args=(args.seed, args.hidden, args.depth, a, b))
                       for w, (a, b) in zip(workers, spans)]

    def forward(self, x: torch.Tensor, micro_batches: int) -> torch.Tensor:
        out_futures = []
        for chunk in x.chunk(micro_batches):
            ref = rpc.RRef(chunk)
            for stage in self.stages[:-1]:
                ref = stage.remote().forward(ref)  # returns at once
            out_futures.append(self.stages[-1].rpc_async().forward(ref))
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self) -> list:
        return [p for s in self.stages for p in s.rpc_sync().parameter_rrefs()]


def run(pipe: DistPipeline, args, steps: int, micro: int, data, bar_desc: str):
    """Train ``steps`` steps; returns (losses, seconds per step, final test accuracy)."""
    x_train, y_train, x_test, y_test = data
    opt = DistributedOptimizer(torch.optim.Adam, pipe.parameter_rrefs(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    bar = _common.Progress(args, bar_desc, 0, steps)
    losses, times = [], []
    for _ in range(steps):
        idx = torch.randint(0, len(y_train), (args.batch_size,), generator=g)
        t0 = time.perf_counter()
        with dist_autograd.context() as context_id:
            loss = F.cross_entropy(pipe.forward(x_train[idx], micro), y_train[idx])
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        bar.update(args.batch_size, loss=losses[-1])
    bar.close()
    with torch.no_grad():
        acc = (pipe.forward(x_test, micro).argmax(1) == y_test).float().mean().item()
    return losses, times, acc


def drive(job: _common.Job) -> None:
    """On rank 0, the driver: runs the job, then prints the summary and saves the plot."""
    args = job.args
    n = job.world_size - 1
    data = _data.digits(args.seed)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    pipe = DistPipeline([f"stage{i}" for i in range(1, n + 1)], args)
    losses, times, acc = run(pipe, args, args.steps, args.micro_batches, data,
                             f"pipeline ({n} stages x {args.micro_batches} micro-batches)")
    one = DistPipeline(["stage1"], args)
    base_steps = max(1, args.steps // 3)
    base_losses, base_times, _ = run(one, args, base_steps, 1, data, "one stage (baseline)")
    elapsed = time.perf_counter() - t0
    # steady state: leave out the first steps (connections, allocator warm-up)
    skip = min(5, len(times) // 2)
    rate = args.batch_size * (len(times) - skip) / sum(times[skip:])
    skip_b = min(5, len(base_times) // 2)
    base_rate = args.batch_size * (len(base_times) - skip_b) / sum(base_times[skip_b:])
    _common.plot(args, f"pipeline: {n} stages x {args.micro_batches} micro-batches vs one stage",
                 {f"pipeline, {n} stages": (_cumulative(times), _common.smooth(losses)),
                  "one stage": (_cumulative(base_times), _common.smooth(base_losses))},
                 "seconds of training", "training loss (smoothed)")
    k, first, last = _common.first_last([losses], most=10)
    _common.summary(args, f"{n} stages, {args.steps} steps of {args.batch_size}", [
        ("test accuracy", f"{acc * 100:.1f} % on {len(data[3])} held-out digits"),
        ("loss", f"{first:.3f} -> {last:.3f} "
                 f"(mean of first and last {k} steps)"),
        ("throughput", f"{rate:,.0f} samples/s pipelined ({n} stages x "
                       f"{args.micro_batches} micro-batches) vs {base_rate:,.0f} samples/s "
                       f"as one stage: x{rate / base_rate:.2f}"),
        ("cores", f"{os.cpu_count()} for {job.world_size} processes, load average {load:.1f} "
                  "at the start (stages overlap only as far as each has a free core)"),
    ], elapsed, job.world_size,
        {"accuracy": acc, "first_loss": first, "last_loss": last,
         "pipelined_samples_per_s": rate, "one_stage_samples_per_s": base_rate})


def _cumulative(xs: list[float]) -> list[float]:
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


def worker(job: _common.Job) -> None:
    _common.drive_or_serve(job, drive, "driver", "stage")


def main(argv=None) -> int:
    p = _common.parser("pipeline", __doc__, world_size=3, steps=60, lr=0.001, batch_size=512)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per batch (default 4)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=5, help="hidden layers (default 5)")
    return _common.launch(worker, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
