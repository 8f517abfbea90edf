"""``torchwire.patch``: run a program written for ``torch.distributed.rpc`` on torchwire,
unchanged.

Either from the command line::

    python -m torchwire.patch train.py --epochs 3      # or: -m package.module args...

or first thing in the program (or in a library that wants it)::

    import torchwire.patch
    torchwire.patch.install()

:func:`install` makes these names, as imported from then on by anyone in this process,
torchwire's: ``torch.distributed.rpc`` and its submodules ``api``, ``functions``,
``constants``, ``options``, ``backend_registry``, ``internal``, ``rref_proxy``;
``torch.distributed.autograd``; ``torch.distributed.optim.DistributedOptimizer`` and
``torch.distributed.nn.RemoteModule`` (with ``torch.distributed.nn.api.remote_module``'s
``RemoteModule`` and ``_RemoteModule``, and ``torch.distributed.optim.optimizer``'s).
It rebinds the entries of ``sys.modules`` and the attributes of the parent packages; a
module that had already bound torch's names before keeps them.  A submodule of torch's
RPC packages that torchwire has no counterpart for (``torch.distributed.rpc._utils``,
...) fails to import, saying so.

Processes the program starts through ``multiprocessing`` (and so
``torch.multiprocessing.spawn``) are patched too: a forked child inherits the patched
modules; a spawned child, and the fork server's, installs the patch first thing, before
it imports the program's main module (the hook rewrites the ``-c`` command line that
``multiprocessing`` gives those children).  Processes started another way (``torchrun``,
``subprocess``) run ``python -m torchwire.patch`` themselves:
``torchrun --nproc-per-node 4 -m torchwire.patch train.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["install", "is_installed", "MODULES", "CLASSES"]

# torch's module -> torchwire's module that stands for it
MODULES: dict[str, str] = {
    "torch.distributed.rpc": "torchwire.rpc",
    "torch.distributed.rpc.api": "torchwire.rpc.api",
    "torch.distributed.rpc.functions": "torchwire.rpc.functions",
    "torch.distributed.rpc.constants": "torchwire.rpc.constants",
    "torch.distributed.rpc.options": "torchwire.rpc.options",
    "torch.distributed.rpc.backend_registry": "torchwire.rpc.backend_registry",
    "torch.distributed.rpc.internal": "torchwire.rpc.internal",
    "torch.distributed.rpc.rref_proxy": "torchwire.rpc.rref_proxy",
    "torch.distributed.autograd": "torchwire.autograd",
}

# (torch's module, class) -> torchwire's module with the class of the same name; the
# torch module itself stays torch's
CLASSES: dict[tuple[str, str], str] = {
    ("torch.distributed.optim", "DistributedOptimizer"): "torchwire.optim",
    ("torch.distributed.optim.optimizer", "DistributedOptimizer"): "torchwire.optim",
    ("torch.distributed.nn", "RemoteModule"): "torchwire.nn",
    ("torch.distributed.nn.api.remote_module", "RemoteModule"): "torchwire.nn",
    ("torch.distributed.nn.api.remote_module", "_RemoteModule"): "torchwire.nn._remote_module",
}

_PREFIXES = tuple(f"{name}." for name in MODULES if name.count(".") == 2)
_lock = threading.Lock()
_originals: dict[str, types.ModuleType] = {}  # torch's modules as they were
_installed = False


class _NoCounterpart(importlib.abc.MetaPathFinder):
    """Refuses torch's RPC submodules that torchwire has no counterpart for: without
    this, the import system would look for them in torchwire's package directory."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(_PREFIXES) and fullname not in sys.modules:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: torchwire.patch is installed, and torchwire "
                f"has no counterpart of this part of torch", name=fullname)
        return None


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def original(name: str) -> types.ModuleType | None:
    """torch's own module ``name`` as it was before :func:`install` (None if it had none)."""
    return _originals.get(name)


def install() -> dict[str, str]:
    """Make torch's RPC names resolve to torchwire's in this process; idempotent.

    Returns:
        What now stands for what: ``{"torch.distributed.rpc": "torchwire.rpc", ...,
        "torch.distributed.nn.RemoteModule": "torchwire.nn.RemoteModule"}``.
    """
    global _installed
    with _lock:
        if not _installed:
            _rebind()
            _patch_multiprocessing()
            _installed = True
    resolved = dict(MODULES)
    resolved.update({f"{m}.{c}": f"{target}.{c}" for (m, c), target in CLASSES.items()})
    return resolved


def _rebind() -> None:
    import torch.distributed as dist
    # torch's users of RPC first, so that their own internals keep torch's modules
    import torch.distributed.autograd
    import torch.distributed.nn
    import torch.distributed.optim
    import torch.distributed.rpc  # noqa: F401

    for name in list(sys.modules):
        if name in MODULES or name.startswith(_PREFIXES):
            _originals[name] = sys.modules.pop(name)
    for name, target in sorted(MODULES.items(), key=lambda item: item[0].count(".")):
        sys.modules[name] = importlib.import_module(target)
    dist.rpc = sys.modules["torch.distributed.rpc"]
    dist.autograd = sys.modules["torch.distributed.autograd"]
    for (module, cls), target in CLASSES.items():
        setattr(importlib.import_module(module), cls,
                getattr(importlib.import_module(target), cls))
    sys.meta_path.insert(0, _NoCounterpart())


# --- children started by multiprocessing ------------------------------------------------

# The -c programs of multiprocessing's spawned children and of its fork server.
_CHILD_PROGRAMS = ("from multiprocessing.spawn import ", "from multiprocessing.forkserver import ")


def _child_prelude() -> str:
    """Python run by a child before multiprocessing's own program: the patch, importable
    from where this process found torchwire."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (f"import sys; sys.path.append({root!r}) if {root!r} not in sys.path else None; "
            f"import torchwire.patch; torchwire.patch.install(); ")


def patched_args(args: Sequence[str]) -> list[str]:
    """A child's argument vector with the patch prepended to multiprocessing's ``-c``
    program (other commands unchanged: the resource tracker needs no torch)."""
    out = list(args)
    for i in range(len(out) - 1):
        if out[i] == "-c" and out[i + 1].startswith(_CHILD_PROGRAMS):
            out[i + 1] = _child_prelude() + out[i + 1]
            break
    return out


def _patch_multiprocessing() -> None:
    from multiprocessing import util

    spawnv: Callable[..., Any] | None = getattr(util, "spawnv_passfds", None)
    if spawnv is None or getattr(spawnv, "_torchwire_patch", False):
        return

    def spawnv_passfds(path: str, args: Sequence[str], passfds: Sequence[int]) -> Any:
        return spawnv(path, patched_args(args), passfds)

    spawnv_passfds._torchwire_patch = True  # type: ignore[attr-defined]
    util.spawnv_passfds = spawnv_passfds  # type: ignore[assignment]
