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


def test_every_option_is_in_the_readme():
    import inspect

    from torchwire.rpc import TorchwireRpcBackendOptions
    readme = (DOCS.parent / "README.md").read_text()
    fields = [p.name for p in inspect.signature(TorchwireRpcBackendOptions).parameters.values()
              if p.kind is p.KEYWORD_ONLY]
    assert len(fields) >= 20 and "heartbeat_timeout" in fields
    undocumented = [f for f in fields if f"`{f}`" not in readme]
    assert not undocumented, f"options missing from README.md: {undocumented}"


def _environment_reads(path: Path) -> set[str]:
    """Names of the environment variables a module reads: keys of ``os.environ[...]``,
    ``os.environ.get``, ``os.getenv`` and ``in os.environ``, resolved through module
    constants, loops over literal tuples, and parameters of helpers called with
    literal keys."""
    import ast
    tree = ast.parse(path.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    keys = []  # (key expression, enclosing function or None)

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and (
                    (child.func.attr == "get" and is_environ(child.func.value))
                    or child.func.attr == "getenv") and child.args:
                keys.append((child.args[0], func))
            elif isinstance(child, ast.Subscript) and is_environ(child.value):
                keys.append((child.slice, func))
            elif isinstance(child, ast.Compare) and any(is_environ(c) for c in child.comparators):
                keys.append((child.left, func))
            visit(child, inner)

    visit(tree, None)
    loops = {}  # loop variable -> literal strings it runs over
    for node in ast.walk(tree):
        if isinstance(node, (ast.comprehension, ast.For)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List)):
            loops[node.target.id] = [e.value for e in node.iter.elts
                                     if isinstance(e, ast.Constant)]
    found = set()
    for key, func in keys:
        if isinstance(key, ast.Constant):
            found.add(key.value)
        elif isinstance(key, ast.Name) and key.id in consts:
            found.add(consts[key.id])
        elif isinstance(key, ast.Name) and key.id in loops:
            found.update(loops[key.id])
        elif isinstance(key, ast.Name) and func is not None and \
                key.id in [a.arg for a in func.args.args]:
            index = [a.arg for a in func.args.args].index(key.id)
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name) and n.func.id == func.name]
            found.update(c.args[index].value for c in calls if len(c.args) > index
                         and isinstance(c.args[index], ast.Constant))
        else:
            raise AssertionError(f"{path}: cannot tell which variable {ast.unparse(key)} is")
    return found


def test_every_environment_variable_the_code_reads_is_in_the_readme():
    readme = (DOCS.parent / "README.md").read_text()
    section = re.search(r"^## Environment variables\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README.md has no '## Environment variables' section"
    read = set()
    for path in sorted((DOCS.parent / "torchwire").rglob("*.py")):
        read |= _environment_reads(path)
    assert {"TORCHWIRE_SECRET", "TORCHWIRE_LISTEN_ADDR", "TORCHWIRE_SOCKBUF", "RANK",
            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= read, read
    undocumented = sorted(v for v in read if f"`{v}`" not in section.group(1))
    assert not undocumented, f"environment variables missing from README.md: {undocumented}"
