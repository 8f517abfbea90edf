"""pytest plumbing for ``./run compat``: aliases, classification, per-class summary."""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import tomllib
from pathlib import Path

# torch's MultiProcessTestCase waits this long for a test's workers (torch's default: 300 s).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")

import pytest  # noqa: E402
import torch  # noqa: E402

# Workers are forked from this process: it must never start torch's intra-op thread pool,
# or a child's first parallel op hangs on the pool state it inherited.
torch.set_num_threads(1)

import _alias  # noqa: E402

# TORCHWIRE_COMPAT_PATCH_ONLY=1: torchwire.patch alone, as a user gets it (no Missing
# placeholders; torch's own TensorPipe fixture): tests/test_compat_quick.py runs so.
PATCH_ONLY = os.environ.get("TORCHWIRE_COMPAT_PATCH_ONLY") == "1"
RESOLVED = _alias.install(placeholders=not PATCH_ONLY)

HERE = Path(__file__).parent
CLASSIFICATION = {cls: dict(tests) for cls, tests in
                  tomllib.loads((HERE / "classification.toml").read_text()).items()}
_MISSING_RE = re.compile(
    r"MissingFeature: (?:in a thread of the test: )?torchwire does not provide ([\w.]+)")


def pytest_addoption(parser):
    parser.addoption("--compat-json", metavar="FILE",
                     help="write every test's outcome (and why it failed) as JSON")


def pytest_report_header(config):
    lines = [f"torch RPC suite against torchwire{' (torchwire.patch alone)' if PATCH_ONLY else ''}"
             "; stand-ins:"]
    lines += [f"  {k} -> {v}" for k, v in sorted(RESOLVED.items())]
    return lines


def _classify(item) -> str | None:
    cls = getattr(item, "cls", None)
    return CLASSIFICATION.get(cls.__name__ if cls else "", {}).get(item.name)


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = _classify(item)
        if kind is None:
            item.add_marker(pytest.mark.compat_unclassified)
        elif kind.startswith("internal"):
            item.add_marker(pytest.mark.skip(reason=kind))
        elif kind.startswith("public, differs"):
            # must fail: a pass would mean torchwire now does what torch does here
            item.add_marker(pytest.mark.xfail(strict=True, reason=kind))


def pytest_runtest_setup(item):
    if item.get_closest_marker("compat_unclassified"):
        pytest.fail("not listed in compat/classification.toml: classify it public or internal",
                    pytrace=False)


class _Results:
    def __init__(self):
        self.outcome: dict[tuple[str, str], str] = {}
        self.why: dict[tuple[str, str], str] = {}
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)

    def record(self, report):
        cls, _, name = report.nodeid.split("::", 1)[-1].partition("::")
        key = (cls, name)
        self.seconds[key] += report.duration
        if report.when == "call" or report.failed or report.skipped:
            if key in self.outcome and self.outcome[key] != "passed" and report.when != "call":
                return  # keep the first failure (teardown errors come after it)
            if report.skipped and hasattr(report, "wasxfail"):
                self.outcome[key] = "differs"  # failed, as a deliberate difference must
            elif report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
                self.outcome[key] = ("internal" if "internal:" in reason else "skipped")
            else:
                self.outcome[key] = report.outcome if report.when == "call" else "error"
            if report.failed:
                text = str(report.longrepr)
                missing = _MISSING_RE.findall(text)
                self.why[key] = (f"missing {missing[0]}" if missing
                                 else _first_error_line(text))


def _first_error_line(text: str) -> str:
    for pattern in (r"\n(\w+(?:\.\w+)*(?:Error|Exception|Failure)\b: [^\n]*)",
                    r"\nE\s+(\w+Error: [^\n]*)", r"(Process \d+ terminated[^\n]*)"):
        found = re.findall(pattern, text)
        if found:
            return found[-1][:200]
    return text.strip().splitlines()[-1][:200] if text.strip() else "?"


_results = _Results()


def _row(label: str, c: collections.Counter) -> str:
    run = c["passed"] + c["differs"] + c["failed"] + c["error"]
    return (f"{label:34} {run:>10} {c['passed']:>7} {c['differs']:>7} "
            f"{c['failed'] + c['error']:>7} {c['skipped']:>7} {c['internal']:>8}")


def pytest_runtest_logreport(report):
    _results.record(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if not _results.outcome:
        return
    by_class = collections.defaultdict(collections.Counter)
    for (cls, _), outcome in _results.outcome.items():
        by_class[cls][outcome] += 1
    tr.section("torch RPC suite against torchwire"
               f"{' (torchwire.patch alone)' if PATCH_ONLY else ''}: per class")
    tr.write_line(f"{'class':34} {'public run':>10} {'passed':>7} {'differs':>7} {'failed':>7}"
                  f" {'skipped':>7} {'internal':>8}")
    total = collections.Counter()
    for cls in sorted(by_class, key=lambda c: list(CLASSIFICATION).index(c)
                      if c in CLASSIFICATION else 99):
        c = by_class[cls]
        total.update(c)
        tr.write_line(_row(cls, c))
    tr.write_line(_row("total", total))
    tr.write_line("differs: checks a behaviour torchwire deliberately lacks (docs/compat.md); "
                  "it ran and failed, as it must")
    missing = collections.Counter(w for w in _results.why.values() if w.startswith("missing "))
    if missing:
        tr.write_line("failures from features torchwire does not provide yet:")
        for what, n in missing.most_common():
            tr.write_line(f"  {n:4}  {what}")
    path = config.getoption("--compat-json")
    if path:
        rows = [{"class": cls, "test": name, "outcome": outcome,
                 "seconds": round(_results.seconds[(cls, name)], 2),
                 "why": _results.why.get((cls, name), "")}
                for (cls, name), outcome in sorted(_results.outcome.items())]
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
        tr.write_line(f"outcomes written to {path}")
    # (a class this run did not build, as the CUDA ones without TORCHWIRE_COMPAT_CUDA=1,
    # is not stale)
    module = sys.modules.get("test_torch_rpc")
    stale = [f"{cls}::{name}" for cls, tests in CLASSIFICATION.items() for name in tests
             if hasattr(module, cls) and not hasattr(getattr(module, cls), name)]
    if stale:
        tr.write_line(f"classified but not in this torch: {', '.join(stale)}")
