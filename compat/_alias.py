"""Make ``torch.distributed.rpc`` & co. resolve to torchwire inside this process.

torch's RPC test modules import ``torch.distributed.rpc``, ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and ``torch.distributed.nn.RemoteModule``.
:func:`install` rebinds those names, in ``sys.modules`` and as attributes of their parent
packages, to torchwire's modules, before the test modules are imported.  Nothing of
torch's test code is copied: it is imported from the installed torch and reads torchwire.

A name that torch's module has and torchwire's lacks (a feature not built yet, or one of
torch's internals) resolves to a :class:`Missing` placeholder.  Importing it works, so a
test module loads; *using* it raises :class:`MissingFeature`, so only the tests that use
it fail, with a message that names what is missing.  A name neither module has raises
``AttributeError`` as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# torch module -> torchwire modules to try, first found wins.  Several candidates because
# torchwire's private layout moves (``rpc/_api.py`` may become ``rpc/api.py``).
TARGETS: dict[str, tuple[str, ...]] = {
    "torch.distributed.rpc": ("torchwire.rpc",),
    "torch.distributed.rpc.api": ("torchwire.rpc.api", "torchwire.rpc._api"),
    "torch.distributed.rpc.functions": ("torchwire.rpc.functions",),
    "torch.distributed.rpc.constants": ("torchwire.rpc.constants",),
    "torch.distributed.rpc.options": ("torchwire.rpc.options",),
    "torch.distributed.rpc.backend_registry": ("torchwire.rpc.backend_registry",),
    "torch.distributed.rpc.internal": ("torchwire.rpc.internal", "torchwire.rpc._internal"),
    "torch.distributed.rpc.rref_proxy": ("torchwire.rpc.rref_proxy",),
    "torch.distributed.rpc.server_process_global_profiler": (),
    "torch.distributed.rpc._utils": (),
    "torch.distributed.autograd": ("torchwire.autograd",),
}

# Names taken from torch as they are: plain Python helpers of the test code itself that
# involve no RPC machinery (``RPCExecMode`` only selects rpc_sync / rpc_async / remote).
PASSTHROUGH: dict[str, tuple[str, ...]] = {
    "torch.distributed.rpc.internal": ("RPCExecMode",),
}

# Single classes replaced inside torch packages that stay torch's own.
CLASS_TARGETS: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.optim", "DistributedOptimizer"): ("torchwire.optim",),
    ("torch.distributed.nn", "RemoteModule"): ("torchwire.nn",),
    ("torch.distributed.nn.api.remote_module", "RemoteModule"): ("torchwire.nn",),
}

_PREFIXES = ("torch.distributed.rpc.", "torch.distributed.autograd.")

REAL: dict[str, types.ModuleType] = {}   # torch's own modules, by name, as they were
RESOLVED: dict[str, str] = {}            # torch module name -> what now stands for it
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


def _find(candidates) -> types.ModuleType | None:
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise       # the module exists but an import inside it is broken
    return None


def _fallback_getattr(torch_name: str, module: types.ModuleType | None):
    """A module ``__getattr__``: submodule aliases, then Missing for torch's names."""
    previous = getattr(module, "__getattr__", None) if module is not None else None

    def __getattr__(name: str):
        if previous is not None:
            try:
                return previous(name)
            except AttributeError:
                pass
        sub = sys.modules.get(f"{torch_name}.{name}")
        if sub is not None and f"{torch_name}.{name}" in RESOLVED:
            return sub
        real = REAL.get(torch_name)
        if name in PASSTHROUGH.get(torch_name, ()):
            return getattr(real, name)
        if not name.startswith("__") and real is not None and hasattr(real, name):
            return Missing(f"{torch_name}.{name}")
        raise AttributeError(f"module {torch_name!r} (torchwire stand-in) has no "
                             f"attribute {name!r}")

    __getattr__.__compat_fallback__ = True   # type: ignore[attr-defined]
    return __getattr__


def _stand_in(torch_name: str) -> types.ModuleType:
    """torchwire's module for ``torch_name``, or an empty one whose names are Missing."""
    module = _find(TARGETS.get(torch_name, ()))
    if module is None:
        module = types.ModuleType(torch_name, f"torchwire has no stand-in for {torch_name}")
        module.__path__ = []   # lets ``import torch.distributed.autograd.x`` reach the finder
        RESOLVED[torch_name] = "<missing>"
    else:
        RESOLVED[torch_name] = module.__name__
    if not getattr(getattr(module, "__getattr__", None), "__compat_fallback__", False):
        module.__getattr__ = _fallback_getattr(torch_name, module)
    return module


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torch.distributed.rpc.<anything>`` imported later, as a stand-in."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIXES) and fullname not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _stand_in(spec.name)

    def exec_module(self, module):
        pass


def install() -> dict[str, str]:
    """Rebind torch's RPC modules to torchwire's; idempotent.  Returns what maps to what."""
    global _installed
    if _installed:
        return RESOLVED
    import torch.distributed as dist
    # Import torch's users of RPC first, so that their own internals keep torch's modules.
    import torch.distributed.nn  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.rpc  # noqa: F401

    for name in list(sys.modules):
        if name in TARGETS or name.startswith(_PREFIXES):
            REAL[name] = sys.modules[name]
    for name in TARGETS:
        if name not in REAL:
            try:
                REAL[name] = importlib.import_module(name)
            except ImportError:
                pass
    for name in sorted(set(TARGETS) | set(REAL), key=lambda n: n.count(".")):
        module = _stand_in(name)
        sys.modules[name] = module   # submodules are reached through the fallback
    dist.rpc = sys.modules["torch.distributed.rpc"]
    dist.autograd = sys.modules["torch.distributed.autograd"]

    for (package, attr), candidates in CLASS_TARGETS.items():
        module = _find(candidates)
        value = getattr(module, attr, None) if module is not None else None
        if value is None:
            value = Missing(f"{package}.{attr}")
        RESOLVED[f"{package}.{attr}"] = (f"{module.__name__}.{attr}"
                                         if not isinstance(value, Missing) else "<missing>")
        setattr(importlib.import_module(package), attr, value)

    sys.meta_path.insert(0, _StandInFinder())
    _installed = True
    assert torch.distributed.rpc is sys.modules["torch.distributed.rpc"]
    return RESOLVED
