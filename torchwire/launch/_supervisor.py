"""The supervisor: N local workers kept running, each restarted when it exits abnormally.

::

    start every rank (restart 0)
    loop, every POLL seconds, until every rank has exited 0:
        rank r exited 0                       -> done; never restarted
        rank r exited != 0 or by a signal     -> restarts[r] < max_restarts:
                                                   start r again (restarts[r] + 1)
                                                 else: give up (below)
        the launcher is interrupted (SIGINT, SIGTERM) -> give up
    give up: SIGTERM to every rank still running, SIGKILL after `grace` seconds;
             exit status 1

Only the rank that failed restarts: the others keep running, and the restarted
process takes its place in the job again (``init_rpc`` with its rank and name:
a rejoin).  torchrun restarts the whole local group instead (docs).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("torchwire.launch")

POLL = 0.05  # seconds between looks at the workers


class WorkerHandle(Protocol):
    """A started worker process, as the supervisor watches it."""

    @property
    def pid(self) -> int | None:
        """Its process id."""

    def poll(self) -> int | None:
        """None while it runs; then its exit status (negative: killed by that signal)."""

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def describe_exit(code: int) -> str:
    """``"exit status 3"`` or ``"killed by SIGKILL"``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Supervisor:
    """Starts ``nprocs`` workers and restarts any that exits abnormally (module docstring).

    Args:
        start: ``start(rank, restart)`` starts rank ``rank`` for the ``restart``-th
            time (0: its first start) and returns its :class:`WorkerHandle`.
        nprocs: how many ranks.
        max_restarts: how many times each rank may be restarted.
        grace: seconds between SIGTERM and SIGKILL when giving up.
        report: where a line about each exit and restart goes (``print`` by default:
            to stderr).
    """

    def __init__(self, start: Callable[[int, int], WorkerHandle], nprocs: int,
                 max_restarts: int, grace: float = 30.0,
                 report: Callable[[str], None] | None = None) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._start = start
        self.nprocs = nprocs
        self.max_restarts = max_restarts
        self.grace = grace
        self._report = report or _stderr
        self.handles: list[WorkerHandle | None] = [None] * nprocs
        self.restarts = [0] * nprocs
        self.exits: list[tuple[float, int, int]] = []  # (monotonic time, rank, status)
        self._stop: str | None = None

    def __repr__(self) -> str:
        running = sum(h is not None and h.poll() is None for h in self.handles)
        return (f"<Supervisor ranks={self.nprocs} running={running} "
                f"restarts={sum(self.restarts)}/{self.max_restarts} per rank>")

    def stop(self, why: str) -> None:
        """Give up at the next look (a signal handler may call this)."""
        self._stop = why

    def run(self, timeout: float | None = None) -> int:
        """Run the job to its end; returns 0 when every rank finally exited 0, else 1."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank in range(self.nprocs):
            self.handles[rank] = self._start(rank, 0)
        done = [False] * self.nprocs
        while not all(done):
            if self._stop is not None:
                return self._give_up(self._stop)
            if deadline is not None and time.monotonic() > deadline:
                return self._give_up(f"timed out after {timeout:g} s")
            for rank, handle in enumerate(self.handles):
                if done[rank] or handle is None:
                    continue
                code = handle.poll()
                if code is None:
                    continue
                self.exits.append((time.monotonic(), rank, code))
                if code == 0:
                    done[rank] = True
                    continue
                if self.restarts[rank] >= self.max_restarts:
                    return self._give_up(
                        f"rank {rank} (pid {handle.pid}) {describe_exit(code)}, and it was "
                        f"restarted {self.restarts[rank]} time(s) already (--max-restarts "
                        f"{self.max_restarts})")
                self.restarts[rank] += 1
                self._report(f"torchwire.launch: rank {rank} (pid {handle.pid}) "
                             f"{describe_exit(code)}; restarting it (restart "
                             f"{self.restarts[rank]} of {self.max_restarts})")
                self.handles[rank] = self._start(rank, self.restarts[rank])
            time.sleep(POLL)
        return 0

    def _give_up(self, why: str) -> int:
        self._report(f"torchwire.launch: giving up: {why}; stopping the other workers")
        live = [h for h in self.handles if h is not None and h.poll() is None]
        for h in live:
            h.terminate()
        deadline = time.monotonic() + self.grace
        while any(h.poll() is None for h in live) and time.monotonic() < deadline:
            time.sleep(POLL)
        for h in live:
            if h.poll() is None:
                h.kill()
        return 1


def _stderr(line: str) -> None:
    import sys
    print(line, file=sys.stderr, flush=True)
