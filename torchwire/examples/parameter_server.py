"""A parameter server and several trainers classify handwritten digits.

Rank 0 is the parameter server ``ps``: it holds the model and an SGD optimizer.
Ranks 1.. are trainers, each with its own shard of scikit-learn's digits.  A
step: the trainer computes gradients on its batch with its local copy of the
model and sends them to the ps; the ps sums the gradients of every trainer,
steps once, and answers all of them with the new parameters (a synchronous,
batch-updating parameter server).  ``update_and_fetch`` is an
``@async_execution`` function: a trainer that arrives early waits on a future,
not on a thread of the ps.  The ps measures test accuracy as it goes.

    python -m torchwire.examples.parameter_server               # 3 trainers
    torchrun --nproc-per-node 4 -m torchwire.examples.parameter_server
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchwire.rpc as rpc
from torchwire.examples import _common, _data


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


class ParameterServer:
    """The model, its optimizer, and the gradients of the step in progress."""

    def __init__(self, n_trainers: int, lr: float, x_test, y_test, eval_every: int) -> None:
        self.model = Net()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)
        self.n_trainers = n_trainers
        self.lock = threading.Lock()
        self.arrived = 0
        self.pending = torch.futures.Future()
        self.steps = 0
        self.x_test, self.y_test, self.eval_every = x_test, y_test, eval_every
        self.test_curve: list[tuple[int, float]] = [(0, accuracy(self.model, x_test, y_test))]
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def get_params(self) -> list:
        with self.lock:
            return [p.detach().clone() for p in self.params]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(ps_rref, grads):
        """Add one trainer's gradients; the last to arrive steps for all.

        Returns a future of the new parameters, completed when every trainer's
        gradients of this step are in.
        """
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.params, grads):
                p.grad += g
            self.arrived += 1
            fut = self.pending
            if self.arrived == self.n_trainers:
                for p in self.params:
                    p.grad /= self.n_trainers
                self.opt.step()
                self.opt.zero_grad(set_to_none=False)
                self.steps += 1
                if self.steps % self.eval_every == 0:
                    self.test_curve.append(
                        (self.steps, accuracy(self.model, self.x_test, self.y_test)))
                self.arrived = 0
                self.pending = torch.futures.Future()
                # copies: the reply is pickled later, after the next step may have begun
                fut.set_result([p.detach().clone() for p in self.params])
        return fut


def train(ps_rref, index: int, args, x, y) -> list[float]:
    """A trainer's loop (runs on the trainer, started by the ps). Returns its losses."""
    model = Net()
    with torch.no_grad():
        for p, v in zip(model.parameters(), ps_rref.rpc_sync().get_params()):
            p.copy_(v)
    g = torch.Generator().manual_seed(args.seed * 1000 + index)
    bar = _common.Progress(args, f"trainer{index}", index - 1, args.steps)
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(0, len(y), (args.batch_size,), generator=g)
        model.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        new = rpc.rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch,
                           args=(ps_rref, [p.grad for p in model.parameters()]))
        with torch.no_grad():
            for p, v in zip(model.parameters(), new):
                p.copy_(v)
        losses.append(loss.item())
        bar.update(args.batch_size, loss=losses[-1])
    bar.close()
    return losses


def drive(job: _common.Job) -> None:
    """On rank 0, the ps: runs the job, then prints the summary and saves the plot."""
    args = job.args
    n = job.world_size - 1
    x_train, y_train, x_test, y_test = _data.digits(args.seed)
    ps = ParameterServer(n, args.lr, x_test, y_test, eval_every=max(1, args.steps // 20))
    ps_rref = rpc.RRef(ps)
    t0 = time.perf_counter()
    futs = [rpc.rpc_async(f"trainer{i}", train,
                          args=(ps_rref, i, args, x_train[i - 1::n], y_train[i - 1::n]),
                          timeout=0)
            for i in range(1, n + 1)]
    losses = [f.wait() for f in futs]
    elapsed = time.perf_counter() - t0
    acc = accuracy(ps.model, x_test, y_test)
    if ps.test_curve[-1][0] != ps.steps:
        ps.test_curve.append((ps.steps, acc))
    samples = n * args.steps * args.batch_size
    _common.plot(args, f"parameter server, {n} trainers, digits",
                 {f"trainer{i + 1} loss": (range(1, len(ls) + 1), _common.smooth(ls))
                  for i, ls in enumerate(losses)}, "step", "training loss (smoothed)",
                 {"test accuracy": tuple(zip(*ps.test_curve))}, "test accuracy")
    _common.summary(args, f"{n} trainers, {args.steps} steps each", [
        ("test accuracy", f"{acc * 100:.1f} % on {len(y_test)} held-out digits "
                          f"(before training {ps.test_curve[0][1] * 100:.1f} %)"),
        ("final loss", f"{sum(ls[-1] for ls in losses) / n:.3f} (mean of the trainers' "
                       f"last step; first step {sum(ls[0] for ls in losses) / n:.3f})"),
        ("throughput", f"{samples / elapsed:,.0f} samples/s, {ps.steps / elapsed:.0f} "
                       "steps/s on the ps"),
    ], elapsed, job.world_size,
        {"accuracy": acc, "accuracy_before": ps.test_curve[0][1], "steps": ps.steps})


def worker(job: _common.Job) -> None:
    _common.drive_or_serve(job, drive, "ps", "trainer")


def main(argv=None) -> int:
    p = _common.parser("parameter_server", __doc__, world_size=4, steps=1000, lr=0.05,
                       batch_size=32)
    return _common.launch(worker, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
