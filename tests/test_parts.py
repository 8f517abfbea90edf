"""The runtime's parts on their own: the pending-call table, the name table, the hook
registry, worker records, plug-in checks, and the current runtime's lifecycle."""

from __future__ import annotations

import enum
import threading

import pytest

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world
from torchwire import _serialization as ser
from torchwire._agent.future import Future
from torchwire._agent.names import NameTable
from torchwire._agent.pending import PendingCalls
from torchwire._agent.runtime import current
from torchwire._base.worker_record import WorkerRecord


def _record(name: str, rank: int, **kw) -> WorkerRecord:
    return WorkerRecord(name, rank, "host", ("127.0.0.1", 1000 + rank), **kw)


class _FiringTimer:
    """A timer whose deadlines pass the moment they are armed."""

    def __init__(self, pending: PendingCalls) -> None:
        self.pending = pending

    def add(self, rid, deadline):
        self.pending._expire([rid])
        return 0

    def cancel(self, rid, tick):
        pass

    def stop(self):
        pass


def test_a_deadline_that_passes_as_it_is_armed_still_ends_its_call():
    pending = PendingCalls(lambda rank: f"worker{rank}")
    try:
        pending._timer.stop()
        pending._timer = _FiringTimer(pending)
        fut = Future()
        rid = pending.add(fut, 1, None, 0.001, len, None)
        assert fut.done() and len(pending) == 0
        with pytest.raises(torchwire.RpcTimeoutError, match="call to worker1: builtins.len"):
            fut.wait()
        # whoever pops the entry owns it: a reply after the timeout is dropped quietly
        pending.complete(rid, 0, b"", [])
        pending.fail(rid, RuntimeError("late"))
        with pytest.raises(torchwire.RpcTimeoutError):
            fut.wait()
    finally:
        pending.stop()


def test_pending_calls_fail_by_peer_or_connection_and_wait_until_idle():
    pending = PendingCalls(str)
    try:
        futs = [Future() for _ in range(3)]
        conn_a, conn_b = object(), object()
        pending.add(futs[0], 1, conn_a, 0, len, None)
        pending.add(futs[1], 2, conn_a, 0, len, None)
        pending.add(futs[2], 2, conn_b, 0, len, None)
        assert pending.to_peer(2) and not pending.to_peer(3)
        pending.fail_where(torchwire.WorkerUnavailableError("gone"), conn=conn_b)
        assert [f.done() for f in futs] == [False, False, True]
        pending.fail_where(torchwire.WorkerUnavailableError("gone"), peer=1)
        assert [f.done() for f in futs] == [True, False, True]
        done = threading.Event()
        threading.Thread(target=lambda: done.set() if pending.wait_idle(1e9) else None,
                         daemon=True).start()
        pending.fail_where(torchwire.RpcStateError("closed"))
        assert done.wait(10) and len(pending) == 0
    finally:
        pending.stop()


def test_the_name_table_finds_members_and_says_why_one_is_gone():
    table = NameTable([_record("a", 0), _record("b", 1)])
    assert table.lookup("b") == table.lookup(1) == rpc.WorkerInfo("b", 1)
    with pytest.raises(torchwire.UnknownWorkerError, match="could not find destination"):
        table.lookup("c")
    with pytest.raises(ValueError, match="pass a worker name, rank or WorkerInfo"):
        table.lookup(1.5)
    by_name = table.by_name
    assert table.remove(table.member(1), "it left the RPC group (shutdown)")
    assert "b" in by_name  # replaced whole, never changed in place: readers keep a copy
    with pytest.raises(torchwire.WorkerUnavailableError, match="worker b .* it left the RPC"):
        table.lookup("b")
    member, stale = table.add(_record("b2", 0))  # rank 0 is a's: a is dropped first
    assert member is None and stale.info.name == "a"


def test_the_hook_registry_refuses_a_plain_kind_claimed_twice():
    class Mine(enum.IntEnum):
        MINE = 200

    class Clash(enum.IntEnum):
        CLASH = int(ser.PlainKind.CALL)

    ser.hooks.register_plain(Mine.MINE, handler=lambda src, payload, tensors: None)
    assert ser.hooks.plain_handler(200) is not None
    with pytest.raises(ValueError, match="taken by PlainKind.CALL"):
        ser.hooks.register_plain(Clash.CLASH, handler=lambda src, payload, tensors: None)
    with pytest.raises(ValueError, match="a handler or a decoder"):
        ser.hooks.register_plain(Mine.MINE)


def test_worker_records_round_trip_through_json_and_refuse_garbage():
    rec = _record("w", 3, unix="\0sock", shm=True, devices=("cuda:0",))
    assert WorkerRecord.from_json(rec.to_json()) == rec
    for bad in ({}, {"name": "w", "rank": "3", "host": "h", "tcp": ["a", 1]},
                {"name": "w", "rank": 3, "host": "h", "tcp": "nope"}):
        with pytest.raises(torchwire.RendezvousError, match="malformed worker record"):
            WorkerRecord.from_json(bad)


def _runtime_lifecycle(rank, world_size, init_method):
    from _cluster import options
    assert current.runtime is None
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method))
    agent = rpc.api._get_current_rpc_agent()
    rt = current.runtime
    parts = (rt.agent is agent, agent.closed, type(rt.rrefs).__name__,
             type(rt.autograd).__name__)
    try:
        agent.add_plugin(object())
        refused = False
    except TypeError as exc:
        refused = "is not an AgentPlugin" in str(exc)
    rpc.shutdown()
    try:
        rpc.get_worker_info()
        after = "no error"
    except torchwire.RpcStateError as exc:
        after = str(exc)
    return parts, refused, current.runtime is None, agent.closed, after


def test_init_publishes_one_runtime_and_shutdown_clears_it():
    for parts, refused, cleared, closed, after in run_world(_runtime_lifecycle, 2,
                                                            init=False):
        assert parts == (True, False, "RRefContext", "AutogradContainer")
        assert refused and cleared and closed
        assert after.startswith("RPC has not been initialized")
