"""The runnable snippets of docs/guide-*.md run as printed.

Convention: a ```python block preceded by ``<!-- runnable: expect "TEXT" -->``
is a self-contained script; it must exit 0 and print a line containing TEXT.
Its port 29500 is replaced by a free one.
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
GUIDES = sorted(DOCS.glob("guide-*.md"))
RUNNABLE = re.compile(r'<!-- runnable: expect "(.*?)" -->\n```python\n(.*?)```', re.S)
SNIPPETS = [pytest.param(code, expect, id=f"{g.stem}-{i}")
            for g in GUIDES for i, (expect, code) in enumerate(RUNNABLE.findall(g.read_text()))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_concept_has_a_guide_with_a_runnable_snippet():
    names = {g.stem for g in GUIDES}
    assert names >= {"guide-remote-execution", "guide-rrefs", "guide-distributed-autograd",
                     "guide-channels", "guide-failures-security", "guide-launching"}
    for g in GUIDES:
        assert RUNNABLE.search(g.read_text()), f"{g.name} has no runnable snippet"


def test_the_readme_links_every_guide():
    readme = (DOCS.parent / "README.md").read_text()
    for g in GUIDES:
        assert f"docs/{g.name}" in readme, g.name


@pytest.mark.parametrize("code,expect", SNIPPETS)
def test_guide_snippet_runs(code, expect, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code.replace("29500", str(_free_port())))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(expect in line for line in out.stdout.splitlines()), out.stdout + out.stderr
