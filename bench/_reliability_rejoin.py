"""``./run reliability --rejoin``: the parameter server example with a trainer killed
by SIGKILL, restarted and rejoined; how long until the job's throughput is back.

Each run: ``python -m torchwire.examples.parameter_server --world-size 4 --steps
15000 --chaos 5000`` (3 trainers; a SIGKILL at steps 5000 and 10000: a fresh
interpreter needs seconds to come back, thousands of steps), started two ways:

* ``fork``: the example's own launcher restarts the rank by forking a process that
  has torch imported already (the restart costs only ``init_rpc``'s rejoin);
* ``launch``: ``python -m torchwire.launch --nproc-per-node 4``, which starts a
  fresh interpreter (Python, torch and the example's imports come first).

Figures per kill, from the ps's log of its steps (``examples/_chaos.recovery``):
the seconds from the SIGKILL until the job's throughput (trainer gradients per
second) is back to 90 % of its level over the 50 steps before the kill, over 20
steps with every trainer in; the trainer-steps lost meanwhile; and the seconds
until the new process enrolled.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _reliability_report as R

STEPS, EVERY = 15000, 5000
EXAMPLE = ["-m", "torchwire.examples.parameter_server", "--world-size", "4", "--steps",
           str(STEPS), "--chaos", str(EVERY), "--no-progress", "--plot", ""]
LAUNCHERS = {
    "fork": [],
    "launch": ["-m", "torchwire.launch", "--nproc-per-node", "4", "--max-restarts", "3"],
}


def _one(how: str, repo: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        if how == "fork":
            cmd = [sys.executable] + EXAMPLE + ["--results", results]
        else:
            cmd = [sys.executable] + LAUNCHERS[how] + EXAMPLE + ["--results", results]
            cmd[cmd.index("--world-size"):cmd.index("--world-size") + 2] = []
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
        if out.returncode != 0:
            raise RuntimeError(f"{how}: exit {out.returncode}: {out.stderr[-2000:]}")
        with open(results) as f:
            return json.load(f)


def _secs(xs) -> str:
    return ", ".join("n/a" if x is None else f"{x:.2f}" for x in xs)


def _median(xs, fmt: str = ".2f") -> str:
    xs = [x for x in xs if x is not None]
    return format(statistics.median(xs), fmt) if xs else "n/a"


def run_rejoin(args, log, repo: str) -> int:
    t0 = time.monotonic()
    runs: dict[str, list[dict]] = {how: [] for how in LAUNCHERS}
    for i in range(args.runs):
        for how in LAUNCHERS:
            t = time.monotonic()
            fig = _one(how, repo)
            runs[how].append(fig)
            log(f"run {i + 1}/{args.runs} {how:6s} recovery {_secs(fig['recovery_s'])} s, "
                f"lost {fig['trainer_steps_lost']} trainer-steps, accuracy "
                f"{fig['accuracy'] * 100:.1f} % ({time.monotonic() - t:.0f} s)")
    calm = [_one_calm(repo) for _ in range(min(args.runs, 3))]
    lines = [R.REJOIN_BEGIN, "## Training through crashes (torchwire)", "",
             f"- Checkout: torchwire {R.checkout(repo)}; "
             f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- Machine: {R.machine()}",
             f"- Command: `./run reliability --rejoin --runs {args.runs}` (wall time "
             f"{time.monotonic() - t0:.0f} s)",
             "- Job: `python -m torchwire.examples.parameter_server --world-size 4 "
             f"--steps {STEPS} --chaos {EVERY}`: a parameter server and 3 trainers; every "
             f"{EVERY} steps the server kills a random trainer with SIGKILL (2 kills a run); "
             "the launcher restarts it, it "
             "rejoins under its name, enrolls and trains on from the server's parameters "
             "(`bench/_reliability_rejoin.py`).",
             "- Recovery: seconds from the SIGKILL until the job's throughput (trainer "
             "gradients per second) is back to 90 % of its level over the 50 steps before "
             "the kill, over 20 steps with every trainer in. Trainer-steps lost: gradients "
             "missing from the steps in between (the server keeps stepping with the others).",
             "",
             "| restarted by | recovery, median of all kills (s) | median of each run (s) "
             "| back in the job, median (s) | trainer-steps lost per kill, median "
             "| accuracy, median |",
             "|---|---|---|---|---|---|"]
    titles = {"fork": "the example's launcher (fork: torch already imported)",
              "launch": "`python -m torchwire.launch` (a fresh interpreter)"}
    for how, figs in runs.items():
        rec = [r for f in figs for r in f["recovery_s"]]
        lines.append(
            f"| {titles[how]} | {_median(rec)} | "
            + ", ".join(_median(f["recovery_s"]) for f in figs)
            + f" | {_median([s for f in figs for s in f['seconds_lost']])} | "
            f"{_median([n for f in figs for n in f['trainer_steps_lost']], 'g')} | "
            f"{statistics.median(f['accuracy'] for f in figs) * 100:.1f} % |")
        missing = sum(r is None for r in rec)
        if missing:
            lines.append(f"| | ({missing} of {len(rec)} kills not back before the next "
                         "kill or the end: left out) | | | | |")
    lines += ["", f"Without chaos (same job, {len(calm)} runs): accuracy median "
              f"{statistics.median(calm) * 100:.1f} %. Back in the job: seconds from the "
              "SIGKILL until the new process enrolled; with a fresh interpreter most of it "
              "is the interpreter's start (Python, torch, the example's imports), the "
              "rejoin itself is the fork row's.", R.REJOIN_END, ""]
    section = "\n".join(lines)
    print(section)
    if args.out:
        R.write(args.out, rejoin=section)
        log(f"wrote {args.out}")
    return 0


def _one_calm(repo: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        cmd = [sys.executable] + EXAMPLE + ["--results", results]
        cmd[cmd.index("--chaos"):cmd.index("--chaos") + 2] = []  # the same job, calm
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
        if out.returncode != 0:
            raise RuntimeError(f"calm run: exit {out.returncode}: {out.stderr[-2000:]}")
        with open(results) as f:
            return json.load(f)["accuracy"]
