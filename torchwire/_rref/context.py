"""The RRef context: one per RPC runtime; the owner's table, user forks, pickling.

Owner side: an *entry* per value (:class:`~.records.Entry`).  Entries with forks
elsewhere are held in ``_owned``; entries held only by local RRef objects live in a
weak table, so a value dies with its last reference anywhere.  A deletion that
overtakes its fork's registration leaves a tombstone (``_dead_forks``); a value whose
last fork is gone is remembered as deleted, so a stale reference is refused instead
of waiting on an empty entry.

User side: one :class:`~.records.UserState` per fork held here (``_users``), and the
children this worker forked and must keep until their owner knows them
(``_children``, G2).  Control messages go through the :class:`~.janitor.Janitor`.

The context is an agent plug-in (``torchwire._agent.runtime.AgentPlugin``): it settles
its control messages before each round of a graceful shutdown, deletes every user
RRef once all workers shut down (as torch does), and forgets what a lost peer held.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref

from .. import _serialization as ser
from .._agent.future import Future
from .._base.errors import RpcStateError, RRefError, WorkerUnavailableError
from .handlers import remote_exec
from .janitor import Janitor
from .records import Entry, Event, Id, UserState, context, fail_gate, gid, open_gate
from .rref import RRef

log = logging.getLogger("torchwire")

# The local ids of a worker's incarnation N start at N << 40: ids of RRefs made by a
# restarted worker never equal those of its predecessors (autograd's likewise).
INCARNATION_SHIFT = 40

_TOMBSTONES_MAX = 100_000


class RRefContext:
    """Per-runtime RRef state: the owner table, user forks, pending children."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.rank = agent.rank
        # a restarted worker's ids must not meet its predecessors' (still held elsewhere)
        self._ids = itertools.count(agent.incarnation << INCARNATION_SHIFT)
        self._lock = threading.Lock()
        self._owned: dict[Id, Entry] = {}  # entries with forks (held)
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._deleted: dict[Id, None] = {}  # rref ids freed for good
        self._dead_forks: dict[Id, None] = {}  # deleted before registered
        self._children: dict[Id, RRef] = {}  # forks sent, not yet accepted
        self._child_dest: dict[Id, int] = {}  # fork id -> the rank it was sent to
        self._users: dict[Id, UserState] = {}  # live user forks
        # what deletes every user RRef once all workers shut down (torch's public API
        # hands its own function down, which torch's tests patch)
        self.delete_users = self.delete_all_users
        self.janitor = Janitor(self)
        self.janitor.start()

    def __repr__(self) -> str:
        return (f"<RRefContext rank={self.rank} owned={len(self._owned)} "
                f"users={len(self._users)} children={len(self._children)} {self.janitor!r}>")

    def new_id(self) -> Id:
        return (self.rank, next(self._ids))

    def debug_info(self) -> dict[str, int]:
        """Counters, as torch's ``_rref_context_get_debug_info`` (plus torchwire's)."""
        with self._lock:
            return {
                "num_owner_rrefs": len(self._owned),
                "num_forks": sum(len(e.forks) for e in self._owned.values()),
                "num_live_values": len(self._owned) + sum(
                    1 for k in list(self._live.keys()) if k not in self._owned),
                "num_pending_users": sum(1 for s in self._users.values() if not s.confirmed),
                "num_pending_children": len(self._children),
                "num_user_rrefs": len(self._users),
                "num_pending_futures": self.janitor.pending(),
            }

    # owner table -------------------------------------------------------------------

    def adopt_local(self, entry: Entry) -> None:
        with self._lock:
            self._live[entry.rref_id] = entry

    def entry_for(self, rref_id: Id, creating: bool = False) -> Entry:
        """The live entry for ``rref_id``, created empty if it has not arrived yet.

        Raises:
            RRefError: the value was already deleted (every reference to it died).
        """
        with self._lock:
            entry = self._owned.get(rref_id) or self._live.get(rref_id)
            if entry is None:
                if rref_id in self._deleted and not creating:
                    raise RRefError(f"RRef {gid(rref_id)} owned by {self.agent.name} has "
                                    "already been deleted (no reference to it was left)")
                self._deleted.pop(rref_id, None)
                entry = Entry(rref_id)
                self._live[rref_id] = entry
            return entry

    def add_fork(self, entry: Entry, fork_id: Id, holder: int) -> bool:
        with self._lock:
            # Its deletion overtook it.  The tombstone stays (until trimmed): a FORK
            # retried after timeouts arrives several times, and the DEL of a fork its
            # holder gave up on may come before all of them (janitor.py).
            if fork_id in self._dead_forks:
                return False
            if self._holder_lost(holder):
                return False
            entry.forks[fork_id] = holder
            self._owned[entry.rref_id] = entry
            return True

    def create_with_fork(self, rref_id: Id, fork_id: Id, holder: int) -> Entry:
        """``remote_exec``: the entry (made now unless a fetch or fork made it first)
        with the creator's fork.  Held by the fork only: no weak-table entry."""
        with self._lock:
            entry = self._owned.get(rref_id) or self._live.get(rref_id)
            if entry is None:
                self._deleted.pop(rref_id, None)
                entry = Entry(rref_id)
            if self._dead_forks.pop(fork_id, None) is None and not self._holder_lost(holder):
                entry.forks[fork_id] = holder
                self._owned[rref_id] = entry
            return entry

    def _holder_lost(self, holder: int) -> bool:
        """``holder`` is down: ``peer_lost`` released (or is about to release) its forks,
        and its deletions will never come, so a fork of it registered now would leak (a
        ``remote()`` or FORK message it sent before dying, run only after the loss: its
        request waited for an argument's confirmation, or lost the race to a pool
        thread).  Read under ``_lock``: the agent marks the peer down before it runs
        ``peer_lost``, whose ``forks_of`` takes the lock, so a fork is either refused
        here or found there."""
        return holder != self.rank and self.agent.health.is_down(holder)

    def del_fork(self, rref_id: Id, fork_id: Id, tombstone: bool = False) -> None:
        """The holder's fork is gone.  A tombstone refuses the fork's FORK copies that
        come later: always left when ``tombstone`` (its FORK went more than once),
        else only when the fork is not registered (its deletion overtook it)."""
        with self._lock:
            entry = self._owned.get(rref_id)
            found = entry is not None and entry.forks.pop(fork_id, None) is not None
            if tombstone or not found:
                self._dead_forks[fork_id] = None
                self._trim()
            if not found:
                return
            if not entry.forks:
                self._owned.pop(rref_id, None)
                if entry.future.done():
                    # The last fork of a made value is gone: unless a local RRef still
                    # holds it (found in _live first), a later reference is stale.  Not
                    # so before the value is made: the creator's fork is registered by
                    # remote_exec, which may arrive after its children's forks came
                    # and went; it makes the entry anew.
                    self._deleted[rref_id] = None
                    self._trim()
        del entry  # may free the value here, outside the lock

    def _trim(self) -> None:
        for table in (self._dead_forks, self._deleted):
            while len(table) > _TOMBSTONES_MAX:
                table.pop(next(iter(table)))

    def forks_of(self, holder: int) -> list:
        with self._lock:
            return [(e.rref_id, f) for e in self._owned.values()
                    for f, h in e.forks.items() if h == holder]

    # user side ---------------------------------------------------------------------

    def forget_user(self, state: UserState) -> None:
        with self._lock:
            self._users.pop(state.fork_id, None)

    def fork_failed(self, state: UserState, cause: BaseException) -> None:
        """The owner will never confirm ``state``'s fork (its FORK message timed out
        every time, could not be sent, or failed): the RRef cannot be used.  Every use
        raises :meth:`owner_lost`'s error, naming the owner and ``cause``; so does the
        request waiting for the confirmation (its gate fails with that error).  The
        janitor forgets the fork itself (``Event.ABANDONED``)."""
        lost = self._loss(state.owner, cause)
        with self._lock:
            if state.lost is None:  # peer_lost may have been first: keep its cause
                state.lost = lost
        fail_gate(state, self.owner_lost(state))

    def _loss(self, rank: int, error: BaseException) -> tuple:
        """``UserState.lost`` for a fork whose owner ``rank`` was lost with ``error``."""
        member = self.agent.names.member(rank)  # None once a restart replaced it
        return (error, member.record.incarnation if member is not None else None)

    def drop_child(self, fork_id: Id) -> None:
        with self._lock:
            rref = self._children.pop(fork_id, None)
            self._child_dest.pop(fork_id, None)
        del rref  # outside the lock: may be the last reference

    # pickling ------------------------------------------------------------------------

    def reduce(self, rref: RRef):
        sent = ser.current_send()
        if sent is None:
            raise RRefError("Can not pickle rref in python pickler, rref can only be "
                            "pickled when using RPC")
        dest = sent.dest
        if rref._entry is not None:  # on the owner
            entry = rref._entry
            if dest == self.rank:
                sent.pins.append(rref)
                return rebuild_rref, (self.rank, entry.rref_id, None, self.rank, True)
            fork_id = self.new_id()
            self.add_fork(entry, fork_id, dest)
            sent.undo.append(lambda: self.del_fork(entry.rref_id, fork_id))
            return rebuild_rref, (self.rank, entry.rref_id, fork_id, self.rank, True)
        state = rref._user
        if state.deleted:
            raise RRefError("Cannot call fork an UserRRef after deletion.")
        if state.lost is not None:
            raise self.owner_lost(state)
        if dest == state.owner and sent.request:
            sent.pins.append(rref)  # the reply proves the owner has unpickled it
            return rebuild_rref, (state.owner, state.rref_id, None, self.rank, False)
        fork_id = self.new_id()
        with self._lock:
            self._children[fork_id] = rref
            self._child_dest[fork_id] = dest
        sent.undo.append(lambda: self.drop_child(fork_id))
        return rebuild_rref, (state.owner, state.rref_id, fork_id, self.rank, False)

    def rebuild(self, owner: int, rref_id: Id, fork_id, parent: int, confirmed: bool) -> RRef:
        if owner == self.rank:
            entry = self.entry_for(rref_id)
            if fork_id is not None:  # a user's fork came home in a reply: tell its parent
                self.janitor.put((Event.ACCEPT, parent, fork_id))
            return RRef._new_owner(self, entry)
        state = UserState(owner, rref_id, fork_id, confirmed)
        with self._lock:
            self._users[fork_id] = state
        if not confirmed:
            # As torch: a request's function runs once the owner has confirmed the
            # forks in its arguments, so inside it confirmed_by_owner() is True.
            gate = Future()
            if ser.add_gate(gate):
                state.gate = gate
            self.janitor.put((Event.FORK, state, parent))
            self.janitor.hurry()
        return RRef._new_user(self, state)

    # remote() ---------------------------------------------------------------------

    def remote(self, to, func, args, kwargs, timeout: float) -> RRef:
        agent = self.agent
        rref_id, fork_id = self.new_id(), self.new_id()
        if to.id == self.rank:
            entry = self.entry_for(rref_id, creating=True)
            fut = agent.call(to, remote_exec, (rref_id, None, self.rank, func, args, kwargs),
                             None, timeout)
            return RRef._new_owner(self, entry, fut)
        state = UserState(to.id, rref_id, fork_id, False)
        with self._lock:
            self._users[fork_id] = state
        fut = agent.call(to, remote_exec, (rref_id, fork_id, self.rank, func, args, kwargs),
                         None, timeout)
        janitor = self.janitor

        def confirm(f) -> None:  # on the reader thread: bookkeeping only
            try:
                f.value()
            except (WorkerUnavailableError, RpcStateError):
                janitor.put((Event.LOST, state))
                return
            except Exception:
                pass  # timed out (the deletion settles it either way) or the owner failed
            # see janitor.py: DELETED sets deleted, then reads confirmed
            state.confirmed = True
            if state.deleted:
                janitor.put((Event.CONFIRMED, state))
        fut._add_inline_callback(confirm)
        return RRef._new_user(self, state, fut)

    # agent plug-in -------------------------------------------------------------------

    def idle(self) -> bool:
        return self.janitor.idle()

    def settle(self, deadline: float) -> None:
        self.janitor.settle(deadline)

    def peer_lost(self, rank: int, error: BaseException) -> None:
        """The agent lost ``rank``: nothing it held or owned can be settled with it.

        * forks it held of values owned here are released (G1 cannot hold: its
          deletions will never come);
        * user RRefs it owns are forgotten here (no deletion to send); using one
          still raises the agent's ``WorkerUnavailableError`` naming it;
        * children forks sent to it, or of values it owns, are dropped (their
          "accept" will never come).
        """
        forks = self.forks_of(rank)
        for rref_id, fork_id in forks:
            self.del_fork(rref_id, fork_id)
        lost = self._loss(rank, error)
        with self._lock:
            users = [s for s in self._users.values() if s.owner == rank]
            for state in users:
                if state.lost is None:
                    state.lost = lost
            children = [f for f, d in self._child_dest.items() if d == rank]
            children += [f for f, r in self._children.items()
                         if r._user is not None and r._user.owner == rank]
        for state in users:
            self.janitor.put((Event.LOST, state))
            open_gate(state)
        for fork_id in children:
            self.drop_child(fork_id)
        log.debug("torchwire: rank %d lost (%s): released %d forks it held, forgot %d user "
                  "RRefs it owns, dropped %d children", rank, error, len(forks), len(users),
                  len(children))

    def owner_lost(self, state: UserState) -> WorkerUnavailableError:
        """The error every use of a user RRef whose owner was lost raises (a new one
        each time): naming the owner, and saying so when it has restarted since (the
        value died with the old process; the new one does not have it)."""
        error, incarnation = state.lost
        agent = self.agent
        name = agent.name_of(state.owner)
        member = agent.names.member(state.owner)
        if incarnation is not None and member is not None and \
                member.record.incarnation > incarnation:
            why = (f"it restarted: the value died with incarnation {incarnation}, and "
                   f"{member.record.describe()} does not have it")
        else:
            why = getattr(error, "reason", None) or str(error)
        return WorkerUnavailableError(
            f"RRef {gid(state.rref_id)} cannot be used: its owner, worker {name} (rank "
            f"{state.owner}), is unavailable: {why}", worker_name=name, reason=why)

    def all_arrived(self) -> None:
        """Every worker is shutting down: delete every user RRef (torch does the same)."""
        self.delete_users()

    def delete_all_users(self) -> None:
        with self._lock:
            states = list(self._users.values())
        for state in states:
            state.deleted = True  # at once: later use raises "... after deletion"
            self.janitor.put((Event.DELETED, state))

    def leaks(self) -> list[str]:
        with self._lock:
            owned = [f"{gid(e.rref_id)} (forks held by ranks "
                     f"{sorted(set(e.forks.values()))})" for e in self._owned.values()]
            users = [f"{gid(s.rref_id)} fork {gid(s.fork_id)}" for s in self._users.values()
                     if not s.deleted]
        return [f"owner RRef {o}" for o in owned] + [f"user RRef {u}" for u in users]

    def close(self) -> None:
        self.janitor.close()


# --------------------------------------------------------------------------- pickling


def rebuild_rref(owner, rref_id, fork_id, parent, confirmed):
    return context().rebuild(owner, rref_id, fork_id, parent, confirmed)


def _reduce_rref(rref: RRef):
    state = rref._user
    if state is not None and state.deleted:
        raise RRefError("Cannot call fork an UserRRef after deletion.")
    return rref._context().reduce(rref)


class _PlainRRef:
    """RRef arguments of plain calls (``ser.plain_call``): only a user RRef sent to its
    owner, which needs no fork (the owner finds its own RRef); the request pins it
    until the reply, as pickled."""

    rref_type = RRef

    @staticmethod
    def can(rref: RRef, dest: int) -> bool:
        state = rref._user
        return (state is not None and not state.deleted and state.lost is None
                and state.owner == dest)

    @staticmethod
    def encode(rref: RRef, send) -> tuple:
        send.pins.append(rref)
        return (rref._user.rref_id, context().rank)

    @staticmethod
    def decode(desc) -> RRef:
        rref_id, parent = desc
        ctx = context()
        return ctx.rebuild(ctx.rank, tuple(rref_id), None, parent, False)


ser.hooks.register_reducer(RRef, _reduce_rref)
ser.hooks.set_rref_codec(_PlainRRef())
