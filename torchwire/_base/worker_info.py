"""``WorkerInfo``: a worker's name and id (its rank), and torch's rule for names."""

from __future__ import annotations

import re

from .errors import InvalidWorkerNameError

_NAME_RE = re.compile(r"[A-Za-z0-9_:\-]+")
MAX_NAME_LEN = 128


def check_worker_name(name) -> None:
    """Apply torch's rule for worker names.

    Raises:
        ValueError: not a string, empty, too long, or has characters outside
            letters, digits, ``_``, ``-`` and ``:``.
    """
    # Messages keep torch's phrases ("must be non-empty", "shorter than 128",
    # "Worker name must match"): ported error handling matches on them.
    if not isinstance(name, str):
        raise InvalidWorkerNameError(f"worker name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidWorkerNameError("Worker name must be non-empty")
    if len(name) >= MAX_NAME_LEN:
        raise InvalidWorkerNameError(
            f"Worker name must be shorter than {MAX_NAME_LEN} characters, got {len(name)}")
    if not _NAME_RE.fullmatch(name):
        raise InvalidWorkerNameError(
            f"Worker name must match ^[A-Za-z0-9-_:]*$ (letters, digits, '_', '-', ':'), "
            f"got {name!r}")


class WorkerInfo:
    """The name and id of a worker, as ``torch.distributed.rpc.WorkerInfo``.

    Hashable, comparable (by id, then name) and picklable; pass it as ``to``
    to avoid a name lookup per call.

    Args:
        name: the worker's unique name.
        id: the worker's rank.
    """

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002 - torch's argument name
        check_worker_name(name)
        self.name = name
        self.id = id

    def __eq__(self, other) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return self.id == other.id and self.name == other.name

    def __lt__(self, other) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return (self.id, self.name) < (other.id, other.name)

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self):
        return WorkerInfo, (self.name, self.id)


WorkerInfo.__module__ = "torchwire.rpc"
