"""Waits on an RRef end: a request gated on a fork its owner never confirms, and a
proxy on the owner whose value is not made yet.

* Gates (docs/architecture.md, "Gates"): a request whose arguments hold an
  unconfirmed fork runs once the owner confirms it.  When the FORK message times out
  every time, or cannot be sent, the fork is unusable: the request fails with an
  error naming the owner and why (so does any use of the RRef).
* A proxy (``rref.rpc_sync(timeout=t).m()``) first learns the value's type; on the
  owner that waits for the value itself, bounded by ``t`` as on any other worker.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import freeze, options, run_world, wait_until
from torchwire import RpcTimeoutError, WorkerUnavailableError

pytestmark = pytest.mark.timeout(90)

_fork = mp.get_context("fork")


def _info() -> dict:
    gc.collect()  # RRefs caught in reference cycles (tracebacks kept by pytest.raises)
    return {k: int(v) for k, v in rpc.api._rref_context_get_debug_info().items()}


def _ping():
    return True


def _fetch(rref):
    return rref.to_here()


def _ignore(rref):
    return "ran"


def _agent():
    from torchwire._agent.runtime import current
    return current.runtime.agent


def _start(rank, world_size, init_method, pids, **opts):
    pids[rank] = os.getpid()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method, **opts))


def test_a_request_gated_on_a_fork_the_frozen_owner_never_confirms_fails_naming_it():
    """worker1 sends worker2 an RRef owned by worker0, which is stopped: worker2's
    FORK times out every time (0.25 s, 6 tries).  The call (no timeout) replies with
    an error naming worker0; worker1's child fork is released."""
    pids = _fork.Array("i", 3)
    ready, done = _fork.Barrier(3), _fork.Event()

    def body(rank, world_size, init_method):
        # the heartbeat would declare worker0 lost only long after the give-up
        _start(rank, world_size, init_method, pids, rpc_timeout=0.25, heartbeat_timeout=30,
               init_timeout=60)
        try:
            if rank == 2:  # the callee: connected to the owner before it stops
                assert rpc.rpc_sync("worker0", _ping, timeout=10)
            ready.wait(30)
            if rank != 1:
                assert done.wait(60)
                return None
            rref = rpc.remote("worker0", torch.ones, args=(2,), timeout=10)
            assert rref.to_here(timeout=10).tolist() == [1.0, 1.0]
            assert rpc.rpc_sync("worker2", _ping, timeout=10)
            freeze(pids[0])
            try:
                fut = rpc.rpc_async("worker2", _fetch, args=(rref,), timeout=0)
                replied = wait_until(fut.done, 15)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            assert replied, "the gated request never replied"
            with pytest.raises(WorkerUnavailableError) as err:
                fut.wait()
            # the child fork sent to worker2 is released (its ACCEPT)
            released = wait_until(lambda: _info()["num_pending_children"] == 0, 10)
            return str(err.value), released
        finally:
            done.set()
            rpc.shutdown(graceful=False)

    results = run_world(body, 3, init=False, timeout=80)
    message, released = results[1]
    assert "worker0" in message and "did not confirm fork" in message, message
    assert "timed out 6 times" in message, message
    assert released, "worker1 still keeps the child fork worker2 gave up on"


def test_a_request_gated_on_a_fork_that_cannot_be_sent_fails_naming_the_owner():
    """worker2 cannot reach worker0 (get_worker_info raises, as for a member that left a
    dynamic group) when an RRef of worker0's arrives from worker1: the call replies at
    once with an error naming worker0, not after its own timeout."""
    pids = _fork.Array("i", 3)
    ready, cut, done = _fork.Barrier(3), _fork.Event(), _fork.Event()

    def body(rank, world_size, init_method):
        _start(rank, world_size, init_method, pids)
        try:
            ready.wait(30)
            if rank == 2:
                agent = _agent()
                lookup = agent.get_worker_info

                def left(to=None):
                    if to == 0:
                        raise agent.names.unavailable(0, "it left the group")
                    return lookup(to)
                agent.get_worker_info = left
                cut.set()
            if rank != 1:
                assert done.wait(60)
                return None
            rref = rpc.remote("worker0", torch.ones, args=(2,))
            assert rref.to_here().tolist() == [1.0, 1.0]
            assert cut.wait(30)
            t0 = time.monotonic()
            with pytest.raises(WorkerUnavailableError) as err:
                rpc.rpc_sync("worker2", _fetch, args=(rref,), timeout=10)
            elapsed = time.monotonic() - t0
            # a function that never uses the RRef does not run either
            with pytest.raises(WorkerUnavailableError) as unused:
                rpc.rpc_sync("worker2", _ignore, args=(rref,), timeout=10)
            return str(err.value), elapsed, str(unused.value)
        finally:
            done.set()
            rpc.shutdown(graceful=False)

    results = run_world(body, 3, init=False, timeout=80)
    message, elapsed, unused = results[1]
    assert "worker0" in message and "it left the group" in message, message
    assert elapsed < 5, f"the call waited {elapsed:.1f} s"
    assert "worker0" in unused and "it left the group" in unused, unused


_release = threading.Event()


def _made_later():
    assert _release.wait(30)
    return 5


def test_an_owner_proxy_waits_for_its_value_no_longer_than_the_timeout():
    def body(rank, world_size):
        rref = rpc.remote("worker0", _made_later)  # owned here, value not made yet
        try:
            assert rref.is_owner()
            waits = []
            for _ in range(2):  # the first asks for the type; the second finds it asked
                t0 = time.monotonic()
                with pytest.raises(RpcTimeoutError,
                                   match=r"RPC ran for more than set timeout \(500 ms\)"):
                    rref.rpc_sync(timeout=0.5).bit_length()
                waits.append(time.monotonic() - t0)
            t0 = time.monotonic()
            with pytest.raises(RpcTimeoutError, match="RPC ran for more than set timeout"):
                rref.remote(timeout=0.5).bit_length()
            waits.append(time.monotonic() - t0)
        finally:
            _release.set()
        assert rref.rpc_sync(timeout=10).bit_length() == 3
        return waits

    waits = run_world(body, 1, timeout=30)[0]
    assert all(w < 3 for w in waits), waits
