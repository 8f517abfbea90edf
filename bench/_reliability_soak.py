"""``bench/reliability.py --soak``: the soak of ``tests/test_soak.py`` (1 M small calls and
100 k RRef create/delete cycles on 3 torchwire workers, RSS and open fds sampled) and
the property-based fuzzing of ``tests/test_fuzz.py`` with a long budget
(``TORCHWIRE_FUZZ_EXAMPLES``); the results become RELIABILITY.md's soak section."""

from __future__ import annotations

import datetime as _dt
import os
import re
import resource
import subprocess
import sys
import time

import _reliability_report as R

FUZZ_MEMORY = 6 << 30  # address space of a fuzzing pytest: a runaway allocation fails
# there as a MemoryError (a failed property, with its example) instead of the OOM killer

FUZZ_GROUPS = [  # run side by side, one pytest each: about the same time each
    ["test_connection_reader_survives_any_bytes"],
    ["test_frame_decoder_accepts_or_rejects_cleanly",
     "test_unpickling_boundary_raises_only_serialization_errors",
     "test_plain_decoders_raise_only_protocol_errors", "test_absurd_lengths",
     "test_the_valid"],
]


def run_soak(calls: int, cycles: int, repo: str) -> dict:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    tests = os.path.join(repo, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import torch

    torch.set_num_threads(1)  # the workers are forked from here (as in tests/conftest.py)
    import test_soak

    try:
        marks = test_soak.soak(calls, cycles, timeout=3600)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    return {"marks": marks, "growth": test_soak.growth(marks)}


def run_fuzz(examples: int, repo: str, log) -> list[dict]:
    """One pytest per group of FUZZ_GROUPS, side by side; per test: outcome, examples."""
    env = dict(os.environ, TORCHWIRE_FUZZ_EXAMPLES=str(examples))
    procs = []
    for group in FUZZ_GROUPS:
        # no:logging: pytest's log capture would keep every example's records (and what
        # they reference) for the whole test: gigabytes over 100 000 examples
        cmd = [sys.executable, "-m", "pytest", "tests/test_fuzz.py", "-p", "no:cacheprovider",
               "-p", "no:logging", "-rA", "--timeout=7200", "--hypothesis-show-statistics", "-k",
               " or ".join(group)]
        procs.append(subprocess.Popen(
            cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=lambda: resource.setrlimit(
                resource.RLIMIT_AS, (FUZZ_MEMORY, FUZZ_MEMORY))))
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=7500)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((text, p.returncode))
    tests: dict = {}
    for (text, rc), group in zip(out, FUZZ_GROUPS):
        found = re.findall(r"^(PASSED|FAILED|ERROR) tests/test_fuzz\.py::(\S+)(?: - (.*))?$",
                           text, re.M)
        for outcome, name, detail in found:
            tests.setdefault(name, {}).update(outcome=outcome, detail=detail[:120])
        if not found:  # the pytest itself died (a signal: rc < 0)
            tests[" or ".join(group)] = {"outcome": f"no result: pytest exited with {rc}",
                                         "detail": (text.strip().splitlines() or [""])[-1]}
        for block in re.split(r"\n(?=tests/test_fuzz\.py::)", text):
            m = re.match(r"tests/test_fuzz\.py::(\S+):", block)
            if not m:
                continue
            rec = tests.setdefault(m.group(1), {})
            n = re.search(r"(\d+) passing", block)
            if n:
                rec["examples"] = int(n.group(1))
            t = re.search(r"generate phase \(([\d.]+) seconds\)", block)
            if t:
                rec["s"] = float(t.group(1))
            stop = re.search(r"Stopped because (.+)", block)
            if stop:
                rec["stop"] = stop.group(1).strip()
        if "FAILED" in text or not found:
            log("fuzz failures:\n" + text[-3000:])
    return [dict(name=k, **v) for k, v in tests.items()]


def soak_section(soak: dict, fuzz: list, args, meta: dict) -> str:
    lines = [R.SOAK_BEGIN, "## Soak and fuzz (torchwire)", "",
             f"- Checkout: torchwire {meta['checkout']}; {meta['date']}",
             f"- Machine: {meta['machine']}",
             f"- Command: `{meta['command']}` (total wall time {meta['wall']:.0f} s)",
             "", "### Soak", "",
             f"3 workers (forked, `tests/test_soak.py`'s `soak()`): worker0 makes "
             f"{args.calls:,} small calls (batches of 1 000 `rpc_async(add)`, alternating "
             f"worker1 and worker2), then {args.cycles:,} RRef cycles (`remote()` on one peer, "
             "`to_here()` from the other through an RPC, `del`). Each worker's RSS and open "
             "file descriptors are sampled 10 times per phase. **Threshold**: from the end of "
             "the warm-up (the first sample, after 10 % of the phase) to the end, RSS and "
             "fds each grow by less than 5 %, on every worker.", ""]
    if "error" in soak:
        lines += [f"**FAIL**: the soak did not finish: `{soak['error']}`", ""]
    else:
        marks = soak["marks"]
        ok = all(g[4] for g in soak["growth"])
        lines += [f"Result: {'**PASS**' if ok else '**FAIL**'}; calls in "
                  f"{marks['t_calls']:.0f} s, RRef cycles in {marks['t_rrefs']:.0f} s.", "",
                  "| phase | worker | RSS after warm-up → end | fds | RSS samples (MiB) | "
                  "fds samples | < 5 % |", "|---|---|---|---|---|---|---|"]
        for phase, worker, w, e, good in soak["growth"]:
            rss = " ".join(str(s[1][worker][0] >> 20) for s in marks[phase])
            fds = " ".join(str(s[1][worker][1]) for s in marks[phase])
            lines.append(f"| {phase} | worker{worker} | {w[0] >> 20} → {e[0] >> 20} MiB "
                         f"({(e[0] / w[0] - 1) * 100:+.1f} %) | {w[1]} → {e[1]} | {rss} | "
                         f"{fds} | {'yes' if good else '**no**'} |")
        lines.append("")
    lines += ["### Fuzzing", "",
              f"`tests/test_fuzz.py` with `TORCHWIRE_FUZZ_EXAMPLES={args.fuzz_examples}` "
              "(hypothesis; `./run test` runs the same properties with 100 examples): the "
              "frame decoder, the connection reader fed arbitrary bytes over a socket pair, the "
              "unpickling boundary, the plain-message decoders. **Threshold**: every property "
              f"passes with ≥ {args.fuzz_examples:,} examples.", "",
              f"Each pytest runs with its address space capped at {FUZZ_MEMORY >> 30} GiB, so a "
              "decoder that allocates what a fuzzed length claims fails with a "
              "`MemoryError`.", "",
              "| test | outcome | examples | time | stopped because |", "|---|---|---|---|---|"]
    for t in fuzz:
        ex = t.get("examples")
        short = ex is not None and ex < args.fuzz_examples
        outcome = t.get("outcome", "no outcome")
        if t.get("detail"):
            outcome += f" ({str(t['detail']).replace('|', '/')})"
        lines.append(f"| `{t['name']}` | {outcome} | "
                     f"{'' if ex is None else f'{ex:,}'}{' **(short)**' if short else ''} | "
                     f"{'' if 's' not in t else format(t['s'], '.0f') + ' s'} | "
                     f"{t.get('stop', '')} |")
    lines += ["", R.SOAK_END]
    return "\n".join(lines) + "\n"


def run_soak_and_fuzz(args, log, repo: str) -> int:
    started = _dt.datetime.now().astimezone()
    t0 = time.monotonic()
    head = R.checkout(repo)
    log(f"soak: {args.calls} calls, {args.cycles} RRef cycles")
    soak = run_soak(args.calls, args.cycles, repo)
    log("soak: " + (soak.get("error") or "done"))
    log(f"fuzz: {args.fuzz_examples} examples per property")
    fuzz = run_fuzz(args.fuzz_examples, repo, log)
    meta = {"checkout": head, "date": f"{started:%Y-%m-%d %H:%M %Z}", "machine": R.machine(),
            "command": ("./run reliability " + " ".join(args.argv)).strip(),
            "wall": time.monotonic() - t0}
    section = soak_section(soak, fuzz, args, meta)
    print(section)
    if args.out:
        R.write(args.out, soak=section)
        log(f"wrote {args.out}")
    ok = "error" not in soak and all(g[4] for g in soak["growth"]) and fuzz and all(
        t.get("outcome") == "PASSED" for t in fuzz)
    return 0 if ok else 1
