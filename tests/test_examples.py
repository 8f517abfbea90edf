"""Every example runs small, as a user starts it, and learns; one runs under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run_example(name: str, tmp_path: Path, *options: str, launcher: list | None = None,
                timeout: float = 120, env: dict | None = None) -> tuple[dict, str]:
    """Run ``python -m torchwire.examples.NAME`` (or under ``launcher``, in ``env``);
    return the figures it wrote and its standard output."""
    results, plot = tmp_path / "results.json", tmp_path / f"{name}.png"
    cmd = (launcher or [sys.executable]) + ["-m", f"torchwire.examples.{name}",
                                            "--no-progress", "--plot", str(plot),
                                            "--results", str(results), "--timeout",
                                            str(timeout - 10), *options]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"== torchwire.examples.{name}:" in out.stdout
    assert "rpc traffic" in out.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = json.loads(results.read_text())
    assert figures["rpc_calls"] > 0 and figures["rpc_bytes_sent"] > 0
    return figures, out.stdout


def test_parameter_server_learns_digits(tmp_path):
    fig, _ = run_example("parameter_server", tmp_path, "--world-size", "3", "--steps", "150")
    assert fig["accuracy_before"] < 0.3
    assert fig["accuracy"] > 0.85, fig
    assert fig["steps"] == 150


def test_parameter_server_trains_on_through_trainers_killed_with_sigkill(tmp_path):
    fig, out = run_example("parameter_server", tmp_path, "--world-size", "3", "--steps", "150",
                           "--chaos", "50")
    assert fig["steps"] == 150 and fig["kills"] == 2 and fig["rejoins"] == 2, fig
    assert all(s >= 0 for s in fig["seconds_lost"]) and len(fig["steps_without"]) == 2
    assert "kill 1" in out and "kill 2" in out and "SIGKILL; rejoined at step" in out
    assert fig["accuracy"] > 0.85, fig  # as without chaos (the test above)


def test_parameter_server_restarts_from_its_snapshot_and_the_trainers_wait(tmp_path):
    ck = tmp_path / "ck"
    fig, out = run_example("parameter_server", tmp_path, "--world-size", "3", "--steps", "150",
                           "--checkpoint", str(ck), "--checkpoint-every", "20",
                           "--kill-ps-at", "70")
    assert fig["ps_restarts"] == 1 and fig["resumed_from"] == 60, fig
    assert fig["steps"] == 150 and fig["accuracy"] > 0.85, fig
    assert "went on from its snapshot of step 60" in out
    assert sorted(p.name for p in ck.iterdir()) == ["ps.pt"]  # written whole, no temp left


def test_rnn_loss_falls(tmp_path):
    fig, out = run_example("rnn", tmp_path, "--steps", "120", "--nlayers", "1")
    assert fig["last_loss"] < 0.75 * fig["first_loss"], fig
    assert fig["samples"][0].startswith("Shall I") and "trainer1 writes" in out


def test_pipeline_learns_and_compares_with_one_stage(tmp_path):
    fig, out = run_example("pipeline", tmp_path, "--steps", "15", "--hidden", "256",
                           "--batch-size", "256", "--lr", "0.003")
    assert fig["accuracy"] > 0.7, fig
    assert fig["last_loss"] < 0.5 * fig["first_loss"], fig
    assert fig["pipelined_samples_per_s"] > 0 and fig["one_stage_samples_per_s"] > 0
    assert "samples/s as one stage" in out


def test_rl_reward_rises(tmp_path):
    fig, _ = run_example("rl", tmp_path, "--steps", "30")
    assert fig["last_reward"] > 2 * fig["first_reward"], fig


def test_hybrid_learns_and_keeps_replicas_equal(tmp_path):
    fig, _ = run_example("hybrid", tmp_path, "--steps", "200")
    assert fig["replicas_equal"]
    assert fig["accuracy"] > 0.7, fig
    assert fig["last_loss"] < 0.3 * fig["first_loss"], fig


def test_example_runs_unchanged_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    # the launcher sets these for its children, not this test
    env_free = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    fig, out = run_example("parameter_server", tmp_path, "--steps", "100",
                           launcher=[str(torchrun), "--standalone", "--nproc-per-node", "3"],
                           env=env_free)
    assert out.count("== torchwire.examples.parameter_server:") == 1  # rank 0 only
    assert fig["world_size"] == 3 and fig["accuracy"] > 0.8, fig


def test_a_missing_examples_extra_gives_a_one_line_hint(tmp_path):
    # gymnasium made unimportable, as in an install without the examples extra
    code = ("import runpy, sys; sys.modules['gymnasium'] = None; "
            "runpy.run_module('torchwire.examples.rl', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, "--steps", "1", "--plot", ""],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "torchwire.examples needs the examples extra (missing: gymnasium): "
        "pip install 'torchwire[examples]'"]


def test_profile_flag_writes_a_stitched_trace(tmp_path):
    import gzip
    trace_path = tmp_path / "trace.json.gz"
    _, out = run_example("parameter_server", tmp_path, "--world-size", "3", "--steps", "20",
                         "--profile", str(trace_path), "--profile-steps", "3")
    assert f"stitched trace of 3 workers (ps, trainer1, trainer2): {trace_path}" in out
    events = json.load(gzip.open(trace_path))["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    assert sum(e["ph"] == "s" for e in events) >= 6  # 3 steps of 2 trainers, arrows
