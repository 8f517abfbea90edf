"""Parent-side plumbing of ``bench/reliability.py``: a job of spawned workers, the
network namespaces of the cut-link scenario, and the judging of timed steps.

A *check* is ``{"name", "ok", "fig"}``: one written threshold and the figure that
was measured against it; a run passes when all its checks do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import _reliability_worker as W  # importable by reference in the spawned children

# Caps (seconds) on the steps a worker runs in a thread: past its cap a step "hangs".
CAP = {"call": 8.0, "slow": 15.0, "shutdown": 15.0, "load": 60.0}
SLACK = 0.5  # a call may fail this long after its deadline


class Job:
    """``world_size`` spawned workers of one scenario run; results by (rank, key)."""

    def __init__(self, lib: str, scenario: str, world_size: int, cfg: dict,
                 init_method: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.board = ctx.RawArray("d", 4)  # [0]: phase; lock-free (see the worker)
        self.queues = [ctx.Queue() for _ in range(world_size)]
        self.store = None
        if init_method is None:
            fd, path = tempfile.mkstemp(prefix="torchwire-rel-")
            os.close(fd)
            os.unlink(path)
            self.store = path
            init_method = f"file://{path}"
        self.results: dict = {}
        cfg = dict(cfg, cap=CAP)
        self.procs = [ctx.Process(target=W.child_main, daemon=True,
                                  args=(lib, r, world_size, init_method, scenario,
                                        self.queues[r], self.board, cfg))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def phase(self, n: int) -> None:
        self.board[0] = n

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def signal(self, rank: int, sig) -> None:
        try:
            os.kill(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass

    def freeze(self, rank: int, timeout: float = 10.0) -> None:
        """SIGSTOP ``rank`` and return once all its threads have stopped (``kill``
        returns before they do: one woken thread stops the others when it runs)."""
        pid = self.procs[rank].pid
        self.signal(rank, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # its parent hears once the whole group stopped
            try:
                if os.waitpid(pid, os.WNOHANG | os.WUNTRACED)[0] == pid:
                    return
            except ChildProcessError:
                return  # gone
            time.sleep(0.005)

    def get(self, rank: int, key: str, timeout: float):
        """The value ``rank`` reported under ``key``, or None after ``timeout`` seconds
        (at once when the worker reported an error or ended)."""
        deadline = time.monotonic() + timeout
        while (rank, key) not in self.results:
            if (rank, "error") in self.results or (rank, "end") in self.results:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                k, v = self.queues[rank].get(timeout=min(left, 0.2))
            except _queue.Empty:
                continue
            self.results[(rank, k)] = v
        return self.results[(rank, key)]

    def all(self, ranks, key: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(self.get(r, key, max(0.0, deadline - time.monotonic())) is not None
                   for r in ranks)

    def errors(self) -> list[str]:
        for r in range(len(self.procs)):  # pick up errors reported meanwhile
            self.get(r, "error", 0)
        return [f"worker{r}: {v}" for (r, k), v in sorted(self.results.items())
                if k == "error"]

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.signal(r, signal.SIGCONT)
                p.join(3)
            if p.is_alive():
                self.signal(r, signal.SIGKILL)
            p.join(5)
        for q in self.queues:
            q.cancel_join_thread()
            q.close()
        if self.store:
            try:
                os.unlink(self.store)
            except OSError:
                pass


def setup_failed(job: Job) -> dict:
    errs = job.errors()
    return {"checks": [check("workers start and connect", False,
                             "; ".join(e.splitlines()[0] for e in errs) or "no report")],
            "errors": errs}


# ---------------------------------------------------------------- judging


def check(name: str, ok: bool, fig: str) -> dict:
    return {"name": name, "ok": bool(ok), "fig": fig}


def combine(name: str, parts) -> dict:
    """One check from per-worker parts ``(label, ok, fig[, error])``; each distinct error
    text is shown once, after the figures."""
    parts = list(parts)
    errs = list(dict.fromkeys(p[3] for p in parts if len(p) > 3 and p[3]))
    fig = "; ".join(f"{p[0]}: {p[2]}" for p in parts)
    if errs:
        fig += " — " + " / ".join(f"`{e}`" for e in errs)
    return check(name, all(p[1] for p in parts), fig)


def step_fig(r) -> str:
    if r is None:
        return "no report"
    if r["status"] == "hang":
        return f"**hangs** (> {r['cap']:.0f} s)"
    if r["status"] == "err":
        return f"fails {r['s']:.2f} s"
    return f"ok {r['s']:.2f} s"


def _err(r):
    return r.get("error") if r else None


def fails_within(label: str, r, limit: float):
    """A call that must fail, within ``limit`` seconds."""
    ok = r is not None and r["status"] == "err" and r["s"] <= limit
    fig = f"**succeeds** {r['s']:.2f} s" if r is not None and r["status"] == "ok" \
        else step_fig(r)
    return (label, ok, fig, _err(r))


def answers_within(label: str, r, limit: float):
    ok = r is not None and r["status"] == "ok" and r["s"] <= limit
    return (label, ok, step_fig(r), _err(r))


def finishes(label: str, r):
    """No hang: the step ended (its own error, if any, is shown) within its cap."""
    return (label, r is not None and r["status"] != "hang", step_fig(r), _err(r))


def shutdown_check(job: Job, ranks, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    return combine(f"graceful `shutdown()` ends within {CAP['shutdown']:.0f} s (no hang)",
                   [finishes(f"w{r}", job.get(r, "shutdown",
                                              max(0.0, deadline - time.monotonic())))
                    for r in ranks])


# ---------------------------------------------------------------- network namespaces


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True,
                          timeout=10)


class Hosts:
    """Namespaces ``<tag>-h0..h2`` bridged in ``<tag>-hub`` (as tests/test_netfaults.py);
    deleted in :meth:`close`.  Cutting a link is ``ip link set down`` on the hub side."""

    def __init__(self, n: int = 3) -> None:
        self.tag = f"twr{uuid.uuid4().hex[:5]}"
        self.subnet = 10 + os.getpid() % 200
        self.hub = f"{self.tag}-hub"
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.addrs = [f"10.214.{self.subnet}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            for ns in [self.hub, *self.names]:
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name",
                    f"e{i}")
                _ip("-n", self.hub, "link", "set", f"e{i}", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", f"e{i}")
                _ip("-n", ns, "link", "set", f"e{i}", "up")
        except BaseException:
            self.close()
            raise

    @property
    def paths(self) -> list[str]:
        return [f"/var/run/netns/{n}" for n in self.names]

    def cut(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    try:
        Hosts(3).close()
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"namespaces with veth and a bridge cannot be created: " \
               f"{(getattr(exc, 'stderr', '') or str(exc)).strip()[:200]}"
    return None


def rss_kib(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None

