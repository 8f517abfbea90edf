"""`./run demo` starts 4 workers and reports calls, latency and bandwidth."""

import subprocess
import sys


def test_demo_runs_a_four_worker_job():
    out = subprocess.run([sys.executable, "-m", "torchwire.demo", "--quick"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for peer in ("worker1", "worker2", "worker3"):
        assert f"{peer}  -> {peer} (pid" in text
    assert "async calls/s" in text and "GB/s" in text
    assert "[3.0, 3.0]" in text  # the relay added 1 at each of three hops
    assert "re-raised as KeyError: On WorkerInfo(id=2, name=worker2):" in text
    rows = [ln.split() for ln in text.splitlines() if ln.strip().startswith("worker")
            and ln.split()[1].isdigit()]
    assert [r[0] for r in rows] == ["worker0", "worker1", "worker2", "worker3"]
    assert all(int(r[2]) > 0 for r in rows[1:])  # every peer served calls


def test_showcase_runs_the_parameter_server_and_the_rnn(tmp_path):
    """`./run demo` is `python -m torchwire.examples`: two examples, two summaries."""
    out = subprocess.run([sys.executable, "-m", "torchwire.examples", "--quick", "--no-progress",
                          "--plots", str(tmp_path)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("parameter_server", "rnn"):
        assert f"== torchwire.examples.{name}:" in out.stdout
        assert (tmp_path / f"torchwire-{name}.png").exists()
    bad = subprocess.run([sys.executable, "-m", "torchwire.examples", "nosuch"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no example nosuch; there are parameter_server" in bad.stderr
