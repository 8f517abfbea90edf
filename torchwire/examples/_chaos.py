"""The parameter server's chaos mode (``--chaos K``): trainers die and come back.

Every K steps the server kills a random trainer with SIGKILL.  The launcher
(``_common.launch``, or ``python -m torchwire.launch``) starts that rank again; the
new process calls ``init_rpc`` with the trainer's name and rank, which takes it
back into the running job, enrolls with the server and trains on from the
server's current parameters.  Meanwhile a step waits only for the trainers
enrolled now: the server never waits for a dead one.

The server keeps a log of what happened: each kill (step, trainer, pid, time) and
the rejoin that followed (step, seconds lost, steps made without it).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time


@dataclasses.dataclass
class Kill:
    """One trainer killed, and when it came back."""

    trainer: int
    pid: int
    step: int  # the server's step count when it was killed
    at: float  # time.monotonic() of the kill
    back_step: int | None = None  # the step count when its successor enrolled
    back_at: float | None = None

    @property
    def seconds_lost(self) -> float | None:
        return None if self.back_at is None else self.back_at - self.at

    @property
    def steps_without(self) -> int | None:
        """Server steps made without this trainer's gradients."""
        return None if self.back_step is None else self.back_step - self.step


class Chaos:
    """Who is enrolled now, and the kills (see the module docstring).

    Args:
        every: kill a trainer every this many steps (0: never).
        seed: for the choice of the victim.
    """

    def __init__(self, every: int, seed: int) -> None:
        self.every = every
        self.rng = random.Random(seed)
        self.members: dict[int, int] = {}  # trainer index -> pid of its live process
        self.kills: list[Kill] = []

    def __repr__(self) -> str:
        return f"<Chaos every={self.every} members={sorted(self.members)} kills={len(self.kills)}>"

    def enroll(self, trainer: int, pid: int, step: int) -> None:
        """A trainer's process starts (or starts again) taking part in the steps."""
        self.members[trainer] = pid
        for k in self.kills:
            if k.trainer == trainer and k.back_at is None:
                k.back_step, k.back_at = step, time.monotonic()

    def current(self, trainer: int, pid: int) -> bool:
        """Is ``pid`` the live process of ``trainer`` (else: a dead one's late update)?"""
        return self.members.get(trainer) == pid

    def after_step(self, step: int, total: int) -> None:
        """Every ``every`` steps (before the last), kill a random enrolled trainer."""
        if not self.every or step % self.every or step >= total or not self.members:
            return
        victim = self.rng.choice(sorted(self.members))
        pid = self.members.pop(victim)
        self.kills.append(Kill(victim, pid, step, time.monotonic()))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died by itself meanwhile: its successor enrolls all the same

    def rows(self) -> list[tuple[str, str]]:
        """The summary's lines: each kill and rejoin, with the seconds lost."""
        rows = []
        for i, k in enumerate(self.kills, 1):
            back = (f"rejoined at step {k.back_step} after {k.seconds_lost:.1f} s "
                    f"({k.steps_without} steps without it)" if k.back_at is not None
                    else "did not rejoin")
            rows.append((f"kill {i}", f"step {k.step}: trainer{k.trainer} (pid {k.pid}) "
                                      f"SIGKILL; {back}"))
        return rows

    def figures(self, log: list[tuple[float, int]], trainers: int, start: int = 0) -> dict:
        """The run's figures; ``log``: per server step after step ``start`` (a restarted
        server's snapshot), (time, trainers whose gradients it had), for the recovery of
        throughput after each kill (:func:`recovery`)."""
        ends = [k.step - start for k in self.kills[1:]] + [len(log)]
        rec = [recovery(k, log[:end], trainers, start) for k, end in zip(self.kills, ends)]
        return {"kills": len(self.kills),
                "rejoins": sum(k.back_at is not None for k in self.kills),
                "seconds_lost": [k.seconds_lost for k in self.kills],
                "steps_without": [k.steps_without for k in self.kills],
                "recovery_s": [r[0] for r in rec],
                "trainer_steps_lost": [r[1] for r in rec]}


BASELINE_STEPS = 50  # steps before a kill whose throughput is "its level before"
WINDOW_STEPS = 20  # steps after which throughput counts as back (at least 90 %)


def recovery(kill: Kill, log: list[tuple[float, int]], trainers: int, start: int = 0
             ) -> tuple[float | None, int | None]:
    """Seconds from ``kill`` until the job's throughput (trainer gradients per second:
    samples per second over the batch size) is back to 90 % of its level over the
    ``BASELINE_STEPS`` steps before it, over ``WINDOW_STEPS`` steps with every trainer
    in; and the trainer-steps lost meanwhile (gradients missing from those steps).
    (None, None) if the log (up to the next kill) does not show it."""
    k = kill.step - start  # log[k - 1] is the step the kill followed
    if k < BASELINE_STEPS + 1:
        return None, None

    def rate(a: int, b: int) -> float:  # gradients per second over steps a+1..b
        span = log[b - 1][0] - log[a - 1][0]
        return sum(n for _t, n in log[a:b]) / span if span > 0 else float("inf")

    base = rate(k - BASELINE_STEPS, k)
    for j in range(k, len(log) - WINDOW_STEPS):
        if log[j][1] == trainers and rate(j, j + WINDOW_STEPS) >= 0.9 * base:
            lost = sum(trainers - n for _t, n in log[k:j])
            return log[j][0] - kill.at, lost
    return None, None
