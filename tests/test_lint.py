"""The package, tests and bench pass ruff (rules in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "torchwire", "tests", "bench",
                          "compat"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
