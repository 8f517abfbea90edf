"""The public API's type hints hold: ``mypy --strict`` on every public package.

The public packages are found, not listed: every package or module of torchwire whose
name has no leading underscore, except the example programs (users of the API).  The
private layers beneath them are read for their types; their own errors are not
reported (pyproject.toml, ``[tool.mypy]``).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchwire

ROOT = Path(__file__).parent.parent
NOT_API = {"examples", "demo"}


def public_targets() -> list[str]:
    """The files and packages mypy checks: the root ``__init__`` and every public one."""
    names = [m.name for m in pkgutil.iter_modules(torchwire.__path__)
             if not m.name.startswith("_") and m.name not in NOT_API]
    return ["torchwire/__init__.py"] + [f"torchwire/{n}" + ("" if (ROOT / "torchwire" / n).is_dir()
                                                            else ".py") for n in sorted(names)]


def test_the_public_packages_are_found():
    assert {"torchwire/rpc", "torchwire/autograd", "torchwire/optim", "torchwire/nn",
            "torchwire/patch"} <= set(public_targets())
    assert (ROOT / "torchwire" / "py.typed").is_file()


@pytest.mark.timeout(240)
def test_public_api_passes_mypy_strict():
    out = subprocess.run([sys.executable, "-m", "mypy", *public_targets()], cwd=ROOT,
                         capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
