"""A quick subset of torch's own RPC test suite, run against torchwire.

``./run compat`` runs every public test of torch's suite (docs/compat.md); this runs
the ~70 listed in ``compat/quick.txt``, across remote calls, RRefs, futures,
distributed autograd, the optimizer, RemoteModule and DDP, in a separate pytest
process, under ``torchwire.patch`` alone (``TORCHWIRE_COMPAT_PATCH_ONLY=1``): torch's test modules
and torch's own TensorPipe fixture, with no placeholders for what torchwire lacks.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _quick() -> list[str]:
    lines = (ROOT / "compat" / "quick.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_quick_subset_is_public_and_classified():
    import tomllib
    classes = tomllib.loads((ROOT / "compat" / "classification.toml").read_text())
    quick = _quick()
    assert len(quick) == len(set(quick)) >= 55
    for test in quick:
        cls, _, name = test.partition("::")
        assert classes[cls][name].startswith("public:"), test


def test_quick_subset_of_torchs_rpc_suite_passes():
    quick = _quick()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "compat/pytest.ini", "-q",
         *(f"compat/test_torch_rpc.py::{t}" for t in quick)],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
        env={**os.environ, "TORCHWIRE_COMPAT_PATCH_ONLY": "1"})
    tail = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) == len(quick), tail
    assert "(torchwire.patch alone)" in out.stdout, tail
