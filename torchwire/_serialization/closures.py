"""Functions and classes by value: when, and what to blame when even that fails.

The RPC pickler sends a function or class by reference (its module and name), as
pickle does: the callee imports it.  What cannot be found that way - a lambda, a
nested function, a closure, a class defined in a function - or what lives in the
``__main__`` of an interactive session (a notebook cell, a REPL, ``python -c``),
which no other process can import, is sent by value with cloudpickle instead
(``pickler.py`` retries the message with a cloudpickle-based pickler).

A ``__main__`` run from a file keeps travelling by reference, as with torch: every
worker of such a job usually runs that file, and a class the callee already has
stays the same class there (``isinstance`` holds).

When a message cannot be pickled even by value, :func:`culprit` names the part that
fails, so the error says which argument (and which attribute, item or captured
variable of it) to fix.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

_MAX_DEPTH = 4  # levels culprit() looks into: argument, attribute, item, ...
_MAX_ITEMS = 64  # items of one container it tries


class ByValue(Exception):
    """Raised by the reference pickler for an object it must not send by reference:
    the message is pickled again, by value."""


def interactive_main() -> bool:
    """Whether ``__main__`` was not run from a file (a notebook, a REPL, ``-c``):
    what is defined there cannot be imported by another process."""
    main = sys.modules.get("__main__")
    return main is None or getattr(main, "__file__", None) is None


def by_value(obj: Any) -> bool:
    """Whether a function or class must travel by value although pickle could name
    it: it lives in an interactive ``__main__``."""
    return getattr(obj, "__module__", None) == "__main__" and interactive_main()


def main_by_reference(obj: Any) -> bool:
    """Whether a function or class of a file-run ``__main__`` can keep travelling by
    reference in a message pickled by value (a lambda in it): cloudpickle would send
    every ``__main__`` function and class by value, with the globals they use, so the
    callee would run copies, and instances would be of a copied class."""
    if getattr(obj, "__module__", None) != "__main__" or interactive_main():
        return False
    found: Any = sys.modules["__main__"]
    for part in getattr(obj, "__qualname__", "<>").split("."):
        found = getattr(found, part, None)  # "<locals>" finds nothing: by value
        if found is None:
            return False
    return found is obj


def culprit(obj: Any, can_pickle: Callable[[Any], bool]) -> str | None:
    """Where in ``obj`` pickling fails, as ``"args[1].lock (a _thread.lock)"``, or
    None if no single part can be blamed.

    A call's message ``(func, args, kwargs)`` is described as ``func``,
    ``args[i]`` and ``kwargs['k']``; another value from ``value``.
    """
    if (type(obj) is tuple and len(obj) == 3 and callable(obj[0])
            and (obj[1] is None or type(obj[1]) is tuple)
            and (obj[2] is None or type(obj[2]) is dict)):
        func, args, kwargs = obj
        parts: list[tuple[str, Any]] = [("the function " + _name(func), func)]
        parts += [(f"args[{i}]", a) for i, a in enumerate(args or ())]
        parts += [(f"kwargs[{k!r}]", v) for k, v in (kwargs or {}).items()]
        for label, part in parts:
            if not can_pickle(part):
                return _deepest(label, part, can_pickle, 1)
        return None
    return _deepest("value", obj, can_pickle, 0)


def _deepest(label: str, obj: Any, can_pickle: Callable[[Any], bool], depth: int) -> str:
    if depth < _MAX_DEPTH:
        for sub_label, sub in _parts(obj):
            if not can_pickle(sub):
                return _deepest(label + sub_label, sub, can_pickle, depth + 1)
    t = type(obj)
    return f"{label} (a {t.__module__}.{t.__qualname__})"


def _parts(obj: Any):
    """``(label suffix, part)`` of what ``obj`` is made of, as pickle would see it."""
    if isinstance(obj, (tuple, list, set, frozenset)):
        for i, item in enumerate(list(obj)[:_MAX_ITEMS]):
            yield f"[{i}]", item
    elif isinstance(obj, dict):
        for k in list(obj)[:_MAX_ITEMS]:
            yield f"[{k!r}]", obj[k]
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield f" (its captured variable {name!r})", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for name in code.co_names:
            if name in obj.__globals__:
                yield f" (its global {name!r})", obj.__globals__[name]
    elif hasattr(obj, "func") and hasattr(obj, "args") and hasattr(obj, "keywords"):
        yield ".func", obj.func  # functools.partial
        for i, a in enumerate(obj.args):
            yield f".args[{i}]", a
        for k, v in obj.keywords.items():
            yield f".keywords[{k!r}]", v
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for k in list(state)[:_MAX_ITEMS]:
                yield f".{k}", state[k]


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or \
        type(func).__name__
