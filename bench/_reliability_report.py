"""RELIABILITY.md from the runs of ``bench/reliability.py``: pass counts per library per
scenario, the thresholds written out, every run's figures; the soak section (written
by ``--soak``) is kept between the markers when the scenarios are rerun, and the other
way round."""

from __future__ import annotations

import os
import subprocess

TITLES = {"torch": "torch.distributed.rpc", "torchwire": "torchwire"}
SOAK_BEGIN, SOAK_END = "<!-- soak:begin -->", "<!-- soak:end -->"
FAULTS_BEGIN, FAULTS_END = "<!-- faults:begin -->", "<!-- faults:end -->"
REJOIN_BEGIN, REJOIN_END = "<!-- rejoin:begin -->", "<!-- rejoin:end -->"


def checkout(repo: str) -> str:
    """'abc1234' or 'abc1234 (dirty: N files changed, M of them under torchwire/)'."""
    try:
        rev = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        st = subprocess.run(["git", "-C", repo, "status", "--porcelain"],
                            capture_output=True, text=True, timeout=5).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not st:
        return f"`{rev}` (clean tree)"
    lib = sum(1 for line in st if line[3:].startswith("torchwire/"))
    return f"`{rev}` (**dirty**: {len(st)} paths changed, {lib} of them under `torchwire/`)"


def machine() -> str:
    from bench import machine_info

    m = machine_info()
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem']} RAM, {m['os']}; Python "
            f"{m['python']}, torch {m['torch']}")


def passed(run: dict) -> bool:
    return bool(run["checks"]) and all(c["ok"] for c in run["checks"])


def count(runs: list) -> str:
    if runs and all(r.get("skipped") for r in runs):
        return "skipped"
    n = sum(passed(r) for r in runs)
    return f"**{n}/{len(runs)}**" if n < len(runs) else f"{n}/{len(runs)}"


def _cell(run: dict) -> str:
    if run.get("skipped"):
        return f"skipped: {run['skipped']}"
    head = "PASS" if passed(run) else "**FAIL**"
    items = [f"{'✓' if c['ok'] else '✗'} {c['name']}: {c['fig']}" for c in run["checks"]]
    return f"{head} ({run['s']:.0f} s)<br>" + "<br>".join(i.replace("|", "\\|") for i in items)


def faults_section(results: dict, scenarios: dict, libs: list, meta: dict) -> str:
    cols = [lib for lib in ("torch", "torchwire") if lib in libs]
    head = "| scenario | " + " | ".join(TITLES[c] for c in cols) + " |"
    rule = "|---" * (len(cols) + 1) + "|"
    lines = [
        FAULTS_BEGIN,
        "## Fault scenarios",
        "",
        f"- Checkout: torchwire {meta['checkout']}; {meta['date']}",
        f"- Machine: {meta['machine']}",
        f"- Command: `{meta['command']}` (total wall time {meta['wall']:.0f} s); "
        f"{meta['runs']} runs per scenario per library, the libraries alternating "
        "(torch first in odd runs).",
        "",
        "Pass counts (a run passes when every threshold of its scenario holds):",
        "",
        head,
        rule,
    ]
    for name, runs in results.items():
        lines.append(f"| {scenarios[name]['title']} | "
                     + " | ".join(count(runs.get(c, [])) for c in cols) + " |")
    lines += ["", "### How it is measured", "",
              "- One program for both libraries (`bench/_reliability_worker.py`; only the "
              "module imported as `rpc` differs), processes started with multiprocessing "
              "`spawn`, rendezvous `file://` (`tcp://` across namespaces), "
              "`TensorPipeRpcBackendOptions(init_method=...)` and nothing else: every "
              "option at its default (torchwire: heartbeat every 1 s, a peer declared "
              "unavailable after 10 s of silence; `rpc_timeout` 60 s for both). Calls give "
              "their own `timeout=` where a scenario says so.",
              "- Times are `time.monotonic()` (one clock for all processes). Every step runs "
              "in a thread joined with a cap (a call 8 s, a call that waits for a fault "
              "15 s, `shutdown()` 15 s, the load 60 s): past its cap the step is reported "
              "as hanging; every worker left is SIGKILLed at the end of its run.",
              f"- Unpickling guard: the attack pickle, unpickled here, does create its file: "
              f"{'yes' if meta['guard'] else '**NO**'}.",
              "", "### Thresholds", ""]
    for name in results:
        sc = scenarios[name]
        lines += [f"**{sc['title']}** (`{name}`). {sc['setup']}", ""]
        lines += [f"- {t}" for t in sc["thresholds"]]
        lines.append("")
    lines += ["### Every run", ""]
    for name, runs in results.items():
        lines += [f"**{scenarios[name]['title']}** (`{name}`)", "",
                  "| run | " + " | ".join(TITLES[c] for c in cols) + " |",
                  "|---" * (len(cols) + 1) + "|"]
        n = max(len(runs.get(c, [])) for c in cols)
        for i in range(n):
            cells = [(_cell(runs[c][i]) if i < len(runs.get(c, [])) else "") for c in cols]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
        lines.append("")
    errs = []
    for name, runs in results.items():
        for lib in cols:
            for i, run in enumerate(runs.get(lib, [])):
                for e in run.get("errors", []):
                    errs.append(f"- {TITLES[lib]}, `{name}` run {i + 1}: "
                                + e.replace("\n", " ")[:300])
    if errs:
        lines += ["### Errors the workers reported", ""] + errs + [""]
    lines += ["### Notes", "",
              "- torch, strangers: a well-formed TensorPipe message carrying a pickle is not "
              "tried (TensorPipe's framing is not reimplemented here), so torch's \"nothing "
              "unpickled\" only says these raw streams did not reach its unpickler. "
              "TensorPipe has no authentication; torchwire refuses anything before an HMAC "
              "challenge–response (`tests/test_auth.py` sends the well-formed-frame attack "
              "end to end).",
              "- Malformed frames from an *authenticated* peer are torchwire tests "
              "(`tests/test_failures.py`, `tests/test_fuzz.py`), not comparable to torch.",
              FAULTS_END]
    return "\n".join(lines) + "\n"


def _between(text: str, begin: str, end: str) -> str | None:
    if begin in text and end in text:
        return text[text.index(begin):text.index(end) + len(end)] + "\n"
    return None


def write(path: str, faults: str | None = None, soak: str | None = None,
          rejoin: str | None = None) -> str:
    """Write the report at ``path``; a section not given is kept from the file there."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    faults = faults or _between(old, FAULTS_BEGIN, FAULTS_END) or (
        f"{FAULTS_BEGIN}\n## Fault scenarios\n\nNot run yet: `./run reliability`.\n"
        f"{FAULTS_END}\n")
    soak = soak or _between(old, SOAK_BEGIN, SOAK_END) or (
        f"{SOAK_BEGIN}\n## Soak and fuzz (torchwire)\n\nNot run yet: "
        f"`./run reliability --soak`.\n{SOAK_END}\n")
    rejoin = rejoin or _between(old, REJOIN_BEGIN, REJOIN_END) or (
        f"{REJOIN_BEGIN}\n## Training through crashes (torchwire)\n\nNot run yet: "
        f"`./run reliability --rejoin`.\n{REJOIN_END}\n")
    text = ("# Reliability: torch.distributed.rpc vs torchwire\n\n"
            "Regenerated by `./run reliability` (fault scenarios, both libraries, "
            "`--runs N`, default 5), `./run reliability --soak` (soak and fuzz, "
            "torchwire) and `./run reliability --rejoin` (a trainer killed and restarted, "
            "torchwire); each section says at which commit it ran.\n\n"
            + faults + "\n" + soak + "\n" + rejoin)
    with open(path, "w") as f:
        f.write(text)
    return text
