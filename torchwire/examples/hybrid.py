"""Hybrid parallelism: a sparse embedding on a parameter server, a dense part replicated with DDP.

The model of torch's "combining DDP with distributed RPC" tutorial, on
scikit-learn's digits read as sparse features: pixel ``i`` with intensity ``v``
(0..16) is token ``17 * i + v``, and an image is the bag of its 64 tokens.

The last rank is the parameter server ``ps``: it holds an ``nn.EmbeddingBag``
of the 1,088 tokens as a ``RemoteModule`` that every trainer shares.  Ranks
0.. are trainers: each runs the dense part (an MLP) wrapped in
``DistributedDataParallel`` over a gloo process group of the trainers only, on
its own shard of the digits.  A step runs inside one distributed autograd
context: the embedding lookup by RPC, the dense part here, ``backward`` reaching
both, and a ``DistributedOptimizer`` stepping both (the embedding on the ps,
the dense part here).

DDP averages the dense gradients over the trainers' process group during
``backward``, in the context, as under torch's distributed autograd; the
summary checks that the replicas ended equal.

    python -m torchwire.examples.hybrid              # 2 trainers + ps
    torchrun --nproc-per-node 3 -m torchwire.examples.hybrid
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from torchwire.examples import _common, _data
from torchwire.nn import RemoteModule
from torchwire.optim import DistributedOptimizer

LEVELS = 17  # digits' pixels are 0..16
N_TOKENS = 64 * LEVELS


def tokens(x: torch.Tensor) -> torch.Tensor:
    """Pixels (scaled 0..1) -> one token per pixel and intensity, ``(batch, 64)``."""
    v = (x * 16).round().long()
    return torch.arange(64) * LEVELS + v


class HybridModel(nn.Module):
    """The remote embedding (shared by all trainers) and the local DDP replica."""

    def __init__(self, emb: RemoteModule, dim: int) -> None:
        super().__init__()
        self.emb = emb
        torch.manual_seed(0)  # DDP broadcasts rank 0's values anyway
        self.dense = DDP(nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 10)))

    def forward(self, x):
        return self.dense(self.emb(tokens(x)))


def run_trainer(emb: RemoteModule, rank: int, n: int, args) -> dict:
    """A trainer's loop (started by the ps; the process group is up already)."""
    x_train, y_train, x_test, y_test = _data.digits(args.seed)
    x, y = x_train[rank::n], y_train[rank::n]
    model = HybridModel(emb, args.dim)
    params = emb.remote_parameters() + [rpc.RRef(p) for p in model.dense.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bar = _common.Progress(args, f"trainer{rank}", rank, args.steps)
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(0, len(y), (args.batch_size,), generator=g)
        with dist_autograd.context() as context_id:
            loss = F.cross_entropy(model(x[idx]), y[idx])
            dist_autograd.backward(context_id, [loss])  # DDP averages the dense part
            opt.step(context_id)
        losses.append(loss.item())
        bar.update(args.batch_size, loss=losses[-1])
    bar.close()
    dist.barrier()  # every trainer's last step is in before anyone evaluates
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        flat = torch.cat([p.reshape(-1) for p in model.dense.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(replicas, flat)
    return {"losses": losses, "accuracy": acc, "n_test": len(y_test),
            "replicas_equal": all(torch.equal(r, flat) for r in replicas)}


def worker(job: _common.Job) -> None:
    args = job.args
    n = job.world_size - 1
    if job.rank != n:
        # the trainers' process group first: once the ps reaches them by RPC, it is up
        dist.init_process_group("gloo", init_method=job.group_init_method, rank=job.rank,
                                world_size=n)
        job.init_rpc(f"trainer{job.rank}")
        rpc.shutdown()
        dist.destroy_process_group()
        return
    job.init_rpc("ps")
    emb = RemoteModule("ps/cpu", nn.EmbeddingBag, args=(N_TOKENS, args.dim),
                       kwargs={"mode": "mean"})
    t0 = time.perf_counter()
    futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(emb, r, n, args), timeout=0)
            for r in range(n)]
    results = [f.wait() for f in futs]
    elapsed = time.perf_counter() - t0
    curves = [r["losses"] for r in results]
    k, first, last = _common.first_last(curves)
    _common.plot(args, f"hybrid: EmbeddingBag on ps (RPC) + dense part on {n} trainers (DDP)",
                 {f"trainer{i}": (range(1, len(c) + 1), _common.smooth(c))
                  for i, c in enumerate(curves)}, "step", "training loss (smoothed)")
    _common.summary(args, f"{n} trainers, {args.steps} steps each", [
        ("test accuracy", f"{results[0]['accuracy'] * 100:.1f} % on {results[0]['n_test']} "
                          "held-out digits"),
        ("loss", f"{first:.3f} -> {last:.3f} (mean of first and last {k} steps)"),
        ("dense replicas", "identical on every trainer" if all(r["replicas_equal"]
                                                               for r in results)
         else "DIFFER between trainers"),
        ("throughput", f"{n * args.steps * args.batch_size / elapsed:,.0f} samples/s"),
    ], elapsed, job.world_size,
        {"accuracy": results[0]["accuracy"], "first_loss": first, "last_loss": last,
         "replicas_equal": all(r["replicas_equal"] for r in results)})
    rpc.shutdown()


def main(argv=None) -> int:
    p = _common.parser("hybrid", __doc__, world_size=3, steps=600, lr=0.2, batch_size=32)
    p.add_argument("--dim", type=int, default=32, help="embedding size (default 32)")
    return _common.launch(worker, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
