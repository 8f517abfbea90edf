"""The RRef owner when the worker that created a value there with ``remote()`` dies.

The failure model (docs/architecture.md): on loss, the owner releases the forks the
dead worker held, so nothing it created leaks; forks other workers hold stay.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import after_gate, die, freeze, open_gate, options, run_world, wait_until

pytestmark = pytest.mark.timeout(90)

_fork = mp.get_context("fork")


def _info() -> dict:
    gc.collect()  # RRefs caught in reference cycles (tracebacks kept by pytest.raises)
    return {k: int(v) for k, v in rpc.api._rref_context_get_debug_info().items()}


_held: dict = {}
_made: list = []


def _keep(key, rref):
    _held[key] = rref
    return True


def _fetch(key):
    return _held[key].to_here()


def _drop(key):
    del _held[key]
    return True


def _record(rref):
    _made.append(rref.owner_name())
    return torch.ones(1)


def test_owner_releases_what_a_killed_creator_held_and_keeps_other_forks():
    go, done = _fork.Event(), _fork.Event()

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20))
        if rank == 1:  # the creator
            made = rpc.remote("worker0", torch.ones, args=(2,))
            assert made.to_here().tolist() == [1.0, 1.0]
            making = rpc.remote("worker0", after_gate, args=("making", torch.zeros(2)))
            shared = rpc.remote("worker0", torch.full, args=((3,), 7.0))
            assert rpc.rpc_sync("worker2", _keep, args=("shared", shared))
            assert go.wait(30)
            die(("killed", made is not None, making is not None), sig=signal.SIGKILL)
        if rank == 0:  # the owner
            try:
                # three values, four forks: the creator's three and worker2's of `shared`
                assert wait_until(lambda: _info()["num_owner_rrefs"] == 3
                                  and _info()["num_forks"] == 4, 30), _info()
                before = _info()
                go.set()
                # the creator's forks go; worker2's fork of `shared` stays
                assert wait_until(lambda: _info()["num_owner_rrefs"] == 1
                                  and _info()["num_forks"] == 1, 30), _info()
                assert rpc.rpc_sync("worker2", _fetch, args=("shared",)).tolist() == [7.0] * 3
                # `making` finishes after its creator died: nothing keeps it
                open_gate("making")
                assert wait_until(lambda: _info()["num_live_values"] == 1, 30), _info()
                assert rpc.rpc_sync("worker2", _drop, args=("shared",))
                assert wait_until(lambda: _info()["num_owner_rrefs"] == 0
                                  and _info()["num_live_values"] == 0, 30), _info()
                return before, _info()
            finally:
                done.set()
                rpc.shutdown(graceful=False)
        assert done.wait(60)
        rpc.shutdown(graceful=False)
        return None

    results = run_world(body, 3, init=False, timeout=80)
    assert results[1] == ("killed", True, True)
    before, after = results[0]
    assert before["num_owner_rrefs"] == 3 and before["num_forks"] == 4, before
    assert after["num_forks"] == 0 and after["num_user_rrefs"] == 0, after


def test_a_remote_call_that_runs_after_its_creator_died_leaves_no_owner_rref():
    """The request of ``remote()`` arrives, then its creator dies, then it ends: its
    argument is an RRef of worker2's, so it waits for worker2's confirmation, and
    worker2 is stopped until the owner has released what the creator held.  Once
    resumed, worker2 learns of the creator's death and of worker0's fork in either
    order: the fork registered first keeps the value and the function runs; the
    creator's forks released first delete the value, the fork is refused and the
    request fails without running.  Either way the owner keeps nothing."""
    pids = _fork.Array("i", 3)
    received, done = _fork.Event(), _fork.Event()

    def body(rank, world_size, init_method):
        pids[rank] = os.getpid()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20))
        if rank == 1:  # the creator
            theirs = rpc.remote("worker2", torch.ones, args=(2,))
            theirs.to_here()  # confirmed: sending it on makes a fork worker2 must confirm
            marker = rpc.remote("worker0", torch.zeros, args=(1,))
            marker.to_here()  # a fork on the owner: shows when the owner released ours
            freeze(pids[2])
            late = rpc.remote("worker0", _record, args=(theirs,))
            assert received.wait(30)
            die(("killed", late is not None), sig=signal.SIGKILL)
        if rank == 0:  # the owner
            try:
                # the request is here, waiting for worker2 to confirm its argument
                assert wait_until(lambda: _info()["num_pending_users"] == 1, 30), _info()
                received.set()
                assert wait_until(lambda: _info()["num_owner_rrefs"] == 0, 30), _info()
                os.kill(pids[2], signal.SIGCONT)
                # the gate settles: confirmed (the function runs) or refused (it fails)
                assert wait_until(lambda: _info()["num_pending_users"] == 0, 30), _info()
                assert _made in ([], ["worker2"]), _made
                settled = wait_until(lambda: _info()["num_owner_rrefs"] == 0
                                     and _info()["num_live_values"] == 0
                                     and _info()["num_user_rrefs"] == 0, 10)
                return settled, _info()
            finally:
                os.kill(pids[2], signal.SIGCONT)
                done.set()
                rpc.shutdown(graceful=False)
        assert done.wait(60)
        rpc.shutdown(graceful=False)
        return None

    results = run_world(body, 3, init=False, timeout=80)
    assert results[1] == ("killed", True)
    settled, info = results[0]
    assert settled, f"the owner still holds a value for its dead creator: {info}"
    assert info["num_forks"] == 0, info
