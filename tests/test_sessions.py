"""``init_rpc`` again after ``shutdown()`` on the same ``init_method``, as torch allows
(torchwire/_bootstrap/sessions.py): the same processes, a host that stays while its
workers are fresh processes, and a worker that stays while rank 0 is started afresh."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

import torchwire.rpc as rpc
from _cluster import _ctx, child_result, options, run_world, start_child
from torchwire._bootstrap.rendezvous import PREFIX


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tag(session, rank):
    return session, rank, os.getpid()


def _try_init(name: str, rank: int, world_size: int, init_method: str, **opts) -> str:
    """``init_rpc``: "joined", or the error it raised as "Type: message"."""
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, **opts))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "joined"


def _session_key(port: int):
    """The store's current session (its ``session`` key), read as a client: None for
    a store whose only session is the first."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store = dist.PrefixStore(PREFIX, client)
    return store.get("session").decode() if store.check(["session"]) else None


def test_the_same_processes_init_three_times_on_one_port():
    init_method = f"tcp://127.0.0.1:{_port()}"
    both = _ctx.Barrier(2)

    def body(rank, world_size, _unused):
        out = []
        for session, graceful in enumerate((True, False, True)):
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                         rpc_backend_options=options(init_method))
            out.append(rpc.rpc_sync(f"worker{1 - rank}", tag, args=(session, rank))[:2])
            if not graceful:
                both.wait(30)  # neither leaves while the other's call is in flight
            rpc.shutdown(graceful=graceful)
        return out

    got = run_world(body, 2, init=False, timeout=120)
    assert got == [[(s, 0) for s in range(3)], [(s, 1) for s in range(3)]]


def test_a_host_that_stays_takes_a_fresh_worker_in_each_session():
    port = _port()
    init_method = f"tcp://127.0.0.1:{port}"

    def host(rank, world_size, _unused):
        pids, sessions = [], []
        for session in range(2):
            rpc.init_rpc("worker0", rank=0, world_size=2,
                         rpc_backend_options=options(init_method))
            pids.append(rpc.rpc_sync("worker1", tag, args=(session, 1))[2])
            sessions.append(_session_key(port))
            rpc.shutdown()
        return pids, sessions

    def worker(rank, world_size, _unused):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options(init_method))
        rpc.shutdown()
        return os.getpid()

    stays = start_child(host, 0, 2, init_method)
    first = child_result(start_child(worker, 1, 2, init_method), timeout=60)
    # started after the first left: the session it finds is over, and it waits for rank 0
    second = child_result(start_child(worker, 1, 2, init_method), timeout=60)
    pids, sessions = child_result(stays, timeout=60)
    assert pids == [first, second] and first != second
    assert sessions == [None, "1"]  # the second session's keys are under session_1


def test_a_worker_that_stays_joins_a_rank_0_started_afresh():
    port = _port()
    init_method = f"tcp://127.0.0.1:{port}"

    def host(rank, world_size, _unused):
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options(init_method))
        got = rpc.rpc_sync("worker1", tag, args=(0, 1))
        session = _session_key(port)
        rpc.shutdown()
        return got[2], session, os.getpid()

    def worker(rank, world_size, _unused):
        for _ in range(2):
            rpc.init_rpc("worker1", rank=1, world_size=2,
                         rpc_backend_options=options(init_method))
            rpc.shutdown()
        return os.getpid()

    stays = start_child(worker, 1, 2, init_method)
    first = start_child(host, 0, 2, init_method)
    first_pid, first_session, first_host = child_result(first)
    first[0].join(30)  # its store's port is free once the process is gone
    # a new store on the same port: session 0 of a store this worker has not used
    second_pid, second_session, second_host = child_result(start_child(host, 0, 2,
                                                                        init_method))
    worker_pid = child_result(stays)
    assert first_pid == second_pid == worker_pid and first_host != second_host
    assert first_session is None and second_session is None


def test_a_fresh_worker_after_a_job_that_ended_abruptly_waits_for_the_next():
    # shutdown(graceful=False) leaves no "sd/over": a fresh worker finds its rank taken
    # in a session whose other workers are all gone.  It took itself for a worker
    # restarted into that dead job, and its init_rpc returned into it; it waits for
    # rank 0's next session now (here, in vain first: rank 0 starts it later).
    init_method = f"tcp://127.0.0.1:{_port()}"
    first_done, late_done = _ctx.Event(), _ctx.Event()

    def host(rank, world_size, _unused):
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options(init_method))
        first = rpc.rpc_sync("worker1", tag, args=(0, 1))[2]
        rpc.shutdown(graceful=False)
        first_done.set()
        assert late_done.wait(60)
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options(init_method))
        second = rpc.rpc_sync("worker1", tag, args=(1, 1))[2]
        rpc.shutdown()
        return first, second

    def first_worker(rank, world_size, _unused):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options(init_method))
        assert first_done.wait(30)
        rpc.shutdown(graceful=False)
        return os.getpid()

    def late_worker(rank, world_size, _unused):
        outcome = _try_init("worker1", 1, 2, init_method, rpc_timeout=2)
        late_done.set()
        return outcome

    def next_worker(rank, world_size, _unused):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options(init_method))
        rpc.shutdown()
        return os.getpid()

    stays = start_child(host, 0, 2, init_method)
    first = child_result(start_child(first_worker, 1, 2, init_method))
    late = child_result(start_child(late_worker, 1, 2, init_method))
    second = child_result(start_child(next_worker, 1, 2, init_method))
    assert late.startswith("RendezvousError") and "new RPC session" in late, late
    assert child_result(stays) == (first, second)


def test_rank_0_can_init_again_after_a_failed_init_rpc():
    init_method = f"tcp://127.0.0.1:{_port()}"
    started = _ctx.Event()

    def host(rank, world_size, _unused):
        first = _try_init("worker0", 0, 2, init_method, rpc_timeout=2).split(":")[0]
        warned = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warned.append(record.getMessage())
        logging.getLogger("torchwire").addHandler(handler)
        started.set()
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options(init_method))
        got = rpc.rpc_sync("worker1", tag, args=(1, 1))[:2]
        rpc.shutdown()
        return first, got, warned  # not "rejoins the job": no other process was rank 0

    def worker(rank, world_size, _unused):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options(init_method))
        rpc.shutdown()
        return True

    stays = start_child(host, 0, 2, init_method)
    assert started.wait(60)
    assert child_result(start_child(worker, 1, 2, init_method))
    assert child_result(stays) == ("RendezvousError", (1, 1), [])


def test_a_worker_of_another_world_size_is_refused_naming_both():
    init_method = f"tcp://127.0.0.1:{_port()}"
    running = _ctx.Event()
    done = _ctx.Event()

    def member(rank, world_size, _unused):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                     rpc_backend_options=options(init_method))
        running.set()
        assert done.wait(60)
        rpc.shutdown()
        return True

    def other(rank, world_size, _unused):
        outcome = _try_init("worker2", 2, 3, init_method)
        if outcome == "joined":
            rpc.shutdown()
        return outcome

    members = [start_child(member, r, 2, init_method) for r in range(2)]
    assert running.wait(60)
    outcome = child_result(start_child(other, 2, 3, init_method))
    done.set()
    assert all(child_result(m) for m in members)
    assert outcome.startswith("RendezvousError"), outcome
    assert "world_size=3" in outcome and "world_size=2" in outcome


@pytest.mark.parametrize("kinds", ["sds", "dsd"])
def test_static_and_dynamic_groups_take_turns_on_one_port(kinds):
    # each is a session of its own ("static" then "dynamic" in one store was refused as
    # a mix of kinds, though nobody mixed them within a job)
    init_method = f"tcp://127.0.0.1:{_port()}"
    both = [_ctx.Barrier(2) for _ in kinds]

    def body(rank, world_size, _unused):
        out = []
        for session, kind in enumerate(kinds):
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2 if kind == "s" else None,
                         rpc_backend_options=options(init_method))
            both[session].wait(30)  # a dynamic group's members: both there before calls
            got = rpc.rpc_sync(f"worker{1 - rank}", tag, args=(session, rank))
            out.append((kind, got[0]))
            both[session].wait(30)
            rpc.shutdown()
        return out

    expected = [(kind, s) for s, kind in enumerate(kinds)]
    assert run_world(body, 2, init=False, timeout=120) == [expected, expected]
