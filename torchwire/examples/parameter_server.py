"""A parameter server and several trainers classify handwritten digits.

Rank 0 is the parameter server ``ps``: it holds the model and an SGD optimizer.
Ranks 1.. are trainers, each with its own shard of scikit-learn's digits.  A
step: the trainer computes gradients on its batch with its local copy of the
model and sends them to the ps; the ps sums the gradients of every trainer,
steps once, and answers all of them with the new parameters (a synchronous,
batch-updating parameter server).  ``update_and_fetch`` is an
``@async_execution`` function: a trainer that arrives early waits on a future,
not on a thread of the ps.  The ps measures test accuracy as it goes.

With ``--chaos K`` the ps kills a random trainer with SIGKILL every K steps
(``_chaos.py``); the launcher starts it again, it rejoins the running job under its
name, enrolls and trains on from the ps's current parameters, while the ps keeps
stepping with the trainers it has.  The summary lists each kill and rejoin.  With
``--checkpoint DIR`` the ps snapshots its state every ``--checkpoint-every`` steps
(``_checkpoint.py``); a ps that crashed (``--kill-ps-at STEP`` makes it) restarts,
goes on from its last snapshot, and the trainers wait for it, then go on.

    python -m torchwire.examples.parameter_server               # 3 trainers
    python -m torchwire.examples.parameter_server --chaos 100   # a crash every 100 steps
    torchrun --nproc-per-node 4 -m torchwire.examples.parameter_server
    python -m torchwire.launch --nproc-per-node 4 --max-restarts 20 \
        -m torchwire.examples.parameter_server --chaos 100
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchwire.rpc as rpc
import signal

from torchwire.examples import _checkpoint, _common, _data
from torchwire.examples._chaos import Chaos


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

    def __init__(self, n_trainers: int, lr: float, x_test, y_test, eval_every: int,
                 chaos: Chaos | None = None, total: int = 0) -> None:
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
        # chaos mode: who sent this step's gradients, each trainer's losses, the end
        self.chaos, self.total = chaos, total
        self.arrived_from: set[int] = set()
        self.losses: dict[int, list[float]] = {}
        self.finished = threading.Event()
        self.step_log: list[tuple[float, int]] = []  # (time, trainers in) per step
        # --checkpoint: where and how often to snapshot; --kill-ps-at: when to die
        self.checkpoint, self.checkpoint_every, self.kill_at = None, 0, 0
        self.resumed_from: int | None = None  # the snapshot's step, after a restart

    def snapshot(self) -> dict:
        """Under the lock: what a restarted ps needs to go on (``_checkpoint``)."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "steps": self.steps, "test_curve": list(self.test_curve)}

    def restore(self, state: dict) -> None:
        """Go on from a snapshot (before serving)."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.steps = self.resumed_from = state["steps"]
        self.test_curve = list(state["test_curve"])
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


    # ------------------------------------------------------------ chaos mode

    def enroll(self, trainer: int, pid: int) -> tuple[list, bool]:
        """A trainer's process (a first one, or one restarted after a crash) takes part
        from the step in progress; returns the parameters of now, and whether the job
        is over."""
        with self.lock:
            self.chaos.enroll(trainer, pid, self.steps)
            return [p.detach().clone() for p in self.params], self.steps >= self.total

    def offer(self, trainer: int, pid: int, grads, loss: float) -> torch.futures.Future:
        """One trainer's gradients of this step: a future of (new parameters, over?,
        counted?), completed when every trainer enrolled now has sent its own."""
        with self.lock:
            if self.steps >= self.total or not self.chaos.current(trainer, pid):
                # over, or not enrolled here (a killed process's late update; a
                # restarted ps that does not know the trainer yet): not counted
                done = torch.futures.Future()
                done.set_result(([p.detach().clone() for p in self.params],
                                 self.steps >= self.total, False))
                return done
            for p, g in zip(self.params, grads):
                p.grad += g
            self.arrived_from.add(trainer)
            self.losses.setdefault(trainer, []).append(loss)
            fut = self.pending
            if set(self.chaos.members) <= self.arrived_from:
                self._step_enrolled()
        return fut

    def _step_enrolled(self) -> None:
        """Under the lock: every enrolled trainer's gradients are in: step, answer them,
        then let chaos strike."""
        for p in self.params:
            p.grad /= len(self.arrived_from)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.steps += 1
        self.step_log.append((time.monotonic(), len(self.arrived_from)))
        if self.steps % self.eval_every == 0:
            self.test_curve.append((self.steps, accuracy(self.model, self.x_test, self.y_test)))
        fut, self.pending = self.pending, torch.futures.Future()
        self.arrived_from = set()
        fut.set_result(([p.detach().clone() for p in self.params], self.steps >= self.total,
                        True))
        if self.checkpoint and self.steps % self.checkpoint_every == 0:
            _checkpoint.save(self.checkpoint, self.snapshot())
        if self.kill_at and self.steps == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # --kill-ps-at: the ps crashes
        self.chaos.after_step(self.steps, self.total)
        if self.steps >= self.total:
            self.finished.set()


_SERVER: ParameterServer | None = None  # chaos mode: this process's ps (rank 0)


def _enroll(trainer: int, pid: int):
    return _SERVER.enroll(trainer, pid)


@rpc.functions.async_execution
def _offer(trainer: int, pid: int, grads, loss: float):
    return _SERVER.offer(trainer, pid, grads, loss)


def chaos_trainer(job: _common.Job) -> None:
    """A trainer of chaos mode: it drives its own loop, so that a restarted process
    picks up where the job is (the ps's parameters of now) on its own."""
    args, index, n = job.args, job.rank, job.world_size - 1
    x_train, y_train, _, _ = _data.digits(args.seed)
    x, y = x_train[index - 1::n], y_train[index - 1::n]
    job.init_rpc(f"trainer{index}")  # a restarted process rejoins under its name
    pid = os.getpid()
    model = Net()
    g = torch.Generator().manual_seed(args.seed * 1000 + index + 7919 * job.restart)
    params, done = _enroll_with_ps(index, pid, args.ps_wait)
    while not done:
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
        idx = torch.randint(0, len(y), (args.batch_size,), generator=g)
        model.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        try:
            params, done, counted = rpc.rpc_sync("ps", _offer, args=(
                index, pid, [p.grad for p in model.parameters()], loss.item()))
        except rpc.WorkerUnavailableError:  # the ps died: wait for it to come back
            counted, done = False, False
        if not counted and not done:  # a restarted ps does not know us yet
            params, done = _enroll_with_ps(index, pid, args.ps_wait)
    rpc.shutdown()


def _enroll_with_ps(index: int, pid: int, wait: float) -> tuple[list, bool]:
    """Enroll; while the ps is away (restarting from its snapshot, ``--checkpoint``),
    try again, for ``wait`` seconds at most."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return rpc.rpc_sync("ps", _enroll, args=(index, pid))
        except rpc.WorkerUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def chaos_drive(job: _common.Job) -> None:
    """Rank 0 in chaos mode: the ps, ready before it joins (trainers enroll at once)."""
    global _SERVER
    args = job.args
    n = job.world_size - 1
    _x, _y, x_test, y_test = _data.digits(args.seed)
    ps = _SERVER = ParameterServer(n, args.lr, x_test, y_test,
                                   eval_every=max(1, args.steps // 20),
                                   chaos=Chaos(args.chaos, args.seed), total=args.steps)
    if args.checkpoint:
        ps.checkpoint, ps.checkpoint_every = args.checkpoint, args.checkpoint_every
        state = _checkpoint.load(args.checkpoint) if job.restart else None
        if state is not None:
            ps.restore(state)  # a restarted ps goes on from its last snapshot
    ps.kill_at = args.kill_ps_at if job.restart == 0 else 0
    job.init_rpc("ps")  # a restarted ps rejoins under its name; trainers wait for it
    t0 = time.perf_counter()
    if not ps.finished.wait(args.timeout):
        raise TimeoutError(f"the ps made {ps.steps} of {args.steps} steps in {args.timeout} s")
    elapsed = time.perf_counter() - t0
    deadline = time.monotonic() + 60  # the last one killed may still be on its way back
    while any(k.back_at is None for k in ps.chaos.kills) and time.monotonic() < deadline:
        time.sleep(0.05)
    losses = [ps.losses.get(i, [float("nan")]) for i in range(1, n + 1)]
    _report(args, ps, losses, elapsed, job.world_size, ps.chaos, job.restart)
    rpc.shutdown()


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
    _report(args, ps, losses, elapsed, job.world_size)


def _report(args, ps: ParameterServer, losses: list[list[float]], elapsed: float,
            world_size: int, chaos: Chaos | None = None, ps_restarts: int = 0) -> None:
    """The plot and the summary (chaos: each kill and rejoin too)."""
    n = world_size - 1
    x_test, y_test = ps.x_test, ps.y_test
    acc = accuracy(ps.model, x_test, y_test)
    if ps.test_curve[-1][0] != ps.steps:
        ps.test_curve.append((ps.steps, acc))
    samples = n * args.steps * args.batch_size
    _common.plot(args, f"parameter server, {n} trainers, digits",
                 {f"trainer{i + 1} loss": (range(1, len(ls) + 1), _common.smooth(ls))
                  for i, ls in enumerate(losses)}, "step", "training loss (smoothed)",
                 {"test accuracy": tuple(zip(*ps.test_curve))}, "test accuracy")
    title = f"{n} trainers, {args.steps} steps each"
    rows = [
        ("test accuracy", f"{acc * 100:.1f} % on {len(y_test)} held-out digits "
                          f"(before training {ps.test_curve[0][1] * 100:.1f} %)"),
        ("final loss", f"{sum(ls[-1] for ls in losses) / n:.3f} (mean of the trainers' "
                       f"last step; first step {sum(ls[0] for ls in losses) / n:.3f})"),
        ("throughput", f"{samples / elapsed:,.0f} samples/s, {ps.steps / elapsed:.0f} "
                       "steps/s on the ps"),
    ]
    figures = {"accuracy": acc, "accuracy_before": ps.test_curve[0][1], "steps": ps.steps}
    if chaos is not None:
        if chaos.every:
            title += f", a trainer killed every {chaos.every} steps"
        rows += chaos.rows()
        figures.update(chaos.figures(ps.step_log, n, ps.resumed_from or 0))
        figures.update(ps_restarts=ps_restarts, resumed_from=ps.resumed_from)
        if ps_restarts:
            rows.append(("ps restarted", f"{ps_restarts} time(s); went on from its snapshot "
                                         f"of step {ps.resumed_from}"))
    _common.summary(args, title, rows, elapsed, world_size, figures)


def worker(job: _common.Job) -> None:
    if job.args.chaos or job.args.checkpoint:
        (chaos_drive if job.rank == 0 else chaos_trainer)(job)
        return
    _common.drive_or_serve(job, drive, "ps", "trainer")


def main(argv=None) -> int:
    p = _common.parser("parameter_server", __doc__, world_size=4, steps=1000, lr=0.05,
                       batch_size=32)
    p.add_argument("--chaos", type=int, default=0, metavar="K",
                   help="kill a random trainer with SIGKILL every K steps; it restarts and "
                        "rejoins (default 0: never; one host only)")
    p.add_argument("--checkpoint", default="", metavar="DIR",
                   help="the ps snapshots its state in DIR (atomically); a restarted ps "
                        "goes on from the last snapshot while the trainers wait for it")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                   help="steps between snapshots (default 50)")
    p.add_argument("--kill-ps-at", type=int, default=0, metavar="STEP",
                   help="with --checkpoint: the ps kills itself (SIGKILL) after this step, "
                        "once; it restarts and goes on from its snapshot")
    p.add_argument("--ps-wait", type=float, default=120.0, metavar="S",
                   help="seconds a trainer waits for a restarting ps (default 120)")
    args = p.parse_args(argv)
    if args.chaos < 0 or args.checkpoint_every < 1:
        p.error("--chaos must be >= 0 and --checkpoint-every >= 1")
    if args.kill_ps_at and not args.checkpoint:
        p.error("--kill-ps-at needs --checkpoint (else the ps has nothing to go on from)")
    # each kill costs one restart of some trainer, and a crashed ps one of its own
    args.max_restarts = args.steps // args.chaos + 1 if args.chaos else 0
    if args.checkpoint:
        args.max_restarts = max(args.max_restarts, 1 if args.kill_ps_at else 3)
    if (args.chaos or args.checkpoint) and not _common.under_torchrun() and \
            not _common.missing_extra(args):
        # imported once here, not by every restarted trainer (seconds on a busy host)
        importlib.import_module("sklearn.datasets")
    return _common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
