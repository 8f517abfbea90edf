"""The package keeps its layering: imports point down only, every module imports cold,
and no file or class grows past its size limit (nor in tests/ and bench/).

LAYERS below is the project's written import order (docs/architecture.md points here).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

LAYERS = [
    (0, "base", ["torchwire", "torchwire._base"]),
    (1, "wire", ["torchwire._wire"]),
    (2, "serialization", ["torchwire._serialization"]),
    (3, "agent", ["torchwire._agent"]),
    (4, "rref", ["torchwire._rref"]),
    (4, "autograd", ["torchwire._autograd"]),
    (5, "bootstrap", ["torchwire._bootstrap"]),
    (6, "rpc", ["torchwire.rpc"]),
    (6, "public-autograd", ["torchwire.autograd"]),
    (7, "optim", ["torchwire.optim"]),
    (7, "nn", ["torchwire.nn"]),
    (7, "profiler", ["torchwire.profiler"]),
    (8, "examples", ["torchwire.examples", "torchwire.demo", "torchwire.launch"]),
    (8, "patch", ["torchwire.patch"]),
]
"""The project's written import order: (level, unit, package prefixes).

A module belongs to the unit of the longest prefix that names it or a package above it;
the bare root prefix ``torchwire`` names the root ``__init__.py`` only.  A module may
import any module of its own unit and any module of a unit at a strictly lower level,
nothing else, not even lazily: no arrow up, no arrow sideways (another unit at the same
level).  A module in no unit is an error: every new package is placed here.
"""

ROOT = Path(__file__).parent.parent / "torchwire"
PACKAGE = ROOT.name
SIZED_FOLDERS = ["tests", "bench"]  # beside the package: their own .py files have the limits too
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400
CHILD_TIMEOUT = 60  # seconds one cold import may take before it counts as hung
HEAVY_IMPORTS = ["torch", "numpy"]  # imported once by the cold-import parent, before forks
OPTIONAL_HEAVY_IMPORTS = ["matplotlib", "sklearn", "gymnasium"]  # the examples' extras


# --- the import-order checker -------------------------------------------------------------

def unit_of(module: str) -> tuple[int, str] | None:
    """(level, unit) of a dotted module name by the longest matching prefix, or None."""
    best = None
    for level, unit, prefixes in LAYERS:
        for prefix in prefixes:
            if prefix == PACKAGE:
                matches = module == PACKAGE
            else:
                matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > len(best[0])):
                best = (prefix, level, unit)
    return None if best is None else best[1:]


def source_path(module: str, is_package: bool) -> str:
    """The file of a module, relative to the repository root: torchwire/_wire/frame.py."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if is_package else f"{path}.py"


def submodule_finder(root: Path):
    """A predicate: does the dotted name exist as a module file or package under root?"""
    def is_submodule(name: str) -> bool:
        parts = name.split(".")
        if parts[0] != root.name or len(parts) < 2:
            return False
        path = root.joinpath(*parts[1:])
        return path.with_name(path.name + ".py").is_file() or (path / "__init__.py").is_file()
    return is_submodule


def _is_ours(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _literal_import_module(node: ast.AST) -> str | None:
    """The name in ``importlib.import_module("...")`` or ``__import__("...")``, if literal."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    arg = node.args[0]
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
            and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    return None


def resolve_imports(module: str, is_package: bool, source: str,
                    is_submodule=None) -> list[tuple[int, str]]:
    """(line, imported torchwire module) for every import anywhere in source, sorted.

    Every statement counts: module level, inside functions, under ``if TYPE_CHECKING:``,
    plus literal ``importlib.import_module`` calls.  Relative imports are resolved against
    the module's package (the module itself when it is a package's ``__init__``);
    ``from P import name`` is ``P.name`` when is_submodule says that exists, else ``P``.
    """
    is_submodule = is_submodule or submodule_finder(ROOT)
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise ValueError(f"{source_path(module, is_package)}:{node.lineno}: "
                                     "relative import above the top-level package")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            if not _is_ours(base):
                continue
            targets = [f"{base}.{alias.name}" if is_submodule(f"{base}.{alias.name}") else base
                       for alias in node.names]
        else:
            literal = _literal_import_module(node)
            if literal is None:
                continue
            targets = [literal]
        found.update((node.lineno, t) for t in targets if _is_ours(t))
    return sorted(found)


def violations_of(module: str, is_package: bool, source: str, is_submodule=None) -> list[str]:
    """Every import in source that breaks LAYERS, one message each (see resolve_imports)."""
    path = source_path(module, is_package)
    here = unit_of(module)
    if here is None:
        return [f"{path}: {module} is in no unit of LAYERS (place it in the table)"]
    level, unit = here
    problems = []
    for line, target in resolve_imports(module, is_package, source, is_submodule):
        where = f"{path}:{line} ({unit}, level {level}) imports {target}"
        there = unit_of(target)
        if there is None:
            problems.append(f"{where}, which is in no unit of LAYERS")
        elif there[1] != unit and there[0] >= level:
            arrow = "an arrow up" if there[0] > level else "a sideways arrow"
            problems.append(f"{where} ({there[1]}, level {there[0]}): {arrow}")
    return problems


def package_sources() -> list[Path]:
    """Every .py file of the package, sorted."""
    return sorted(ROOT.rglob("*.py"))


def folder_sources(folder: str) -> list[Path]:
    """The .py files directly in a folder of the repository (tests, bench), sorted."""
    return sorted((ROOT.parent / folder).glob("*.py"))


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package's __init__) of a file under ROOT."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


# --- sizes ---------------------------------------------------------------------------------

def oversized(path: str, source: str) -> list[str]:
    """The file if it is over MAX_FILE_LINES, and each class over MAX_CLASS_LINES."""
    out = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        out.append(f"{path}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = node.end_lineno - first + 1
            if size > MAX_CLASS_LINES:
                out.append(f"{path}:{first}: class {node.name} is {size} lines "
                           f"(limit {MAX_CLASS_LINES})")
    return out


# --- cold imports ----------------------------------------------------------------------------

def cold_import_modules() -> list[str]:
    """Every module of the package by dotted name, __main__ modules excluded."""
    names = [module_name(p)[0] for p in package_sources()]
    return [n for n in names if n.rpartition(".")[2] != "__main__"]


def _fork_importer(name: str) -> tuple[int, int]:
    """Fork a child that imports name and writes "ok" or its traceback; (read fd, pid)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        os.dup2(2, 1)  # the parent's stdout carries its JSON report only
        try:
            importlib.import_module(name)
            report = "ok"
        except BaseException:
            report = traceback.format_exc()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(report.encode(errors="replace"))
        finally:
            os._exit(0)
    os.close(write_fd)
    return read_fd, pid


def cold_import_all(names: list[str], jobs: int, timeout: float) -> dict[str, str]:
    """Import each name in a fresh fork, jobs at a time: name -> "ok" or what went wrong.

    A child still importing after timeout seconds is killed and reported as hung.
    """
    results, running, pending = {}, {}, list(names)
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            fd, pid = _fork_importer(name)
            running[fd] = (name, pid, time.monotonic() + timeout, [])
        wait = max(0.0, min(r[2] for r in running.values()) - time.monotonic())
        ready, _, _ = select.select(list(running), [], [], wait)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                running[fd][3].append(chunk)
                continue
            name, pid, _, chunks = running.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            report = b"".join(chunks).decode(errors="replace")
            results[name] = report or f"the child exited (wait status {status}) without a report"
        for fd, (name, pid, deadline, _) in list(running.items()):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(fd)
                del running[fd]
                results[name] = f"still importing after {timeout} s: killed"
    return results


def cold_import_parent(root: Path, names: list[str]) -> None:
    """The subprocess: heavy third-party imports once, no torchwire, then a fork per name.

    No torch op runs here: forking after torch's intra-op pool has started can hang a child.
    Prints the results as one JSON line.
    """
    for name in HEAVY_IMPORTS:
        importlib.import_module(name)
    for name in OPTIONAL_HEAVY_IMPORTS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    loaded = [m for m in sys.modules if _is_ours(m)]
    assert not loaded, f"torchwire modules loaded before the forks: {loaded}"
    origin = Path(importlib.util.find_spec(PACKAGE).origin).resolve()
    assert origin == (root / "__init__.py").resolve(), f"{PACKAGE} would come from {origin}"
    results = cold_import_all(names, jobs=max(2, os.cpu_count() or 1), timeout=CHILD_TIMEOUT)
    print(json.dumps(results), flush=True)


# --- tests of the package ------------------------------------------------------------------

def test_imports_point_down_only():
    problems = []
    for path in package_sources():
        module, is_package = module_name(path)
        problems += violations_of(module, is_package, path.read_text())
    assert not problems, (f"{len(problems)} imports break the order of LAYERS "
                          f"(tests/test_layers.py):\n" + "\n".join(problems))


def test_every_module_imports_cold():
    names = cold_import_modules()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    out = subprocess.run([sys.executable, __file__, "--cold-import", *names],
                         cwd=ROOT.parent, env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.splitlines()[-1])
    assert sorted(results) == sorted(names)
    failed = {name: report for name, report in results.items() if report != "ok"}
    assert not failed, f"{len(failed)} of {len(names)} modules fail to import first:\n" + "\n".join(
        f"--- {name}:\n" + "\n".join(report.strip().splitlines()[-6:])
        for name, report in sorted(failed.items()))


def test_files_and_classes_are_small():
    problems = []
    for path in package_sources():
        problems += oversized(str(path.relative_to(ROOT.parent)), path.read_text())
    assert not problems, "too large:\n" + "\n".join(problems)


@pytest.mark.parametrize("folder", SIZED_FOLDERS)
def test_test_and_bench_files_and_classes_are_small(folder):
    paths = folder_sources(folder)
    assert paths, f"no .py files in {folder}/"
    problems = []
    for path in paths:
        problems += oversized(str(path.relative_to(ROOT.parent)), path.read_text())
    assert not problems, "too large:\n" + "\n".join(problems)


# --- tests of the checker ------------------------------------------------------------------

def _exists(*names):
    """An is_submodule predicate for synthetic trees: exactly the given modules exist."""
    return lambda name: name in names


def test_layer_table_is_well_formed():
    units = [unit for _, unit, _ in LAYERS]
    prefixes = [p for _, _, ps in LAYERS for p in ps]
    assert len(set(units)) == len(units)
    assert len(set(prefixes)) == len(prefixes)
    assert all(_is_ours(p) for p in prefixes)
    assert [level for level, _, _ in LAYERS] == sorted(level for level, _, _ in LAYERS)


@pytest.mark.parametrize("module,unit", [
    ("torchwire", (0, "base")),
    ("torchwire._base.errors", (0, "base")),
    ("torchwire._wire.frame", (1, "wire")),
    ("torchwire.autograd", (6, "public-autograd")),
    ("torchwire.autograd._context", (6, "public-autograd")),
    ("torchwire._autograd.context", (4, "autograd")),
    ("torchwire.demo", (8, "examples")),
    ("torchwire.examples.__main__", (8, "examples")),
    ("torchwire._agentx", None),
    ("torchwire._membership", None),
])
def test_unit_of_takes_the_longest_prefix(module, unit):
    assert unit_of(module) == unit


def test_an_arrow_up_is_reported():
    source = "import torch\n\ndef late():\n    import torchwire.rpc.api\n"
    assert violations_of("torchwire._agent.links", False, source, _exists()) == [
        "torchwire/_agent/links.py:4 (agent, level 3) imports torchwire.rpc.api "
        "(rpc, level 6): an arrow up"]


def test_a_sideways_arrow_is_reported():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._autograd import c\n"
    assert violations_of("torchwire._rref.refs", False, source, _exists()) == [
        "torchwire/_rref/refs.py:3 (rref, level 4) imports torchwire._autograd "
        "(autograd, level 4): a sideways arrow"]
    assert violations_of("torchwire.optim", True, "import torchwire.nn\n", _exists()) == [
        "torchwire/optim/__init__.py:1 (optim, level 7) imports torchwire.nn "
        "(nn, level 7): a sideways arrow"]


def test_arrows_down_and_within_a_unit_are_accepted():
    source = ("from .._wire.frame import Frame\nfrom . import peers\nfrom torchwire import _base\n"
              "import torchwire._agent.peers as p\nimport collections\n")
    exists = _exists("torchwire._agent.peers", "torchwire._base")
    assert resolve_imports("torchwire._agent.links", False, source, exists) == [
        (1, "torchwire._wire.frame"), (2, "torchwire._agent.peers"), (3, "torchwire._base"),
        (4, "torchwire._agent.peers")]
    assert violations_of("torchwire._agent.links", False, source, exists) == []


def test_relative_imports_resolve_against_the_package():
    exists = _exists("torchwire._serialization", "torchwire._agent.links")
    source = "from .. import _serialization as ser\n"
    assert resolve_imports("torchwire._agent.links", False, source, exists) == [
        (1, "torchwire._serialization")]
    assert resolve_imports("torchwire._agent.links", False, source, _exists()) == [
        (1, "torchwire")]  # a name in torchwire/__init__.py, not a submodule
    # In a package's __init__, "." is the package itself; in a plain module, its parent.
    assert resolve_imports("torchwire._agent", True, "from . import links\n", exists) == [
        (1, "torchwire._agent.links")]
    assert resolve_imports("torchwire._agent", False, "from . import _serialization\n",
                           exists) == [(1, "torchwire._serialization")]
    assert resolve_imports("torchwire._agent", True, "from .. import rpc\n", _exists()) == [
        (1, "torchwire")]
    with pytest.raises(ValueError, match="above the top-level package"):
        resolve_imports("torchwire._agent", False, "from .. import x\n", _exists())


def test_literal_import_module_calls_count():
    source = ('import importlib\nfrom importlib import import_module\n'
              'importlib.import_module("torchwire.autograd")\nimport_module("torchwire.nn")\n'
              'importlib.import_module(name)\nimportlib.import_module("json")\n')
    assert violations_of("torchwire._serialization", False, source, _exists()) == [
        "torchwire/_serialization.py:3 (serialization, level 2) imports torchwire.autograd "
        "(public-autograd, level 6): an arrow up",
        "torchwire/_serialization.py:4 (serialization, level 2) imports torchwire.nn "
        "(nn, level 7): an arrow up"]


def test_unplaced_modules_are_reported():
    assert violations_of("torchwire._membership", False, "", _exists()) == [
        "torchwire/_membership.py: torchwire._membership is in no unit of LAYERS "
        "(place it in the table)"]
    assert violations_of("torchwire._agent", False, "from . import _timer\n",
                         _exists("torchwire._timer")) == [
        "torchwire/_agent.py:1 (agent, level 3) imports torchwire._timer, "
        "which is in no unit of LAYERS"]


def test_submodule_finder_looks_at_files_and_packages(tmp_path):
    root = tmp_path / "torchwire"
    (root / "_wire").mkdir(parents=True)
    (root / "_wire" / "__init__.py").write_text("")
    (root / "_wire" / "frame.py").write_text("")
    is_submodule = submodule_finder(root)
    assert is_submodule("torchwire._wire") and is_submodule("torchwire._wire.frame")
    assert not is_submodule("torchwire._wire.Frame") and not is_submodule("torchwire.rpc")
    assert not is_submodule("torch.nn")


def test_cold_import_runner_reports_errors_deaths_and_hangs(tmp_path):
    modules = {"fine": "import json\n", "broken": "from fine import nothing\n",
               "dies": "import os\nos._exit(3)\n",
               "hangs": "import threading\nthreading.Event().wait()\n"}
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
    script = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(Path(__file__).parent)!r}]\n"
              "import json, test_layers\n"
              f"print(json.dumps(test_layers.cold_import_all({sorted(modules)!r}, 2, 3)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.splitlines()[-1])
    assert results["fine"] == "ok"
    assert "ImportError: cannot import name 'nothing'" in results["broken"]
    assert "without a report" in results["dies"]
    assert results["hangs"] == "still importing after 3 s: killed"


def test_oversized_counts_files_and_classes_with_decorators():
    body = "\n".join(f"    x{i} = {i}" for i in range(398))
    just_fits = f"@dataclass\nclass A:\n{body}\n"  # 400 lines, decorator included
    assert oversized("a.py", just_fits) == []
    assert oversized("a.py", f"@dataclass\n@final\nclass A:\n{body}\n") == [
        "a.py:1: class A is 401 lines (limit 400)"]
    assert oversized("a.py", "x = 1\n" * 601) == ["a.py: 601 lines (limit 600)"]


if __name__ == "__main__" and sys.argv[1:2] == ["--cold-import"]:
    cold_import_parent(ROOT, sys.argv[2:])
