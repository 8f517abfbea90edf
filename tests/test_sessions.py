"""``init_rpc`` again after ``shutdown()`` on the same ``init_method``, as torch allows
(torchwire/_bootstrap/sessions.py): the same processes, a host that stays while its
workers are fresh processes, and a worker that stays while rank 0 is started afresh."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

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
    first_pid, first_session, first_host = child_result(start_child(host, 0, 2, init_method))
    # a new store on the same port: session 0 of a store this worker has not used
    second_pid, second_session, second_host = child_result(start_child(host, 0, 2,
                                                                        init_method))
    worker_pid = child_result(stays)
    assert first_pid == second_pid == worker_pid and first_host != second_host
    assert first_session is None and second_session is None
