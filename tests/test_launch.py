"""``python -m torchwire.launch`` restarts a crashed worker, which rejoins the running job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchwire.launch import Supervisor, describe_exit

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).parent / "data" / "launch_rejoin.py"


def _launch(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchwire.launch", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_killed_workers_are_restarted_and_rejoin_while_the_others_run_on():
    # rank 1 dies first, then rank 0: the store lives in the launcher, not in rank 0
    out = _launch("--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT),
                  "--kill-rank-0")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"rank {rank} (pid" in out.stderr
    assert out.stderr.count("killed by SIGKILL; restarting it (restart 1 of 1)") == 2
    # each rank's process that lived through the other's restart reached both of its
    # processes: the dead one and its successor
    lines = out.stdout.splitlines()
    first0 = next(x for x in lines if x.startswith("rank 0 (restart 0) reached worker1"))
    second1 = next(x for x in lines if x.startswith("rank 1 (restart 1) reached worker0"))
    assert first0.count(",") == 1 and second1.count(",") == 1, lines
    assert any(x.startswith("rank 0 (restart 1) reached worker1") for x in lines), lines


def test_the_launcher_gives_up_after_the_restart_limit_and_stops_the_others(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(60)\n")
    out = _launch("--nproc-per-node", "2", "--max-restarts", "2", "--grace", "1", str(script))
    assert out.returncode == 1
    assert out.stderr.count("exit status 3; restarting it") == 2
    assert "giving up: rank 1" in out.stderr and "--max-restarts 2" in out.stderr


class _Fake:
    def __init__(self, codes):
        self.codes = list(codes)
        self.pid = 1000 + len(self.codes)
        self.terminated = False

    def poll(self):
        return self.codes.pop(0) if self.codes else None

    def terminate(self):
        self.terminated = True

    def kill(self):
        pass


def test_supervisor_restarts_only_the_rank_that_failed():
    started = []

    def start(rank, restart):
        started.append((rank, restart))
        return _Fake([-9] if (rank, restart) == (1, 0) else [0])

    lines = []
    sup = Supervisor(start, 3, max_restarts=1, report=lines.append)
    assert sup.run(timeout=10) == 0
    assert started == [(0, 0), (1, 0), (2, 0), (1, 1)]
    assert sup.restarts == [0, 1, 0] and len(lines) == 1 and "killed by SIGKILL" in lines[0]
    assert describe_exit(2) == "exit status 2" and "restarts=1/1" in repr(sup)


def test_the_launcher_sets_omp_num_threads_to_1_as_torchrun_unless_it_is_set(tmp_path):
    import os
    script = tmp_path / "threads.py"
    # one write per worker: the two share the launcher's stdout
    script.write_text("import os\n"
                      "line = f\"rank {os.environ['RANK']} OMP "
                      "{os.environ.get('OMP_NUM_THREADS')}\\n\"\n"
                      "os.write(1, line.encode())\n")

    def launch(nprocs: int, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        return subprocess.run([sys.executable, "-m", "torchwire.launch", "--nproc-per-node",
                               str(nprocs), str(script)], capture_output=True, text=True,
                              timeout=60, env=dict(base, **env))

    two = launch(2)
    assert two.returncode == 0, two.stderr
    assert sorted(two.stdout.splitlines()) == ["rank 0 OMP 1", "rank 1 OMP 1"]
    assert "setting OMP_NUM_THREADS=1" in two.stderr
    mine = launch(2, OMP_NUM_THREADS="3")
    assert sorted(mine.stdout.splitlines()) == ["rank 0 OMP 3", "rank 1 OMP 3"]
    assert "OMP_NUM_THREADS" not in mine.stderr
    one = launch(1)
    assert one.stdout.strip() == "rank 0 OMP None" and "OMP_NUM_THREADS" not in one.stderr
