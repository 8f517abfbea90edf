"""The README's examples run as printed."""

import re
import socket
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_starts_with_the_two_commands():
    lines = [ln for ln in README.read_text().splitlines() if ln.strip()]
    assert lines[1:5] == ["```", "./run demo", "./run test", "```"]


def test_readme_two_worker_example_runs(tmp_path):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = code.replace("29500", str(port))
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "tensor([4., 4.])",
        "tensor([ 0., 10., 20.])",
        "tensor([3., 3.])",
        "On WorkerInfo(id=1, name=worker1):",
    ]


def _run_readme_block(index, tmp_path, placeholder="29501"):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[index]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / f"block{index}.py"
    script.write_text(code.replace(placeholder, str(port)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    return code, out.stdout.splitlines()


def test_readme_rref_example_runs(tmp_path):
    code, lines = _run_readme_block(2, tmp_path)
    assert "rpc.remote" in code
    assert lines == ["tensor(3000.)", "5.0", "worker3 False"]


def test_readme_distributed_training_example_runs(tmp_path):
    code, lines = _run_readme_block(3, tmp_path, "29502")
    assert "dist_autograd.backward" in code and "DistributedOptimizer" in code
    assert lines == ["step 0: loss 1.14", "step 49: loss 0.68"]
