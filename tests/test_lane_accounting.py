"""Lanes in the books: each byte counted once, and no lane listed after it ended.

Over TCP a buffer of 8 MiB or more travels half on its frame's connection and half
on a lane (``_wire/channels/lanes.py``).  The frame's connection counts the buffer
whole, on both sides; the lane's DATA frames are not counted again, on either side
(the side that opened the lane knows it from the start, the other from its first
DATA frame).
"""

from __future__ import annotations

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world

pytestmark = pytest.mark.timeout(90)

_MIB = 1 << 20
_CALLS = 3


def _nbytes(t):
    return t.nbytes


def _fresh(n):
    return torch.ones(n, dtype=torch.uint8)


def _peer_bytes(peer):
    p = rpc.stats()["peers"][peer]
    return p["bytes_out"], p["bytes_in"]


def _lanes():
    links = rpc.api._get_current_rpc_agent().links
    incoming = sum(c.lane for c in list(links.incoming))
    return len(links.lanes_out), incoming


def test_split_buffers_are_counted_once_on_both_sides():
    def body(rank, world_size):
        if rank == 1:
            return None
        big = torch.ones(16 * _MIB, dtype=torch.uint8)
        for _ in range(_CALLS):  # requests split by worker0, over its lane
            assert rpc.rpc_sync("worker1", _nbytes, args=(big,)) == 16 * _MIB
        for _ in range(_CALLS):  # replies split by worker1, over its own lane
            assert rpc.rpc_sync("worker1", _fresh, args=(16 * _MIB,)).nbytes == 16 * _MIB
        mine = _peer_bytes("worker1")
        theirs = rpc.rpc_sync("worker1", _peer_bytes, args=("worker0",))
        return mine, theirs, _lanes(), rpc.rpc_sync("worker1", _lanes)

    mine, theirs, my_lanes, their_lanes = run_world(body, 2, _transports=["tcp"],
                                                    timeout=80)[0]
    moved = _CALLS * 16 * _MIB
    # each side opened one lane and knows the other's for one
    assert my_lanes == (1, 1) and their_lanes == (1, 1), (my_lanes, their_lanes)
    # what one side wrote is what the other read, give or take the last frames and
    # the heartbeats (well under a MiB); a half counted twice would add 24 MiB
    for wrote, read in ((mine[0], theirs[1]), (theirs[0], mine[1])):
        assert moved <= wrote <= moved + _MIB, (mine, theirs)
        assert abs(wrote - read) < _MIB, (mine, theirs)


def test_a_lane_that_ends_before_it_is_listed_is_not_listed():
    def body(rank, world_size):
        if rank == 1:
            return None
        links = rpc.api._get_current_rpc_agent().links
        connect = links._connect

        def connect_then_lose(member, lane=False, **kw):
            conn = connect(member, lane=lane, **kw)
            if lane:  # the lane ends, and its reader reports it, before it is listed
                conn.close()
                conn.join(10)
            return conn

        links._connect = connect_then_lose
        try:
            lane = links._open_lane(1)
        finally:
            links._connect = connect
        listed = lane in links.lanes_out
        # the link goes on: a split buffer opens a new lane and arrives whole
        n = rpc.rpc_sync("worker1", _nbytes, args=(torch.ones(16 * _MIB, dtype=torch.uint8),))
        return lane.closed, listed, n, len(links.lanes_out)

    closed, listed, n, lanes = run_world(body, 2, _transports=["tcp"], timeout=80)[0]
    assert closed and not listed
    assert n == 16 * _MIB and lanes == 1
