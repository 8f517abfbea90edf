#!/usr/bin/env python
"""Fault scenarios run N times on torch.distributed.rpc and torchwire.rpc, judged
against written thresholds; RELIABILITY.md regenerated with the pass counts.

Usage (``./run reliability`` runs this with the repository's .venv):

    python bench/reliability.py [--runs 5] [--only kill9,sigstop] [--libs torch,torchwire]
                                [--out RELIABILITY.md]
    python bench/reliability.py --soak [--calls 1000000] [--cycles 100000]
                                [--fuzz-examples 100000]
    python bench/reliability.py --rejoin [--runs 5]

Scenarios: kill9, sigstop, netcut, strangers, slowreader (thresholds in
``_reliability_faults.SCENARIOS``, printed in the report).  For each run and each
scenario the libraries take turns (torch first in odd runs).  Each run is a fresh
job of workers started with multiprocessing ``spawn``; every step a worker runs is
capped, and every process left is killed at the end of its run, so nothing hangs
this script.  ``--soak`` runs the soak (1 M calls, 100 k RRef cycles, 3 workers,
torchwire) and the decoder fuzzing instead, and rewrites only RELIABILITY.md's soak
section.  ``--rejoin`` measures the recovery of the parameter server example's
throughput after a trainer's SIGKILL, restart and rejoin (torchwire; median of
``--runs``), and rewrites only that section.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
for _p in (BENCH_DIR, REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _reliability_report as R  # noqa: E402
from _reliability_faults import RUNNERS, SCENARIOS  # noqa: E402
from _reliability_job import netns_unavailable  # noqa: E402
from _reliability_strangers import check_pickle_runs  # noqa: E402


def run_faults(args, log) -> int:
    libs = [x for x in args.libs.split(",") if x]
    names = [x for x in args.only.split(",") if x] if args.only else list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            sys.exit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    for lib in libs:
        if lib not in R.TITLES:
            sys.exit(f"unknown library {lib!r}")
    started = _dt.datetime.now().astimezone()
    t0 = time.monotonic()
    head = R.checkout(REPO_ROOT)
    skip = netns_unavailable() if "netcut" in names else None
    if skip:
        log(f"netcut will be skipped: {skip}")
    results: dict = {name: {lib: [] for lib in libs} for name in names}
    for i in range(args.runs):
        order = libs if i % 2 == 0 else libs[::-1]
        for name in names:
            for lib in order:
                t = time.monotonic()
                try:
                    run = RUNNERS[name](lib, skip)
                except Exception as exc:  # the harness itself: reported, not fatal
                    run = {"checks": [{"name": "harness", "ok": False,
                                       "fig": f"{type(exc).__name__}: {exc}"}], "errors": []}
                run["s"] = time.monotonic() - t
                results[name][lib].append(run)
                fails = [c["name"] for c in run["checks"] if not c["ok"]]
                log(f"run {i + 1}/{args.runs} {name:10s} {lib:9s} "
                    f"{'skipped' if run.get('skipped') else 'PASS' if not fails else 'FAIL'}"
                    f" ({run['s']:.0f} s){': ' + '; '.join(fails) if fails else ''}")
    meta = {"checkout": head, "date": f"{started:%Y-%m-%d %H:%M %Z}", "machine": R.machine(),
            "command": ("./run reliability " + " ".join(args.argv)).strip(),
            "wall": time.monotonic() - t0,
            "runs": args.runs, "guard": check_pickle_runs()}
    section = R.faults_section(results, SCENARIOS, libs, meta)
    print(section)
    if args.out:
        R.write(args.out, faults=section)
        log(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per scenario per library")
    ap.add_argument("--only", default="", help="comma-separated scenarios: "
                    + ",".join(SCENARIOS))
    ap.add_argument("--libs", default="torch,torchwire")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "RELIABILITY.md"),
                    help="the report to (re)write; '' to only print")
    ap.add_argument("--soak", action="store_true",
                    help="the soak and the fuzzing instead of the fault scenarios")
    ap.add_argument("--rejoin", action="store_true",
                    help="a trainer killed, restarted and rejoined: the recovery time")
    ap.add_argument("--calls", type=int, default=1_000_000, help="--soak: small calls")
    ap.add_argument("--cycles", type=int, default=100_000, help="--soak: RRef cycles")
    ap.add_argument("--fuzz-examples", type=int, default=100_000,
                    help="--soak: hypothesis examples per fuzz property")
    args = ap.parse_args(argv)
    args.argv = argv
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    t0 = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.rejoin:
        from _reliability_rejoin import run_rejoin

        return run_rejoin(args, log, REPO_ROOT)
    if args.soak:
        from _reliability_soak import run_soak_and_fuzz

        return run_soak_and_fuzz(args, log, REPO_ROOT)
    return run_faults(args, log)


if __name__ == "__main__":
    sys.exit(main())
