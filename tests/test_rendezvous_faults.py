"""Faults during the static rendezvous: real processes, a real TCPStore hosted by rank 0.

torch's ``init_rpc`` ends with an all-gather and a barrier, so once it returns on
rank 0 no rank needs rank 0's store for its init any more.  torchwire's returns
once every rank has read the records (rendezvous.py, step 7): a rank 0 that exits
right after ``init_rpc`` does not fail a rank that was still reading.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

import torchwire.rpc as rpc
from _cluster import child_result, freeze, options, start_child
from test_failures import _reap
from torchwire._bootstrap.rendezvous import PREFIX

_ctx = mp.get_context("fork")
WAIT = 60  # seconds a child or this process waits for an event before failing

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_with_rank_1_frozen_before_it_reads(body, port: int, init_method: str) -> list:
    """Ranks 0 and 1 of 3; rank 1 frozen once it has published itself (it reads the
    records only once rank 2 has published too), then rank 2."""
    procs = [start_child(body, 0, 3, init_method), start_child(body, 1, 3, init_method)]
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=WAIT))
        client.wait([f"{PREFIX}/worker/1"])
        freeze(procs[1][0].pid)
        procs.append(start_child(body, 2, 3, init_method))
    except BaseException:
        _reap(procs)
        raise
    return procs


def test_rank_0_exiting_right_after_init_rpc_does_not_fail_a_rank_still_reading_its_store():
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    returned = _ctx.Event()  # rank 0's init_rpc returned

    def body(rank, world_size, _init):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, init_timeout=WAIT))
        if rank == 0:
            returned.set()
            os._exit(0)  # a crash: the store it hosts goes with it
        rpc.shutdown(graceful=False)
        return "up"

    procs = _start_with_rank_1_frozen_before_it_reads(body, port, init_method)
    try:
        assert child_result(procs[2], WAIT) == "up"
        # rank 0 must still be in init_rpc: before step 7 it had returned and exited by
        # now, or does so within this bound
        assert not returned.wait(2), "rank 0's init_rpc returned before rank 1 read"
        os.kill(procs[1][0].pid, signal.SIGCONT)
        assert child_result(procs[1], WAIT) == "up"
        procs[0][0].join(WAIT)
        assert returned.is_set() and procs[0][0].exitcode == 0
    finally:
        _reap(procs)  # SIGKILL ends a stopped process too


def test_a_store_host_that_dies_during_the_join_fails_the_others_at_once_naming_the_store():
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"

    def body(rank, world_size, _init):
        try:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                         rpc_backend_options=options(init_method, init_timeout=WAIT))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "up"

    procs = [start_child(body, 0, 3, init_method), start_child(body, 1, 3, init_method)]
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=WAIT))
        client.wait([f"{PREFIX}/worker/1"])  # rank 1 waits for rank 2, which never comes
        del client
        os.kill(procs[0][0].pid, signal.SIGKILL)
        error = child_result(procs[1], WAIT / 2)  # well before its init timeout
    finally:
        _reap(procs)
    assert error.startswith("RendezvousError: the rendezvous store failed while this worker "
                            "(rank 1) waited"), error
    assert "exited or cannot be reached" in error


def test_rank_0_returns_at_its_init_deadline_with_a_warning_when_a_rank_never_reads():
    from test_auth import _capture_logs
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    returned, up = _ctx.Event(), [_ctx.Event() for _ in range(3)]

    def body(rank, world_size, _init):
        logs = _capture_logs()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method,
                                                 init_timeout=3 if rank == 0 else WAIT))
        if rank == 0:
            returned.set()
        up[rank].set()
        assert all(e.wait(WAIT) for e in up)  # the store stays until all are up
        rpc.shutdown(graceful=False)
        return logs

    procs = _start_with_rank_1_frozen_before_it_reads(body, port, init_method)
    try:
        assert returned.wait(WAIT), "rank 0's init_rpc did not return at its deadline"
        os.kill(procs[1][0].pid, signal.SIGCONT)  # the store is still there: it reads
        logs = [child_result(p, WAIT) for p in procs]
    finally:
        _reap(procs)
    assert any("2 of 3 workers read the rendezvous records within the init timeout" in m
               for m in logs[0]), logs[0]
    assert not any("rendezvous" in m for m in logs[1] + logs[2]), logs[1:]
