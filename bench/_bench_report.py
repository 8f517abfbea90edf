"""The benchmark's metrics, their targets, and the markdown report.

Every metric is measured under each thread setting (``_bench_procs.THREAD_SETTINGS``)
for each library; a target is a ratio torchwire / torch judged on the worse of the
settings' ratios (``ratio``), or a bound on torchwire's own value, also on the worse
setting (``value``: the fresh round trip over its floor).
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
from typing import NamedTuple

from _bench_procs import SETTING_TITLES
from _bench_worker import ECHO_SIZES, FRESH_OPS, FRESH_SIZES, NET_ECHO_SIZES, split_spec

LIB_TITLES = {"torch": "torch.distributed.rpc", "torchwire": "torchwire"}
# A/B mode (a torchwire@PATH spec): a metric of the second version more than this much
# worse than the first's is flagged.
AB_TOLERANCE = 0.03
SHUTDOWN_LABEL = "clean shutdown (rounds; worst graceful shutdown() of the driving worker)"


class Spec(NamedTuple):
    key: str
    label: str
    unit: str
    higher: bool  # higher is better
    target: tuple | None  # ("<=" | ">=", ratio to torch) or ("value<=", bound)
    source: str  # "il": short rounds, "round": long rounds, "ps": the parameter-server job


def _pretty(label: str) -> str:
    return label.replace("KiB", " KiB").replace("MiB", " MiB").replace("GiB", " GiB")


@functools.lru_cache(maxsize=None)
def metric_specs() -> tuple:
    # Latency and model-parallel step targets are judged on the short alternating
    # rounds (run_interleaved): the same measurement as in the long rounds, each
    # library alone on fresh processes, but sampled seconds apart and over more
    # rounds, so that the machine's drift over minutes does not decide the ratio.
    il, lr = " (short alternating rounds)", " (long rounds)"
    specs = [
        Spec("il_sync_noop_median_us", "rpc_sync no-op latency, median" + il, "µs", False,
             ("<=", 0.35), "il"),
        Spec("il_sync_noop_p99_us", "rpc_sync no-op latency, p99" + il, "µs", False, None,
             "il"),
        Spec("il_sync_tensor16_median_us", "rpc_sync echo 16-float tensor, median" + il, "µs",
             False, None, "il"),
        Spec("il_remote_to_here_median_us", "remote() + to_here() latency, median" + il, "µs",
             False, ("<=", 0.35), "il"),
        Spec("il_rref_proxy_median_us", "RRef proxy call rref.rpc_sync().get(), median" + il,
             "µs", False, ("<=", 0.5), "il"),
        Spec("il_mp_step_median_ms", "model-parallel training step (remote embedding, local "
             "layer, remote decoder, backward, optimizer), median" + il, "ms", False,
             ("<=", 0.45), "il"),
        Spec("sync_noop_median_us", "rpc_sync no-op latency, median" + lr, "µs", False, None,
             "round"),
        Spec("remote_to_here_median_us", "remote() + to_here() latency, median" + lr, "µs",
             False, None, "round"),
        Spec("mp_step_median_ms", "model-parallel training step, median" + lr, "ms", False,
             None, "round"),
        Spec("async_noop_calls_per_s", "rpc_async no-op throughput (10 000 in flight)",
             "calls/s", True, (">=", 4.0), "round"),
        Spec("asyncio_wait_noop_median_us", "rpc_async(noop).wait() latency, median (the "
             "reference of the next row)", "µs", False, None, "round"),
        Spec("asyncio_await_noop_median_us", "`await rpc.rpc_async(noop)` latency in an "
             "asyncio loop, median (torchwire-only; torch column: `fut.wait()` in a thread "
             "executor)", "µs", False, None, "round"),
        Spec("asyncio_await_10k_calls_per_s", "10 000 concurrent `await rpc.rpc_async(noop)` "
             "(asyncio.gather; torchwire-only; torch column: each `fut.wait()` in a thread "
             "executor)", "calls/s", True, None, "round"),
        Spec("ps_samples_per_s", "parameter server: 4 trainers pull 16 MiB, push its "
             "gradient (fresh tensors both ways), samples/s", "samples/s", True, (">=", 2.0),
             "ps"),
    ]
    for op, expr in FRESH_OPS.items():
        for label, _ in FRESH_SIZES:
            big = label == "256MiB"
            specs.append(Spec(f"fresh_{op}_{label}_ms", f"fresh tensor round trip "
                              f"{_pretty(label)}, callee returns `{expr}`, caller reads it, "
                              "same host", "ms", False, ("<=", 0.3) if big else None, "round"))
        specs.append(Spec(f"floor_{op}_256MiB_ms", f"floor of that at 256 MiB: `{expr}` + one "
                          "copy into warm memory, in the caller's process", "ms", False, None,
                          "round"))
        specs.append(Spec(f"fresh_{op}_256MiB_over_floor", f"fresh `{expr}` round trip 256 MiB "
                          "same host / its floor, same process", "×", False, ("value<=", 1.5),
                          "round"))
        for label, _ in FRESH_SIZES:
            big = label == "256MiB"
            specs.append(Spec(f"net_fresh_{op}_{label}_ms", f"fresh tensor round trip "
                              f"{_pretty(label)}, callee returns `{expr}`, caller reads it, "
                              "network channel forced (TCP)", "ms", False,
                              ("<=", 0.5) if big else None, "round"))
    for prefix, where in (("", "same host"), ("net_", "network channel forced (TCP)")):
        specs.append(Spec(f"{prefix}sd_pull_ms", "state dict pull: 250 tensors, 173 MiB "
                          "(ResNet-like sizes), callee returns a fresh copy, caller reads "
                          f"each, {where}", "ms", False, None, "round"))
        specs.append(Spec(f"{prefix}sd_push_ms", "state dict push: the same as fresh "
                          f"copies, callee reads each, {where}", "ms", False, None, "round"))
    for label, _ in ECHO_SIZES:
        target = (">=", 10.0) if label == "256MiB" else None
        specs.append(Spec(f"echo_{label}_GBps", f"tensor echo by reference {_pretty(label)} "
                          "(the callee returns the tensor it received), same host, bandwidth "
                          "(2×bytes/time)", "GB/s", True, target, "round"))
    for label, _ in NET_ECHO_SIZES:
        target = (">=", 2.0) if label == "256MiB" else None
        specs.append(Spec(f"net_echo_{label}_GBps", f"tensor echo by reference "
                          f"{_pretty(label)}, network channel forced (TCP), bandwidth", "GB/s",
                          True, target, "round"))
    for side in ("caller", "callee"):
        specs.append(Spec(f"echo_1GiB_{side}_peak_rss_MiB", "peak RSS above idle during the "
                          f"1 GiB echo, {side}", "MiB", False, None, "round"))
    return tuple(specs)


# ---------------------------------------------------------------------------- libraries

def is_ab(libs: list) -> bool:
    """A/B mode: two versions of torchwire, one at least given as ``torchwire@PATH``."""
    return any(split_spec(lib)[1] is not None for lib in libs)


@functools.lru_cache(maxsize=None)
def git_rev(path: str) -> tuple[str, bool] | None:
    """(short HEAD, has uncommitted changes) of the checkout at ``path``; None without git."""
    try:
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if rev.returncode != 0 or not rev.stdout.strip():
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev.stdout.strip(), bool(dirty)
    except Exception:
        return None


def describe_checkout(path: str) -> str:
    got = git_rev(path)
    if got is None:
        return "source tree"
    return f"git {got[0]}" + (" (+ uncommitted changes)" if got[1] else "")


def checkout_of(lib: str, repo_root: str) -> str:
    """The checkout a torchwire spec imports from: PATH, or this bench's own."""
    return split_spec(lib)[1] or repo_root


def lib_titles(libs: list) -> dict:
    """Column titles: torch.distributed.rpc / torchwire; in A/B mode
    "torchwire@PATH (rev)" and "torchwire (this checkout)"."""
    if not is_ab(libs):
        return {lib: LIB_TITLES[lib] for lib in libs}
    titles = {}
    for lib in libs:
        name, path = split_spec(lib)
        if path is None:
            titles[lib] = f"{name} (this checkout)"
        else:
            got = git_rev(path)
            titles[lib] = f"{lib} ({got[0] if got else 'no git'})"
    return titles


# ---------------------------------------------------------------------------- summary

def fmt_value(v: float, unit: str) -> str:
    if unit == "µs":
        return f"{v:,.0f} µs" if v >= 100 else f"{v:.1f} µs"
    if unit in ("calls/s", "samples/s"):
        return f"{v:,.0f} {unit}"
    if unit == "GB/s":
        return f"{v:.3g} GB/s" if v < 10 else f"{v:.1f} GB/s"
    if unit == "×":
        return f"{v:.2f}×"
    return f"{v:.4g} {unit}"


def summarize(rounds: list, il: dict, ps: list) -> dict:
    """One library under one setting: its long ``rounds``, its short rounds' values
    ``il`` and its parameter-server jobs ``ps`` -> a median and the values per metric."""
    per_metric = {}
    for spec in metric_specs():
        if spec.source == "il":
            vals = list(il.get(spec.key, []))
        else:
            vals = [r["metrics"][spec.key] for r in (ps if spec.source == "ps" else rounds)
                    if spec.key in r["metrics"]]
        per_metric[spec.key] = {"median": statistics.median(vals) if vals else None,
                                "values": vals, "n": len(vals)}
    errors = list(il.get("errors", []))
    for i, r in enumerate(rounds):
        errors += [f"round {i + 1}: {e}" for e in r["errors"]]
    for i, r in enumerate(ps):
        errors += [f"parameter-server job {i + 1}: {e}" for e in r["errors"]]
    return {
        "metrics": per_metric,
        "errors": errors,
        "rounds_run": len(rounds),
        "clean_shutdowns": sum(1 for r in rounds if r["clean_shutdown"]),
        "shutdown_s": [r["shutdown_s"] for r in rounds if r["shutdown_s"] is not None],
        "notes": sorted({n for r in rounds for n in r["notes"]}),
        "imported": sorted({p for r in rounds for p in r.get("imported", [])}
                           | set(il.get("imported", []))),
    }


def _short_error(s: dict) -> str:
    if not s["errors"]:
        return "error: no result"
    e = s["errors"][0].split(": ", 1)[-1].replace("|", "\\|")
    return f"error: {e[:87] + '...' if len(e) > 90 else e}"


def _cell(s: dict, spec: Spec, want: dict) -> tuple[str, float | None]:
    """A cell for one library under one setting, and its median (None on error)."""
    m = s["metrics"][spec.key]
    if m["median"] is None:
        return _short_error(s), None
    cell = fmt_value(m["median"], spec.unit)
    if m["n"] < want[spec.source]:
        cell += f" ({m['n']}/{want[spec.source]} rounds)"
    return cell, m["median"]


def _shutdown_cell(s: dict, rounds: int) -> str:
    cell = f"{s['clean_shutdowns']}/{rounds}"
    if s["shutdown_s"]:
        cell += f", worst {max(s['shutdown_s']):.2f} s"
    return cell


def _row(cells: list) -> str:
    return "| " + " | ".join(cells) + " |"


def _head(cols: list, aligns: list) -> list:
    return [_row(cols), "|" + "|".join(aligns) + "|"]


def judge(spec: Spec, ratios: dict, values: dict) -> tuple[str, bool | None]:
    """The target cell and whether it is met, on the worse thread setting."""
    op, bound = spec.target
    if op == "value<=":
        vals = [v for v in values.values() if v is not None]
        if len(vals) < len(values):
            return f"≤ {bound:g} (worse setting)", False
        worst = max(vals)
        return f"≤ {bound:g} (worse setting: {worst:.2f})", worst <= bound
    rs = [r for r in ratios.values() if r is not None]
    if len(rs) < len(ratios):
        return f"{'≤' if op == '<=' else '≥'} {bound:g}× torch", False
    worst = max(rs) if op == "<=" else min(rs)
    ok = worst <= bound if op == "<=" else worst >= bound
    return f"{'≤' if op == '<=' else '≥'} {bound:g}× torch (worse: {worst:.2f}×)", ok


def build_table(summary: dict, libs: list, settings: tuple, want: dict) -> str:
    """Both libraries under every setting, the ratio per setting, the target judged on the
    worse setting."""
    titles = lib_titles(libs)
    both = "torch" in libs and "torchwire" in libs
    cols, aligns = ["metric"], ["---"]
    for st in settings:
        cols += [f"{titles[lib]}, {SETTING_TITLES[st]}" for lib in libs]
        aligns += ["---:"] * len(libs)
        if both:
            cols.append(f"ratio, {SETTING_TITLES[st]}")
            aligns.append(":---")
    if both:
        cols += ["target", "met?"]
        aligns += [":---", ":---:"]
    lines = _head(cols, aligns)
    for spec in metric_specs():
        row, ratios, values = [spec.label], {}, {}
        for st in settings:
            vals = {}
            for lib in libs:
                cell, v = _cell(summary[st][lib], spec, want)
                row.append(cell)
                vals[lib] = v
            if both:
                t, w = vals.get("torch"), vals.get("torchwire")
                ratios[st] = w / t if t and w is not None and spec.unit != "×" else None
                values[st] = w
                row.append(f"{ratios[st]:.2f}×" if ratios[st] is not None else "—")
        if both:
            if spec.target is None:
                row += ["—", "—"]
            else:
                cell, ok = judge(spec, ratios, values)
                row += [cell, "yes" if ok else "**no**"]
        lines.append(_row(row))
    row = [SHUTDOWN_LABEL]
    for st in settings:
        row += [_shutdown_cell(summary[st][lib], want["round"]) for lib in libs]
        if both:
            row.append("—")
    if both:
        ok = all(summary[st]["torchwire"]["clean_shutdowns"] == want["round"] for st in settings)
        row += [f"{want['round']}/{want['round']}", "yes" if ok else "**no**"]
    lines.append(_row(row))
    return "\n".join(lines)


def ab_change(ratio: float, higher: bool) -> tuple[str, bool]:
    """The A/B "change" cell for a ratio, and whether it is worse than AB_TOLERANCE."""
    worse = (1.0 - ratio) if higher else (ratio - 1.0)
    text = f"{(ratio - 1.0) * 100:+.1f} %".replace("-", "−")
    if worse > AB_TOLERANCE:
        return f"{text}, **worse**", True
    if worse < -AB_TOLERANCE:
        return f"{text}, better", False
    return f"{text}, within ±{AB_TOLERANCE * 100:g} %", False


def build_ab_table(summary: dict, libs: list, settings: tuple, want: dict) -> tuple[str, list]:
    """A/B: both versions under each setting, second / first, the change; and the labels
    of the metrics worse by more than AB_TOLERANCE (under either setting)."""
    titles = lib_titles(libs)
    cols, aligns = ["metric"], ["---"]
    for st in settings:
        cols += [f"{titles[lib]}, {SETTING_TITLES[st]}" for lib in libs]
        cols += [f"second / first, {SETTING_TITLES[st]}"]
        aligns += ["---:", "---:", ":---"]
    lines, worse = _head(cols, aligns), []
    for spec in metric_specs():
        row = [spec.label]
        for st in settings:
            vals = [_cell(summary[st][lib], spec, want) for lib in libs]
            row += [c for c, _ in vals]
            a, b = (v for _, v in vals)
            if a is None or b is None or a <= 0:
                row.append("—")
                continue
            text, bad = ab_change(b / a, spec.higher)
            row.append(f"{b / a:.3f}× ({text})")
            if bad and spec.label not in worse:
                worse.append(spec.label)
        lines.append(_row(row))
    return "\n".join(lines), worse


def build_per_round(summary: dict, libs: list, settings: tuple) -> str:
    titles = lib_titles(libs)
    cols = ["metric"] + [f"{titles[lib]}, {SETTING_TITLES[st]}" for st in settings
                         for lib in libs]
    lines = _head(cols, ["---"] * len(cols))
    for spec in metric_specs():
        row = [spec.label]
        for st in settings:
            for lib in libs:
                vals = summary[st][lib]["metrics"][spec.key]["values"]
                row.append(", ".join(fmt_value(v, spec.unit).rsplit(" ", 1)[0] for v in vals)
                           or "—")
        lines.append(_row(row))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- scale

SCALE_BEGIN, SCALE_END = "<!-- scale:begin -->", "<!-- scale:end -->"


def build_scale_section(scale: dict, libs: list, sizes: tuple, rounds: int, started,
                        machine: dict) -> str:
    """``scale[n][lib]`` = list of job results -> the init-at-scale section."""
    titles = lib_titles(libs)
    both = "torch" in libs and "torchwire" in libs
    cols = ["workers"] + [f"{titles[lib]} init_rpc, median" for lib in libs]
    cols += [f"{titles[lib]} per round" for lib in libs]
    if both:
        cols += ["ratio", "target", "met?"]
    lines = [SCALE_BEGIN, "## Init at scale (`./run bench --scale`)", "",
             f"- Date: {started.strftime('%Y-%m-%d %H:%M:%S %Z').strip()}; torchwire "
             f"{machine['torchwire']}; {rounds} round(s) per library and size, alternating.",
             "- A zygote process imports the library, freezes its objects (`gc.freeze()`, "
             "so that the workers' collections copy none of them) and forks N workers on "
             "127.0.0.1 (`init_method=tcp://`, default options); init time = the last "
             "worker's return from `init_rpc` - the first worker's call (wall clock); then "
             "all shut down.",
             ""] + _head(cols, ["---:"] + ["---:"] * (2 * len(libs))
                         + ([":---", ":---", ":---:"] if both else []))
    for n in sizes:
        meds, cells, per = {}, [], []
        for lib in libs:
            jobs = scale.get(n, {}).get(lib, [])
            vals = [j["init_s"] for j in jobs if j["init_s"] is not None]
            meds[lib] = statistics.median(vals) if vals else None
            errs = [e for j in jobs for e in j["errors"]]
            cell = f"{meds[lib]:.2f} s" if vals else "failed"
            if len(vals) < len(jobs):
                cell += f" ({len(vals)}/{len(jobs)} completed)"
            if errs:
                cell += f"; {errs[0][:80]}"
            cells.append(cell)
            per.append(", ".join(f"{v:.2f}" if v is not None else "—"
                                 for v in (j["init_s"] for j in jobs)) or "—")
        row = [str(n)] + cells + per
        if both:
            t, w = meds.get("torch"), meds.get("torchwire")
            ratio = w / t if t and w is not None else None
            row.append(f"{ratio:.2f}×" if ratio is not None else "—")
            if n == 32:
                row += ["≤ 0.3× torch", "yes" if ratio is not None and ratio <= 0.3 else "**no**"]
            elif n == 64:
                done = all(j["init_s"] is not None for j in scale.get(n, {}).get("torchwire", []))
                row += ["completes", "yes" if w is not None and done else "**no**"]
            else:
                row += ["—", "—"]
        lines.append(_row(row))
    lines += ["", SCALE_END]
    return "\n".join(lines)


def keep_scale_section(path: str) -> str | None:
    """The init-at-scale section of an existing report, to carry over."""
    if not os.path.exists(path):
        return None
    text = open(path).read()
    if SCALE_BEGIN in text and SCALE_END in text:
        return text[text.index(SCALE_BEGIN):text.index(SCALE_END) + len(SCALE_END)]
    return None


def replace_scale_section(path: str, section: str) -> str:
    """The report at ``path`` with its init-at-scale section replaced (or appended)."""
    text = open(path).read() if os.path.exists(path) else "# torchwire benchmarks\n"
    if SCALE_BEGIN in text and SCALE_END in text:
        a, b = text.index(SCALE_BEGIN), text.index(SCALE_END) + len(SCALE_END)
        return text[:a] + section + text[b:]
    return text.rstrip("\n") + "\n\n" + section + "\n"
