"""A FORK that went more than once cannot register its fork after the deletion.

A holder retries a FORK that timed out (the message is idempotent), so the owner may
get several copies, and runs them on its pool in any order.  When the holder gives
up (every try timed out) it undoes the fork at the owner, and copies may still run
there afterwards: the first registered the fork before the deletion, a later one
would register it again, and the value would be kept for good.  The deletion of a
fork whose FORK went more than once (a FORGET) leaves a tombstone that refuses them.

The owner's handling of the copies is held back by a hook on its RRef context, so
that the first copy registers before the deletion and the others run after it:
the order that a slow owner produces only sometimes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import options, run_world, wait_until
from torchwire import WorkerUnavailableError

pytestmark = pytest.mark.timeout(90)

_fork = mp.get_context("fork")
_TRIES = 6  # the first FORK and its 5 retries (janitor._CONTROL_RETRIES)

_copies = {"started": 0, "ended": 0}
_copies_lock = threading.Lock()
_deleted = threading.Event()


def _ignore(rref):
    return "ran"


def _context():
    from torchwire._rref.records import context
    return context()


def _hold_copies() -> None:
    """On the owner: worker2's first FORK copy registers its fork and replies only
    after the deletion came; the other copies run after the deletion."""
    ctx = _context()
    add_fork, del_fork = ctx.add_fork, ctx.del_fork

    def held_add_fork(entry, fork_id, holder):
        if holder != 2:
            return add_fork(entry, fork_id, holder)
        with _copies_lock:
            _copies["started"] += 1
            first = _copies["started"] == 1
        try:
            if first:
                registered = add_fork(entry, fork_id, holder)
                _deleted.wait(30)
                return registered
            _deleted.wait(30)
            return add_fork(entry, fork_id, holder)
        finally:
            with _copies_lock:
                _copies["ended"] += 1

    def noted_del_fork(rref_id, fork_id, **kw):
        del_fork(rref_id, fork_id, **kw)
        _deleted.set()

    ctx.add_fork, ctx.del_fork = held_add_fork, noted_del_fork


def _state():
    gc.collect()
    with _copies_lock:
        copies = (_copies["started"], _copies["ended"])
    info = rpc.api._rref_context_get_debug_info()
    return copies, _deleted.is_set(), int(info["num_owner_rrefs"]), int(info["num_forks"])


def test_fork_copies_that_run_after_the_holder_gave_up_do_not_register_it():
    ready, done = _fork.Barrier(3), _fork.Event()

    def body(rank, world_size, init_method):
        # worker2's FORK times out fast; the heartbeat keeps out of it
        timeout = 0.25 if rank == 2 else 60
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=timeout,
                                                 heartbeat_timeout=30, init_timeout=60))
        try:
            if rank == 1:
                _hold_copies()
            ready.wait(30)
            if rank != 0:
                assert done.wait(60)
                return None
            rref = rpc.remote("worker1", torch.ones, args=(2,))
            assert rref.to_here().tolist() == [1.0, 1.0]
            with pytest.raises(WorkerUnavailableError) as err:
                rpc.rpc_sync("worker2", _ignore, args=(rref,), timeout=20)
            message = str(err.value)
            del err  # its traceback's frames hold the call's arguments: the RRef
            # every copy of worker2's FORK ran on worker1, after its deletion
            settled = wait_until(lambda: rpc.rpc_sync("worker1", _state)[:2]
                                 == ((_TRIES, _TRIES), True), 20)
            state = rpc.rpc_sync("worker1", _state)
            del rref  # the creator's fork goes: nothing holds the value any more
            gc.collect()
            freed = wait_until(lambda: rpc.rpc_sync("worker1", _state)[2:] == (0, 0), 10)
            return message, settled, state, freed, rpc.rpc_sync("worker1", _state)
        finally:
            done.set()
            rpc.shutdown(graceful=False)

    message, settled, state, freed, final = run_world(body, 3, init=False, timeout=80)[0]
    assert "did not confirm fork" in message and "worker1" in message, message
    assert settled, state
    # only the creator's fork is left once the copies ran: worker2's was not registered
    assert state[2:] == (1, 1), state
    assert freed, f"worker1 keeps the value (owner rrefs, forks): {final[2:]}"
