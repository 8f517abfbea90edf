"""The fault scenarios of ``bench/reliability.py`` (parent side): each ``run_*`` runs
one job for one library and returns ``{"checks": [...], "errors": [...]}``.

The thresholds are written once, in :data:`SCENARIOS` (the report prints them), and
judged in the runner below each one.
"""

from __future__ import annotations

import math
import random
import signal
import time

from _reliability_job import (CAP, SLACK, Hosts, Job, answers_within, check, combine,
                              fails_within, rss_kib, setup_failed, shutdown_check)
from _reliability_strangers import STRANGERS, run_strangers

PENDING_TIMEOUT = 5.0
EARLY = 0.1  # a call that says it timed out must not fail this much before its deadline
BIG = {"big_calls": 20, "big_every": 0.5, "big_timeout": 3.0, "big_mib": 64}
BIG_IN_FLIGHT_MIB = math.ceil(BIG["big_timeout"] / BIG["big_every"]) * BIG["big_mib"]
RSS_BOUND_MIB = 2 * BIG_IN_FLIGHT_MIB

SCENARIOS = {
    "kill9": {
        "title": "kill -9 of a worker during calls",
        "setup": "3 workers; worker0 holds 20 `rpc_async(nap(30 s), "
                 f"timeout={PENDING_TIMEOUT:.0f})` to worker2 and an RRef worker2 owns, "
                 "worker1 holds 5 such calls; then worker2 gets SIGKILL.",
        "thresholds": [
            f"every pending call fails within its timeout + {SLACK} s "
            f"(≤ {PENDING_TIMEOUT + SLACK:.1f} s after it was made)",
            "a new `rpc_sync` to the dead worker fails within 1 s (worker0 and worker1)",
            "`to_here()` of the RRef the dead worker owned fails within 1 s",
            "the survivors call each other: answers within 1 s",
            f"the survivors' graceful `shutdown()` ends within {CAP['shutdown']:.0f} s",
        ],
    },
    "sigstop": {
        "title": "SIGSTOP of a worker, then SIGCONT",
        "setup": "3 workers; worker0 has called worker2 before, worker1 never has; worker2 "
                 "gets SIGSTOP; both call it with `timeout=2`; then SIGCONT and both call it "
                 "again with `timeout=5`.",
        "thresholds": [
            f"worker1's first call (no connection to worker2 yet) fails within 2 + {SLACK} s",
            f"worker0's call on its existing connection fails within 2 + {SLACK} s",
            "the bystanders call each other during the freeze: answers within 1 s",
            "after SIGCONT the next call (timeout=5, no retry) succeeds, from both",
            f"graceful `shutdown()` of all three ends within {CAP['shutdown']:.0f} s",
        ],
    },
    "netcut": {
        "title": "cut link between network namespaces, then restored",
        "setup": "3 workers, each in a network namespace of its own bridged in a hub "
                 "namespace (as `tests/test_netfaults.py`), rendezvous `tcp://` on worker0; "
                 "all links used; worker2's veth is set down in the hub, later up again. "
                 "torch: `_transports=[\"uv\"]` (TCP) and `TP_SOCKET_IFNAME`/`GLOO_SOCKET_IFNAME`; "
                 "torchwire: "
                 "nothing (its listen address is the route to the store).",
        "thresholds": [
            f"a call with `timeout=3` across the cut fails within 3 + {SLACK} s "
            "(worker0 and worker1 to worker2, worker2 to worker0)",
            "the bystanders (worker0, worker1) call each other during the cut: within 1 s",
            "after the restore the next call (timeout=5, no retry loop) succeeds, all three",
            f"graceful `shutdown()` of all three ends within {CAP['shutdown']:.0f} s",
        ],
    },
    "strangers": STRANGERS,
    "slowreader": {
        "title": "full socket: slow reader (SIGSTOP) sent large tensors",
        "setup": f"3 workers; worker0 has links to worker1 and worker2; worker1 gets SIGSTOP; "
                 f"worker0 makes {BIG['big_calls']} `rpc_async` calls to it, one every "
                 f"{BIG['big_every']} s, each with a fresh {BIG['big_mib']} MiB tensor and "
                 f"`timeout={BIG['big_timeout']:.0f}` (the caller keeps no reference), "
                 "and calls worker2 once a second meanwhile. This script samples worker0's "
                 "RSS every 50 ms. Then SIGCONT.",
        "thresholds": [
            f"every large call fails by its deadline: at most {BIG['big_timeout'] + SLACK:.1f} s "
            "after it was made (time spent in `rpc_async` included, which may wait for room "
            "until the call's deadline: backpressure), and a timeout error no earlier than "
            f"{BIG['big_timeout'] - EARLY:.1f} s (a worker declared unavailable, by a "
            "heartbeat, may fail its calls at once)",
            f"worker0's RSS grows by < {RSS_BOUND_MIB} MiB: 2× the data of the calls still "
            f"within their deadline ({BIG_IN_FLIGHT_MIB} MiB); "
            f"{BIG['big_calls'] * BIG['big_mib']} MiB are sent in all",
            "every small call to worker2 during the stall answers within 1 s",
            f"graceful `shutdown()` of all three ends within {CAP['shutdown']:.0f} s",
        ],
    },
}


def run_kill9(lib: str, skip_note) -> dict:
    job = Job(lib, "kill9", 3, {"pending_timeout": PENDING_TIMEOUT})
    try:
        if not job.all(range(3), "armed", 60):
            return setup_failed(job)
        time.sleep(0.3)  # the calls reach worker2
        t_kill = time.monotonic()
        job.signal(2, signal.SIGKILL)
        job.phase(1)
        wait = PENDING_TIMEOUT + 4 * CAP["call"] + 10
        parts = []
        for rank in (0, 1):
            recs = job.get(rank, "pending", wait)
            if recs is None:
                parts.append((f"w{rank}", False, "no report"))
                continue
            late = [r for r in recs if "t1" not in r or r["error"] is None
                    or r["t1"] - r["t0"] > PENDING_TIMEOUT + SLACK]
            done = [r["t1"] for r in recs if "t1" in r]
            errs = [r["error"] for r in recs if r.get("error")]
            fig = f"{len(errs)}/{len(recs)} failed"
            if done:
                fig += f", last {max(done) - t_kill:.2f} s after the kill"
            parts.append((f"w{rank}", not late, fig, errs[0] if errs else None))
        checks = [combine("pending calls fail", parts)]
        checks.append(combine("new call to the dead worker fails within 1 s", [
            fails_within(f"w{r}", job.get(r, "new_call", wait), 1.0) for r in (0, 1)]))
        checks.append(combine("`to_here()` of its RRef fails within 1 s", [
            fails_within("w0", job.get(0, "rref", wait), 1.0)]))
        checks.append(combine("survivors call each other within 1 s", [
            answers_within(f"w{r}", job.get(r, "bystander", wait), 1.0) for r in (0, 1)]))
        checks.append(shutdown_check(job, (0, 1), wait + CAP["shutdown"]))
        return {"checks": checks, "errors": job.errors()}
    finally:
        job.close()


def run_sigstop(lib: str, skip_note) -> dict:
    job = Job(lib, "sigstop", 3, {})
    try:
        if not job.all(range(3), "armed", 60):
            return setup_failed(job)
        time.sleep(0.3)  # worker2's queue writer is idle before it is frozen
        job.freeze(2)
        t_stop = time.monotonic()
        job.phase(1)
        wait = CAP["slow"] + CAP["call"] + 10
        job.all((0, 1), "stalled_done", wait)
        job.signal(2, signal.SIGCONT)
        frozen = time.monotonic() - t_stop
        job.phase(2)
        checks = [
            combine(f"first call while frozen fails within {2 + SLACK} s",
                    [fails_within("w1", job.get(1, "first_call", 1), 2 + SLACK)]),
            combine(f"call on an existing connection fails within {2 + SLACK} s",
                    [fails_within("w0", job.get(0, "existing_call", 1), 2 + SLACK)]),
            combine("bystanders call each other within 1 s", [
                answers_within(f"w{r}", job.get(r, "bystander", 1), 1.0) for r in (0, 1)]),
            combine(f"after SIGCONT (frozen {frozen:.1f} s) the next call succeeds", [
                answers_within(f"w{r}", job.get(r, "after", CAP["call"] + 5), 5.0)
                for r in (0, 1)]),
            shutdown_check(job, (0, 1, 2), CAP["shutdown"] + 10),
        ]
        return {"checks": checks, "errors": job.errors()}
    finally:
        job.close()


def run_netcut(lib: str, skip_note) -> dict:
    if skip_note:
        return {"skipped": skip_note, "checks": [], "errors": []}
    hosts = Hosts(3)
    job = None
    try:
        port = random.randint(20000, 60000)  # a fresh namespace: every port is free
        job = Job(lib, "netcut", 3, {"netns": hosts.paths},
                  init_method=f"tcp://{hosts.addrs[0]}:{port}")
        if not job.all(range(3), "armed", 60):
            return setup_failed(job)
        hosts.cut(2)
        t_cut = time.monotonic()
        job.phase(1)
        job.all(range(3), "cut_done", CAP["slow"] + CAP["call"] + 10)
        hosts.restore(2)
        cut_for = time.monotonic() - t_cut
        job.phase(2)
        checks = [
            combine(f"call across the cut fails within {3 + SLACK} s", [
                fails_within(f"w{r}→w{2 if r != 2 else 0}", job.get(r, "cut_call", 1),
                             3 + SLACK) for r in range(3)]),
            combine("bystanders call each other within 1 s", [
                answers_within(f"w{r}", job.get(r, "bystander", 1), 1.0) for r in (0, 1)]),
            combine(f"after the restore (cut {cut_for:.1f} s) the next call succeeds", [
                answers_within(f"w{r}→w{2 if r != 2 else 0}",
                               job.get(r, "after", CAP["call"] + 5), 5.0) for r in range(3)]),
            shutdown_check(job, (0, 1, 2), CAP["shutdown"] + 10),
        ]
        return {"checks": checks, "errors": job.errors()}
    finally:
        if job is not None:
            job.close()
        hosts.close()


def run_slowreader(lib: str, skip_note) -> dict:
    job = Job(lib, "slowreader", 3, dict(BIG))
    try:
        if not job.all(range(3), "armed", 60):
            return setup_failed(job)
        time.sleep(0.3)
        job.freeze(1)
        pid = job.pid(0)
        rss0 = rss_kib(pid) or 0
        peak = rss0
        job.phase(1)
        # rpc_async may wait for room until its call's deadline (backpressure)
        deadline = (time.monotonic() + BIG["big_calls"] * (BIG["big_every"] + BIG["big_timeout"])
                    + 3 * CAP["call"] + 20)
        stall = None
        while time.monotonic() < deadline:
            peak = max(peak, rss_kib(pid) or 0)
            stall = job.get(0, "stall", 0.05)
            if stall is not None or (0, "error") in job.results or (0, "end") in job.results:
                break
        job.signal(1, signal.SIGCONT)
        job.phase(2)
        growth = (peak - rss0) / 1024
        if stall is None:
            checks = [check("the caller reports", False, "no report from worker0")]
        else:
            calls = stall["calls"]
            n = BIG["big_calls"]
            tmo = BIG["big_timeout"]
            bad = [c for c in calls if "t1" not in c or c.get("error") is None
                   or c["t1"] - c["t0"] > tmo + SLACK or _early_timeout(c, tmo)]
            lat = [c["t1"] - c["t0"] for c in calls if "t1" in c]
            fig = f"{sum(1 for c in calls if c.get('error'))}/{n} failed"
            if lat:
                fig += f", {min(lat):.2f}–{max(lat):.2f} s after the call"
                early = sum(1 for c in calls if _early_timeout(c, tmo))
                if early:
                    fig += f" ({early} timeout(s) **before** the deadline)"
                lost = sum(1 for c in calls if "t1" in c and "Unavailable" in (c.get("error") or "")
                           and c["t1"] - c["t0"] < tmo - EARLY)
                if lost:
                    fig += f" ({lost} failed early: the peer was declared unavailable)"
            fig += f"; `rpc_async` returned in ≤ {max([c['issue_s'] for c in calls] or [0]):.2f} s"
            if stall["send"]["status"] == "hang":
                fig += "; **the sending loop hangs**"
            errs = [c["error"] for c in calls if c.get("error")]
            if errs:
                fig += f" `{errs[0]}`"
            probes = stall["probes"]
            slow = [p for p in probes if p["status"] != "ok" or p["s"] > 1.0]
            slowest = max((p["s"] for p in probes if "s" in p), default=None)
            pfig = f"{len(probes) - len(slow)}/{len(probes)} within 1 s"
            if slowest is not None:
                pfig += f", slowest {slowest:.2f} s"
            if slow:
                pfig += f" ({'; '.join(_probe_fig(p) for p in slow[:2])})"
            checks = [
                check("large calls fail at their deadline", len(calls) == n and not bad, fig),
                check(f"RSS growth < {RSS_BOUND_MIB} MiB", growth < RSS_BOUND_MIB,
                      f"{rss0 / 1024:.0f} → peak {peak / 1024:.0f} MiB (+{growth:.0f} MiB)"),
                check("small calls to a third worker within 1 s", probes and not slow, pfig),
            ]
        checks.append(shutdown_check(job, (0, 1, 2), CAP["shutdown"] + 10))
        return {"checks": checks, "errors": job.errors()}
    finally:
        job.close()


def _early_timeout(c: dict, tmo: float) -> bool:
    """A call that says it timed out before its timeout had passed."""
    return ("t1" in c and c["t1"] - c["t0"] < tmo - EARLY
            and "Unavailable" not in (c.get("error") or ""))


def _probe_fig(r) -> str:
    _label, _ok, fig, err = answers_within("", r, 1.0)
    return fig + (f" `{err}`" if err else "")


RUNNERS = {"kill9": run_kill9, "sigstop": run_sigstop, "netcut": run_netcut,
           "strangers": run_strangers, "slowreader": run_slowreader}
assert list(RUNNERS) == list(SCENARIOS)
