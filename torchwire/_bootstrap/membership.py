"""Dynamic groups: ``init_rpc`` without ``world_size``; members join and leave at will.

The rendezvous store holds the group (under its session's prefix, as a static
job's keys: ``sessions.py``; JSON, never pickles)::

    group        "dynamic"; a static member in this store is refused, and the
                 other way round (rendezvous.claim_group_kind)
    job          the job token: the first member creates it (compare_set), the
                 others read it; secret and key as a static job's (_wire/auth.py)
    dyn/lock     the membership lock: "" when free, else its holder's
                 {name, rank, host, tcp, unix, token}
    dyn/members  {rank: record} of the members of now

Join (``init_rpc``; every wait within the init timeout)::

    1. claim the group's kind; take dyn/lock
    2. read the job token (or create it) and dyn/members.  A member holding our
       rank or name whose listener refuses connections died without leaving: it
       is dropped; a live one is an error.  Security settings and device maps
       are checked against every member: a disagreement fails this worker only.
    3. write dyn/members with us in it; start serving
    4. call _member_joined(record) on every member, in parallel: each adds us to
       its name table.  A member found gone is dropped from dyn/members; one that
       does not answer in time fails the join, which is then undone as a leave.
    5. release dyn/lock: init_rpc returns, every member knows us

A member that accepts a connection from a rank reads that rank's record in
dyn/members (the joiner's first call comes before its _member_joined).

Leave (graceful ``shutdown``)::

    1. take dyn/lock (the store gone, or the lock not had within the init
       timeout: go on without it and warn; a later joiner drops us from
       dyn/members when it finds us gone)
    2. delete our user RRefs; wait until no call of ours is pending
    3. remove us from dyn/members
    4. call _member_left(rank) on every member, in parallel: each stops calling
       us at once, waits for its calls in flight to us (we still serve them),
       fails what remains, forgets us (RRefs included) and replies
    5. wait for what serving those last calls made us send; release dyn/lock
    6. the store's host (rank 0 of tcp:// or env:// without torchrun's agent
       store) waits until the other members have left or died: they need it

The lock: ``compare_set(dyn/lock, "", holder)``.  While another holds it, poll;
every second, probe the holder's listener: one that refuses connections belongs
to a dead process, and its lock is taken over with ``compare_set(dyn/lock, its
value, ours)``.  A live holder is waited for until the deadline, then named.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from .._base import devices as _devices
from .._agent.runtime import current
from .._base.errors import RendezvousError, RpcStateError, RpcTimeoutError, WorkerUnavailableError
from .rendezvous import claim_group_kind, security_disagreement
from .._base.worker_record import WorkerRecord
from .._wire.listener import host_identity, listener_alive

log = logging.getLogger("torchwire")

LOCK = "dyn/lock"
MEMBERS = "dyn/members"
_PROBE_PERIOD = 1.0  # seconds between liveness probes of a lock holder or a member
_MIN_NOTICE = 2.0  # seconds a member gets to answer _member_left, even past the deadline
_LEFT = "it left the RPC group (shutdown)"



class StoreLock:
    """The group's membership lock (see the module docstring).

    Args:
        store: the prefixed rendezvous store.
        holder: this worker's record (name, rank and listener addresses are kept).
    """

    def __init__(self, store, holder: dict) -> None:
        self._store = store
        mine = {k: holder.get(k) for k in ("name", "rank", "host", "tcp", "unix")}
        mine["token"] = secrets.token_hex(8)
        self._mine = json.dumps(mine, sort_keys=True)
        self._host = holder.get("host") or host_identity()
        self.held = False

    def __repr__(self) -> str:
        return f"<StoreLock {LOCK} held={self.held}>"

    def acquire(self, deadline: float, budget: float) -> None:
        """Take the lock before ``deadline`` (``budget``: its length, for messages).

        Raises:
            RendezvousError: another live worker held it until the deadline, or the
                store failed.
        """
        delay = 0.001
        next_probe = time.monotonic() + _PROBE_PERIOD
        while True:
            found = self._swap("", "taking")
            if found == "":
                self.held = True
                return
            now = time.monotonic()
            if now >= next_probe:
                holder = _holder(found)
                probe = max(0.05, min(2.0, deadline - now))  # never far past the deadline
                if holder is not None and not _alive(holder, self._host, probe):
                    if self._swap(found, "taking over") == found:
                        self.held = True
                        log.warning("torchwire: took over the group's membership lock from "
                                    "%s (rank %s), whose process is gone", holder.get("name"),
                                    holder.get("rank"))
                        return
                next_probe = time.monotonic() + _PROBE_PERIOD
                continue
            if now >= deadline:
                holder = _holder(found) or {}
                raise RendezvousError(
                    f"could not take the dynamic group's membership lock within {budget:g}s: "
                    f"worker {holder.get('name')} (rank {holder.get('rank')}) holds it while "
                    "it joins or leaves, and is alive; joins and leaves are serialized")
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.05)

    def _swap(self, expected: str, doing: str) -> str:
        """compare_set ``expected`` -> ours.

        Returns:
            ``expected`` if the lock is ours now, else the value that holds it.
        """
        try:
            found = self._store.compare_set(LOCK, expected, self._mine).decode()
        except Exception as exc:
            raise RendezvousError(f"the rendezvous store failed while {doing} the dynamic "
                                  f"group's membership lock: {exc}") from exc
        return expected if found == self._mine else found

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self._store.compare_set(LOCK, self._mine, "")
        except Exception as exc:  # the store is gone: so is the lock
            log.debug("torchwire: releasing the membership lock failed: %s", exc)


def _alive(rec: dict, my_host: str, timeout: float = 2.0) -> bool:
    """Is the listener of the worker a store entry (a member, a lock holder) names there?"""
    unix = rec.get("unix") if rec.get("host") == my_host else None
    return listener_alive(rec["tcp"], unix, timeout)


def _holder(value: str) -> dict | None:
    try:
        holder = json.loads(value)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def read_members(store) -> dict[int, dict]:
    """``{rank: record}`` of the group's members as the store has them now."""
    raw = store.compare_set(MEMBERS, "", "{}")  # creates the table if there is none
    return {int(rank): rec for rank, rec in json.loads(raw).items()}


def _write_members(store, members: dict[int, dict]) -> None:
    store.set(MEMBERS, json.dumps({str(rank): rec for rank, rec in sorted(members.items())}))


def join(store, record: dict, deadline: float, budget: float, hosts_store: bool) -> Membership:
    """Steps 1-3 of a join (module docstring): on return this worker is in the
    store's member table and holds the lock, which :meth:`Membership.attach` releases.

    Args:
        record: this worker's rendezvous record.
        deadline: when the init timeout (``budget`` seconds) ends.
        hosts_store: the store lives in this process (it must leave last).

    Raises:
        RendezvousError: a static group in this store, the lock not had in time,
            rank or name held by a live member, security settings that differ, the
            store failed.
        ValueError: device maps that do not fit the members' devices.
    """
    claim_group_kind(store, "dynamic")
    lock = StoreLock(store, record)
    lock.acquire(deadline, budget)
    try:
        try:
            job = bytes.fromhex(store.compare_set("job", "", secrets.token_hex(16)).decode())
            members = read_members(store)
        except Exception as exc:
            raise RendezvousError(f"rendezvous store failed: {exc}") from exc
        _drop_dead_holders(members, record)
        problem = security_disagreement(list(members.values()) + [record])
        if problem:
            raise RendezvousError(problem + " (this worker was not let into the group)")
        _devices.check_all([WorkerRecord.from_json(r) for r in members.values()]
                           + [WorkerRecord.from_json(record)], dynamic=True)
        members[record["rank"]] = record
        try:
            _write_members(store, members)
        except Exception as exc:
            raise RendezvousError(f"rendezvous store failed: {exc}") from exc
    except BaseException:
        lock.release()
        raise
    return Membership(store, lock, record, members, job, budget, hosts_store)


def _drop_dead_holders(members: dict[int, dict], record: dict) -> None:
    """Free our rank and name from members that died without leaving.

    Raises:
        RendezvousError: a live member holds them.
    """
    me = record.get("host")
    for rank, rec in sorted(members.items()):
        if rank != record["rank"] and rec["name"] != record["name"]:
            continue
        if _alive(rec, me):
            if rank == record["rank"]:
                raise RendezvousError(
                    f"rank {rank} is already taken by worker {rec['name']!r} of this dynamic "
                    "group; every member needs a rank of its own")
            raise RendezvousError(
                f"worker name {record['name']!r} is already used by rank {rank} of this "
                "dynamic group; every member needs a unique name")
        log.warning("torchwire: %s (rank %d) is gone without leaving the group; %s takes its "
                    "place", rec["name"], rank, record["name"])
        if rank == record["rank"] and rec["name"] == record["name"]:  # it restarted
            record["incarnation"] = int(rec.get("incarnation") or 0) + 1
        del members[rank]


class Membership:
    """This worker's part in a dynamic group: admits, announces, leaves.

    Made by :func:`join`; :meth:`attach` hands it the started agent.
    """

    def __init__(self, store, lock: StoreLock, record: dict, members: dict[int, dict],
                 job: bytes, budget: float, hosts_store: bool) -> None:
        self._store = store
        self._lock = lock
        self.record = record
        self.rank = record["rank"]
        self.records = [WorkerRecord.from_json(rec) for _rank, rec in sorted(members.items())]
        self.job = job
        self._budget = budget
        self._hosts_store = hosts_store
        self.agent = None
        self.left = False  # it left the group (graceful shutdown)

    def __repr__(self) -> str:
        return (f"<Membership {self.record['name']} rank={self.rank} lock={self._lock.held} "
                f"hosts_store={self._hosts_store}>")

    # ------------------------------------------------------------------ join

    def abort(self) -> None:
        """The agent could not be built: take us out of the table, free the lock."""
        if self._lock.held:
            self._remove_self()
        self._lock.release()

    def bind(self, agent) -> None:
        """The agent this membership admits connections for (before it serves)."""
        self.agent = agent

    def attach(self, deadline: float) -> None:
        """Step 4-5 of a join: tell every member, then release the lock.

        Raises:
            RendezvousError: a member did not answer in time; this worker has left the
                group again and its agent is closed.
        """
        agent = self.agent
        try:
            self._announce(deadline)
        except BaseException:
            try:
                agent.shutdown(True, max(_MIN_NOTICE, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("torchwire: %s: undoing its join failed: %s", agent.name, exc)
            raise
        finally:
            self._lock.release()

    def _announce(self, deadline: float) -> None:
        agent = self.agent
        calls = self._call_members(_member_joined, (self.record,),
                                   max(0.001, deadline - time.monotonic()))
        gone, silent = [], []
        for info, fut in calls:
            try:
                fut.wait()
            except (WorkerUnavailableError, RpcStateError):
                gone.append(info)
            except RpcTimeoutError:
                silent.append(info)
        if gone:  # died without leaving: out of the table and of every member's view
            why = f"it is gone (its process ended without leaving; found when {agent.name} joined)"
            for info in gone:
                log.warning("torchwire: %s found %s gone while joining; dropped it from the "
                            "group", agent.name, info.name)
                agent.remove_member(info.id, time.monotonic(), why)
            try:
                members = read_members(self._store)
                for info in gone:
                    members.pop(info.id, None)
                _write_members(self._store, members)
            except Exception as exc:
                raise RendezvousError(f"rendezvous store failed: {exc}") from exc
            timeout = max(0.001, deadline - time.monotonic())
            calls = [c for info in gone
                     for c in self._call_members(_member_left, (info.id, 0.0, why), timeout)]
            for info, fut in calls:
                try:
                    fut.wait()
                except Exception as exc:  # it learns of the loss by itself then
                    log.debug("torchwire: telling %s of a lost member failed: %s", info.name,
                              exc)
        if silent:
            names = ", ".join(i.name for i in silent)
            raise RendezvousError(
                f"member(s) {names} did not acknowledge {agent.name}'s join within the init "
                f"timeout of {self._budget:g}s; {agent.name} left the group again")

    def admit(self, rank: int, peer):
        """Handshake thread: the member an authenticated connection from ``rank``
        comes from, by the store's table (``peer``: what the agent knows of it).

        Returns:
            its ``_Peer``, or None if ``rank`` is not a member.
        """
        try:
            record = read_members(self._store).get(rank)
        except Exception as exc:  # the store is gone: what we know is all there is
            log.debug("torchwire: reading the member table failed: %s", exc)
            return peer
        if record is None:  # not (or no longer) in the table; known here: it is leaving
            return peer
        record = WorkerRecord.from_json(record)
        if peer is not None and peer.record == record:
            return peer
        return self.agent.add_member(record)

    # ------------------------------------------------------------------ leave

    def leave(self, deadline: float) -> None:
        """Graceful shutdown of a member: leave the group (module docstring).

        Raises:
            RpcTimeoutError: calls of ours still pending at ``deadline``, or (the
                store's host) members that had not left by then.
        """
        agent = self.agent
        if not self._lock.held:
            try:
                self._lock.acquire(min(deadline, time.monotonic() + self._budget), self._budget)
            except RendezvousError as exc:
                log.warning("torchwire: %s leaves the group without its membership lock: %s",
                            agent.name, exc)
        error = None
        try:
            # torch deletes a worker's user RRefs when it shuts down; the owners must
            # hear of it while this worker is still a member.
            agent.all_arrived()
            try:
                agent.settle(deadline)
            except RpcTimeoutError as exc:
                error = exc  # tell the members all the same: they must stop calling us
            if self._lock.held:
                self._remove_self()
            left = deadline - time.monotonic()
            notice = None if left == float("inf") else max(0.0, left)
            timeout = 0 if notice is None else notice + _MIN_NOTICE
            for info, fut in self._call_members(_member_left, (self.rank, notice), timeout):
                try:
                    fut.wait()
                except WorkerUnavailableError:
                    pass  # gone: it has nothing to forget
                except Exception as exc:
                    log.warning("torchwire: %s could not tell %s that it leaves the group: %s",
                                agent.name, info.name, exc)
            if error is None:
                agent.settle(deadline)
        finally:
            self._lock.release()
            self.left = True
        if error is not None:
            raise error
        if self._hosts_store:
            self._wait_until_last(deadline)

    def _remove_self(self) -> None:
        try:
            members = read_members(self._store)
            if members.pop(self.rank, None) is not None:
                _write_members(self._store, members)
        except Exception as exc:
            log.warning("torchwire: %s could not take itself out of the group's member table: "
                        "%s", self.record["name"], exc)

    def _wait_until_last(self, deadline: float) -> None:
        """The store lives in this process: keep it up until no live member is left."""
        me = self.record.get("host")
        dead: set[int] = set()
        next_probe = time.monotonic()
        delay = 0.001
        while True:
            try:
                others = {r: rec for r, rec in read_members(self._store).items()
                          if r != self.rank and r not in dead}
            except Exception as exc:
                log.warning("torchwire: %s: the member table is gone: %s", self.record["name"],
                            exc)
                return
            if not others:
                return
            now = time.monotonic()
            if now >= next_probe:
                probe = max(0.05, min(2.0, deadline - now))
                dead.update(r for r, rec in others.items()
                            if not _alive(rec, me, probe))
                next_probe = time.monotonic() + _PROBE_PERIOD
                continue
            if now >= deadline:
                names = ", ".join(rec["name"] for rec in others.values())
                raise RpcTimeoutError(
                    f"graceful shutdown of {self.record['name']} timed out: it hosts the "
                    f"group's rendezvous store, and member(s) {names} have not left yet")
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.05)

    # ------------------------------------------------------------------ helpers

    def _call_members(self, func, args, timeout: float) -> list:
        """Call ``func(*args)`` on every other member at once: ``[(info, future)]``."""
        agent = self.agent
        return [(info, agent.call(info, func, args, None, timeout))
                for info in agent.get_worker_infos() if info.id != self.rank]


def _local() -> Membership:
    rt = current.runtime
    m = rt.membership if rt is not None else None
    if m is None or m.left or m.agent.closed:
        raise RpcStateError("this worker is not a member of a dynamic RPC group")
    return m


def _member_joined(record: dict) -> None:
    """Runs on every member when ``record``'s worker joins (step 4 of a join)."""
    _local().agent.add_member(WorkerRecord.from_json(record))


def _member_left(rank: int, notice: float | None, why: str = _LEFT) -> None:
    """Runs on every member when ``rank`` leaves (step 4 of a leave), or was found gone
    by a joiner; returns once this member has no call in flight to it (or ``notice``
    seconds have passed)."""
    deadline = float("inf") if notice is None else time.monotonic() + notice
    _local().agent.remove_member(rank, deadline, why)


__all__ = ["Membership", "StoreLock", "join", "read_members"]
