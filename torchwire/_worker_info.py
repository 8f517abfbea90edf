"""``WorkerInfo``: a worker's name and id (its rank)."""

from __future__ import annotations


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
        from ._rendezvous import check_worker_name
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
