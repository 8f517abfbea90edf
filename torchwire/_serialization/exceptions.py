"""The exception codec: a remote exception as plain strings, rebuilt on the caller.

An error reply carries the exception's type (module and qualified name), a message
that starts ``On WorkerInfo(id=1, name=worker1):`` (torch's form), the worker and the
remote traceback, pickled as a tuple of strings: the caller can always decode it,
even when it cannot import the exception's type.
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import torch

from .._base.errors import RemoteError

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def dumps_exception(exc: BaseException, worker_desc: str, tb_text: str) -> bytes:
    """Describe an exception with plain strings, so the caller can always decode it."""
    cls = type(exc)
    # str(), not repr(): keeps the message's own newlines instead of "\\n" escapes
    try:
        text = str(exc)
    except Exception as bad:  # the user's __str__ failed: the caller still learns the type
        text = f"<str() raised {type(bad).__qualname__}>"
    message = f"On {worker_desc}:\n{cls.__name__}({text})\n{tb_text}"
    return pickle.dumps((cls.__module__, cls.__qualname__, message, worker_desc, tb_text),
                        protocol=_PROTOCOL)


def loads_exception(payload) -> BaseException:
    """Rebuild a remote exception: same type where possible, else :class:`RemoteError`."""
    try:
        module, qualname, message, worker_desc, tb_text = pickle.loads(payload)
    except Exception as exc:
        return RemoteError(f"undecodable remote error: {exc}")
    cls: Any = None
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except Exception:
        cls = None
    exc_obj: BaseException | None = None
    if cls is torch.jit.Error:
        # A TorchScript function failed: torch's RPC raises a RuntimeError for it (the
        # interpreter's error is not one), with the script's own error in the message.
        cls = None
        exc_obj = RemoteError(message, remote_type=f"{module}.{qualname}",
                              worker_name=worker_desc, remote_traceback=tb_text)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            exc_obj = cls(message)
        except Exception:
            exc_obj = None
        if exc_obj is not None and not _readable(exc_obj):
            exc_obj = _with_plain_str(cls, message)
    if exc_obj is None:
        exc_obj = RemoteError(f"Original exception on remote side was {module}.{qualname} "
                              f"(it could not be rebuilt here): {message}",
                              remote_type=f"{module}.{qualname}",
                              worker_name=worker_desc, remote_traceback=tb_text)
    else:
        try:
            exc_obj.remote_traceback = tb_text  # type: ignore[attr-defined]
            exc_obj.worker_name = worker_desc  # type: ignore[attr-defined]
        except Exception:
            pass
    return exc_obj


def _readable(exc: BaseException) -> bool:
    try:
        str(exc)
        return True
    except Exception:
        return False


def _with_plain_str(cls: type, message: str) -> BaseException | None:
    """``cls(message)`` whose ``str()`` is ``message``, for a class whose ``__str__``
    fails (every handler that logs it would fail in turn): a subclass of the same name,
    so ``except cls`` still catches it.  None if even that cannot be made."""
    try:
        plain = type(cls.__name__, (cls,), {"__str__": BaseException.__str__,
                                            "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
        exc = plain(message)
        return exc if _readable(exc) else None
    except Exception:
        return None
