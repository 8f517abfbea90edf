"""A split buffer whose main part never goes: its lane half must not go either.

Over TCP a buffer of 8 MiB or more travels half on the connection and half on a
lane (``_wire/channels/lanes.py``).  When the connection's queue stays full until
the call's deadline, the frame is not sent at all (``RpcTimeoutError``, "nothing
sent"); a lane half sent anyway would sit on the receiver as a transfer that never
completes, holding its buffer (and, 256 of them later, dropping the link).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import freeze, run_world, wait_until

pytestmark = pytest.mark.timeout(90)

_MIB = 1 << 20


def _nbytes(t):
    return t.nbytes


def _pid():
    return os.getpid()


def _lanes_pending():
    return len(rpc.api._get_current_rpc_agent().links._lanes._pending)


def _attempt(fut):
    try:
        return fut.wait()
    except RuntimeError as exc:
        return type(exc).__name__


def test_a_frame_refused_for_a_full_queue_sends_no_lane_half():
    def body(rank, world_size):
        if rank == 1:
            return None
        assert rpc.rpc_sync("worker1", _nbytes, args=(torch.ones(8 * _MIB, dtype=torch.uint8),)) \
            == 8 * _MIB  # the lane is open
        pid = rpc.rpc_sync("worker1", _pid)
        freeze(pid)
        try:
            # the first fills the connection (a pool thread finishes it), the second
            # waits in the queue, the third finds the queue full until its deadline
            futs = [rpc.rpc_async("worker1", _nbytes, timeout=1,
                                  args=(torch.ones(48 * _MIB, dtype=torch.uint8),))
                    for _ in range(3)]
            outcomes = tuple(_attempt(f) for f in futs)
        finally:
            os.kill(pid, signal.SIGCONT)
        # the first two frames arrive whole (their replies come too late: dropped);
        # nothing of the third stays half-received
        settled = wait_until(lambda: rpc.rpc_sync("worker1", _lanes_pending) == 0, 15)
        after = rpc.rpc_sync("worker1", _nbytes, args=(torch.ones(16 * _MIB, dtype=torch.uint8),))
        return outcomes, settled, after

    outcomes, settled, after = run_world(body, 2, _transports=["tcp"], timeout=80)[0]
    assert outcomes == ("RpcTimeoutError",) * 3, outcomes
    assert settled, "a lane half of the frame that was never sent is still pending"
    assert after == 16 * _MIB
