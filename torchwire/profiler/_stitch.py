"""Stitching the workers' Chrome traces into one: a process row per worker, clocks
aligned, flow arrows from each call to its run on the callee.

Each worker's trace is torch.profiler's Chrome export: ``ts`` in microseconds after
its ``baseTimeNanoseconds``.  A worker's wall clock differs from the driver's by the
offset measured over the RPC link (:func:`clock_offset`); every event is moved onto
the driver's clock, then onto the job trace's own zero.

Arrows: a call's range is ``rpc_<mode>#<f>(<caller> -> <callee>)`` on the caller and
its run ``rpc_serve#<f>(<caller> -> <callee>)`` on the callee.  Requests on one link
arrive in the order they were sent, so the k-th call of ``f`` from A to B is matched
with the k-th run of ``f`` from A on B.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

_KEY = re.compile(r"^rpc_(\w+)#(.*)\((.*) -> (.*)\)$")
# the job profile's own calls (_job.py): not part of what was profiled
CONTROL = "torchwire.profiler.control"
_CONTROL = re.compile(rf"^rpc_\w+#{re.escape(CONTROL)}\(")


def clock_offset(samples: list[tuple[int, int, int]]) -> tuple[float, float]:
    """``(offset, round trip)`` in microseconds from ``(t0, remote, t1)`` samples (ns:
    driver before, remote clock, driver after): the sample of the shortest round trip,
    the remote clock minus the driver's at the midpoint."""
    t0, remote, t1 = min(samples, key=lambda s: s[2] - s[0])
    return (remote - (t0 + t1) / 2) / 1000.0, (t1 - t0) / 1000.0


def stitch(traces: list[dict[str, Any]], offsets_us: dict[str, float]) -> dict[str, Any]:
    """One Chrome trace from ``traces`` (``{"name", "rank", "trace"}`` per worker, the
    trace a torch.profiler Chrome export) and each worker's clock offset (µs)."""
    moved = []
    for w in traces:
        mine = []
        base = w["trace"].get("baseTimeNanoseconds", 0) / 1000.0 - offsets_us.get(w["name"], 0.0)
        for e in w["trace"].get("traceEvents", []):
            if "ts" not in e or e.get("ph") not in ("X", "i", "M"):
                continue
            if e.get("ph") == "M" and e.get("name") not in ("thread_name", "thread_sort_index"):
                continue  # the process rows are the workers', named below
            if not isinstance(e.get("pid"), int):
                continue  # kineto's own summary rows
            if _CONTROL.match(e.get("name", "")):
                continue
            e = dict(e, pid=w["rank"], ts=e["ts"] + base)
            moved.append(e)
            mine.append(e)
        _add_sizes(mine, w.get("calls", ()))
    zero = min((e["ts"] for e in moved if e["ph"] != "M"), default=0.0)
    for e in moved:
        e["ts"] = max(0.0, e["ts"] - zero)
    events = [{"ph": "M", "name": "process_name", "pid": w["rank"], "tid": 0, "ts": 0,
               "args": {"name": w["name"]}} for w in traces]
    events += [{"ph": "M", "name": "process_sort_index", "pid": w["rank"], "tid": 0, "ts": 0,
                "args": {"sort_index": w["rank"]}} for w in traces]
    events += moved
    events += flows(moved)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"torchwire": "job trace",
                          "clock_offsets_us": offsets_us,
                          "workers": [w["name"] for w in traces]}}


def _add_sizes(events: list[dict[str, Any]],
               calls: Iterable[tuple[str, int, int | None]]) -> None:
    """Put each call's sizes on its range (``args``): the k-th range of a key on this
    worker is the k-th call of that key it started."""
    sizes: defaultdict[str, list[tuple[int, int | None]]] = defaultdict(list)
    for key, out, back in calls:
        sizes[key].append((out, back))
    seen: defaultdict[str, int] = defaultdict(int)
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("name") in sizes),
                    key=lambda e: e["ts"]):
        k = seen[e["name"]]
        seen[e["name"]] += 1
        if k < len(sizes[e["name"]]):
            out, back = sizes[e["name"]][k]
            e["args"] = dict(e.get("args") or {}, bytes_sent=out, bytes_received=back)


def flows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flow arrows (``ph`` s/f) from each call's range to its run on the callee."""
    calls: defaultdict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    runs: defaultdict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        m = _KEY.match(e.get("name", ""))
        if m is None:
            continue
        mode, func, caller, callee = m.groups()
        if "#remote_op: " in func:
            continue
        (runs if mode == "serve" else calls)[(func, caller, callee)].append(e)
    out = []
    n = 0
    for key, sent in calls.items():
        served = sorted(runs.get(key, ()), key=lambda e: e["ts"])
        for call, run in zip(sorted(sent, key=lambda e: e["ts"]), served):
            n += 1
            out.append({"ph": "s", "id": n, "cat": "rpc", "name": "rpc", "pid": call["pid"],
                        "tid": call["tid"], "ts": call["ts"]})
            out.append({"ph": "f", "bp": "e", "id": n, "cat": "rpc", "name": "rpc",
                        "pid": run["pid"], "tid": run["tid"], "ts": run["ts"]})
    return out


def write(trace: dict[str, Any], path: str) -> None:
    """Write ``trace`` as JSON, gzipped when ``path`` ends in ``.gz``."""
    data = json.dumps(trace).encode()
    if path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
