"""The name table: the job's workers by rank and by name, and those that left.

A static job's table never changes.  A dynamic group's (``world_size`` None) changes
as members join and leave: the table is *replaced*, never changed in place, so that
readers (every call looks its destination up) need no lock; changes are serialized
by one lock.  Members that left, or were found gone, are remembered with the reason,
so a call to one fails naming it and why.
"""

from __future__ import annotations

import threading

from .._base.errors import UnknownWorkerError, WorkerUnavailableError
from .._base.worker_info import WorkerInfo
from .._base.worker_record import WorkerRecord


class Member:
    """A worker of the job: who it is and what it published."""

    __slots__ = ("info", "record")

    def __init__(self, record: WorkerRecord) -> None:
        self.info = WorkerInfo(record.name, record.rank)
        self.record = record

    def __repr__(self) -> str:
        return f"<Member {self.info.name} rank={self.info.id}>"


class NameTable:
    """Who is in the job (see the module docstring)."""

    def __init__(self, records: list[WorkerRecord]) -> None:
        members = [Member(r) for r in records]
        # rank -> Member and name -> WorkerInfo, each replaced whole on a change: readers
        # (every call looks its destination up) may use them without the lock
        self.by_rank: dict[int, Member] = {m.info.id: m for m in members}
        self.by_name: dict[str, WorkerInfo] = {m.info.name: m.info for m in members}
        # dynamic groups: who left or was found gone, and why (for errors)
        self._departed: dict[int, tuple[WorkerInfo, str]] = {}
        self._departed_names: dict[str, tuple[WorkerInfo, str]] = {}
        self._lock = threading.Lock()  # serializes changes

    def __repr__(self) -> str:
        return f"<NameTable members={len(self.by_rank)} departed={len(self._departed)}>"

    def __len__(self) -> int:
        return len(self.by_rank)

    def member(self, rank: int) -> Member | None:
        return self.by_rank.get(rank)

    def members(self) -> list[Member]:
        return list(self.by_rank.values())

    def infos(self) -> list[WorkerInfo]:
        """Every member, by rank."""
        return sorted(m.info for m in self.by_rank.values())

    def lookup(self, to) -> WorkerInfo:
        """The member that ``to`` (a name, rank or WorkerInfo) names.

        Raises:
            UnknownWorkerError: no member has that name, rank or WorkerInfo.
            WorkerUnavailableError: (dynamic groups) it names a member that left.
            ValueError: ``to`` is none of those.
        """
        if isinstance(to, WorkerInfo):
            m = self.by_rank.get(to.id)
            if m is None or m.info != to:
                gone = self._departed.get(to.id)
                raise self._not_member(repr(to), gone if gone and gone[0] == to else None)
            return m.info
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                raise self._not_member(to, self._departed_names.get(to))
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            m = self.by_rank.get(to)
            if m is None:
                raise self._not_member(f"rank {to}", self._departed.get(to))
            return m.info
        name, rank = getattr(to, "name", None), getattr(to, "id", None)
        if isinstance(name, str) and isinstance(rank, int):  # torch's own WorkerInfo
            return self.lookup(WorkerInfo(name, rank))
        raise ValueError(f"Cannot get WorkerInfo from {to!r}: pass a worker name, rank or "
                         "WorkerInfo")

    def name_of(self, rank: int) -> str:
        """The name of ``rank``, a member or one that left (for messages)."""
        m = self.by_rank.get(rank)
        if m is not None:
            return m.info.name
        gone = self._departed.get(rank)
        return gone[0].name if gone is not None else f"<rank {rank}>"

    def unavailable(self, rank: int, why: str) -> WorkerUnavailableError:
        """The error of a call to ``rank`` that cannot be made or completed, and why."""
        name = self.name_of(rank)
        return WorkerUnavailableError(f"worker {name} (rank {rank}) is unavailable: {why}",
                                      worker_name=name, reason=why)

    def gone_error(self, rank: int) -> WorkerUnavailableError:
        gone = self._departed.get(rank)
        return self.unavailable(rank, gone[1] if gone else "it is not a member of the group")

    def _not_member(self, what: str, gone: tuple[WorkerInfo, str] | None):
        if gone is None:
            # "could not find destination" is torch's phrase; ported error handling
            # matches on it
            return UnknownWorkerError(f"Unknown destination worker {what}: could not find "
                                      f"destination name {what} among this job's workers")
        return self.unavailable(gone[0].id, gone[1])

    # ------------------------------------------------------------------ changes

    def add(self, record: WorkerRecord) -> tuple[Member, Member | None]:
        """Add a member (a dynamic group gained it).

        Returns:
            ``(its Member, None)``; or, when a *different* worker holds its rank or
            name (it died without leaving and the group gave them to the newcomer),
            ``(None, that Member)``: drop it with :meth:`remove`, then add again.  A
            record already in the table returns its Member.
        """
        info = WorkerInfo(record.name, record.rank)
        with self._lock:
            old = self.by_rank.get(info.id)
            if old is not None and old.record == record:
                return old, None
            named = self.by_name.get(info.name)
            if old is None and named is not None:
                old = self.by_rank.get(named.id)
            if old is not None:
                return None, old
            member = Member(record)
            self.by_rank = {**self.by_rank, info.id: member}
            self.by_name = {**self.by_name, info.name: info}
            self._departed.pop(info.id, None)
            self._departed_names.pop(info.name, None)
            return member, None

    def remove(self, member: Member, why: str) -> bool:
        """Take ``member`` out (remembering ``why``); False if it was not in the table."""
        rank = member.info.id
        with self._lock:
            if self.by_rank.get(rank) is not member:
                return False
            self.by_rank = {r: m for r, m in self.by_rank.items() if r != rank}
            self.by_name = {n: i for n, i in self.by_name.items() if i.id != rank}
            self._departed[rank] = self._departed_names[member.info.name] = (member.info, why)
            return True


class MessageLimits:
    """The largest frame that may go to each member: the smaller of its published
    ``max_message_size`` and this worker's (a larger frame would cost the receiver
    its connection, so the sender refuses it first, naming both).

    Args:
        own: this worker's ``max_message_size``.
        names: the group's :class:`NameTable`.
    """

    def __init__(self, own: int, names: NameTable) -> None:
        self._own = own
        self._names = names
        self._of: dict[int, int] = {}
        self.smallest = own  # no frame this size or smaller needs a look
        self.reset()

    def __repr__(self) -> str:
        return f"<MessageLimits own={self._own} smallest={self.smallest}>"

    def reset(self) -> None:
        """The members changed."""
        self._of = {}
        self.smallest = min([self._own] + [m.record.max_message_size
                                           for m in self._names.members()
                                           if m.record.max_message_size])

    def of(self, rank: int) -> int:
        limit = self._of.get(rank)
        if limit is None:
            member = self._names.member(rank)
            theirs = member.record.max_message_size if member is not None else 0
            limit = min(theirs, self._own) if theirs > 0 else self._own
            self._of[rank] = limit
        return limit
