"""Make ``torch.distributed.rpc`` & co. resolve to torchwire inside this process.

torch's RPC test modules import ``torch.distributed.rpc``, ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and ``torch.distributed.nn.RemoteModule``.
:func:`install` runs the product's :func:`torchwire.patch.install`, which rebinds those
names, in ``sys.modules`` and as attributes of their parent packages, to torchwire's,
before the test modules are imported.  Nothing of torch's test code is copied: it is
imported from the installed torch and reads torchwire.

On top of the patch, for the whole suite (``placeholders=True``): a name that torch's
module has and torchwire's lacks (one of torch's internals) resolves to a
:class:`Missing` placeholder, and so does a submodule torchwire has no counterpart for.
Importing it works, so a test module loads; *using* it raises :class:`MissingFeature`,
so only the tests that use it fail, with a message that names what is missing.  A name
neither module has raises ``AttributeError`` as usual.  With ``placeholders=False`` the
patch stands alone, as a user gets it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torchwire.patch as patch

_PREFIXES = ("torch.distributed.rpc.", "torch.distributed.autograd.")

RESOLVED: dict[str, str] = {}            # torch name -> what now stands for it
_installed = False


class MissingFeature(Exception):
    """A test used something torch has and torchwire does not (yet) provide.

    Deliberately not a ``RuntimeError``/``ValueError``: a test expecting one of those
    from torch must not pass because the feature is absent.
    """


class Missing:
    """Stands for ``qualname`` of torch, which torchwire does not provide."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self, *_args, **_kwargs):
        raise MissingFeature(f"torchwire does not provide {self._qualname}")

    __call__ = _fail
    __enter__ = _fail
    __iter__ = _fail

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __getitem__(self, _item):
        return self   # ``RRef[int]`` in annotations evaluated at import time

    def __repr__(self) -> str:
        return f"<missing in torchwire: {self._qualname}>"


def _fallback_getattr(torch_name: str, module: types.ModuleType):
    """A module ``__getattr__``: submodule stand-ins, then Missing for torch's names."""
    previous = getattr(module, "__getattr__", None)

    def __getattr__(name: str):
        if previous is not None:
            try:
                return previous(name)
            except AttributeError:
                pass
        sub = sys.modules.get(f"{torch_name}.{name}")
        if sub is not None and f"{torch_name}.{name}" in RESOLVED:
            return sub
        real = patch.original(torch_name)
        if not name.startswith("__") and real is not None and hasattr(real, name):
            return Missing(f"{torch_name}.{name}")
        raise AttributeError(f"module {torch_name!r} (torchwire stand-in) has no "
                             f"attribute {name!r}")

    __getattr__.__compat_fallback__ = True   # type: ignore[attr-defined]
    return __getattr__


def _with_fallback(torch_name: str, module: types.ModuleType) -> types.ModuleType:
    if not getattr(getattr(module, "__getattr__", None), "__compat_fallback__", False):
        module.__getattr__ = _fallback_getattr(torch_name, module)
    return module


def _stand_in(torch_name: str) -> types.ModuleType:
    """An empty module for a part of torch torchwire has no counterpart of: its names
    are Missing."""
    module = types.ModuleType(torch_name, f"torchwire has no stand-in for {torch_name}")
    module.__path__ = []   # lets ``import torch.distributed.autograd.x`` reach the finder
    RESOLVED[torch_name] = "<missing>"
    return _with_fallback(torch_name, module)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torch.distributed.rpc.<anything>`` that torchwire lacks, as a stand-in
    (ahead of the patch's finder, which refuses them)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIXES) and fullname not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _stand_in(spec.name)

    def exec_module(self, module):
        pass


def install(placeholders: bool = True) -> dict[str, str]:
    """Install torchwire.patch and, with ``placeholders``, the Missing stand-ins;
    idempotent.  Returns what maps to what."""
    global _installed
    if _installed:
        return RESOLVED
    RESOLVED.update(patch.install())
    if placeholders:
        for name in patch.MODULES:
            _with_fallback(name, sys.modules[name])
        sys.meta_path.insert(0, _StandInFinder())
    _installed = True
    import torch.distributed
    assert torch.distributed.rpc is sys.modules["torch.distributed.rpc"]
    return RESOLVED
