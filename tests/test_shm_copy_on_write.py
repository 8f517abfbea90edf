"""Copy-on-write isolation of shared-memory transfers, in both directions: writes by the
callee or the caller never reach the other side, a modified tensor comes back as a copy
and an unmodified one by reference (back-references, own segments), and recycling
segments never changes a tensor a receiver, or a forked child of it, still holds.
Tests set ``_channel_threshold=4096`` (SMALL) unless they move big tensors; every job
is fresh (``run_world``), so counters start at zero."""

from __future__ import annotations

import hashlib

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from _shm_helpers import (SMALL, child_digest, counters, drop, echo, edited, fetch, fork_and_drop,
                          fork_holder, fresh, grew, held_matches, make, matches, modify_and_return,
                          mutate, mutate_held, same, send_held_to, store, store_and_echo,
                          store_slice, wait_for)
from torchwire._wire.channels import segments as shm

pytestmark = pytest.mark.skipif(not shm.available(),
                                reason="memfd and descriptor passing are not available")


# ----------------------------------------------------------------- copy-on-write


def test_callee_writes_stay_private():
    """(a) The callee writes a received tensor: neither the caller's original nor its
    segment changes (the caller, mapping the segment itself, sees no change, and
    the segment sent again carries the original values)."""
    def body(rank, world_size):
        if rank:
            return None
        spec = (torch.int32, 1 << 16, 11)  # 256 KiB: 64 pages
        x = make(*spec)
        snapshot = x.clone()
        changed_a = rpc.rpc_sync("worker1", mutate, args=(x,))
        y = rpc.rpc_sync("worker1", store_and_echo, args=("a", x))  # maps our own segment
        changed_b = rpc.rpc_sync("worker1", mutate_held, args=("a",))
        mine0 = shm.stats()
        arrives = rpc.rpc_sync("worker1", matches, args=(y, spec))  # y's segment, sent on
        return (changed_a, changed_b, same(x, snapshot), same(y, snapshot), arrives,
                grew(mine0, shm.stats()))

    changed_a, changed_b, x_same, y_same, arrives, mine = run_world(
        body, 2, _channel_threshold=SMALL)[0]
    assert changed_a and changed_b  # the callee did write
    assert x_same, "the caller's original changed"
    assert y_same, "the callee's write reached the caller's segment"
    assert arrives, "the segment sent again does not carry the original values"
    assert mine["sent_own"] == 1 and mine["copies"] == 0, mine


def test_caller_writes_after_sending_do_not_reach_the_callee():
    """(b) The caller writes its original after sending, and writes the tensor it got
    back by reference (a mapping of the segment the callee still maps)."""
    def body(rank, world_size):
        if rank:
            return None
        spec_b, spec_c = (torch.float32, 1 << 16, 21), (torch.float32, 1 << 16, 22)
        x = make(*spec_b)
        rpc.rpc_sync("worker1", store, args=("b", x))
        x.fill_(7.0)
        y = rpc.rpc_sync("worker1", store_and_echo, args=("c", make(*spec_c)))
        y.fill_(-1.0)
        y_back = same(y, torch.full_like(y, -1.0))
        fetched = rpc.rpc_sync("worker1", fetch, args=("b",))  # by reference, later
        return (y_back, rpc.rpc_sync("worker1", held_matches, args=("b", spec_b)),
                rpc.rpc_sync("worker1", held_matches, args=("c", spec_c)),
                same(fetched, make(*spec_b)), same(x, torch.full_like(x, 7.0)))

    y_back, held_b, held_c, fetched_b, x_written = run_world(
        body, 2, _channel_threshold=SMALL)[0]
    assert y_back and x_written  # the caller's writes did happen
    assert held_b, "the caller's write to its original reached the callee"
    assert held_c, "the caller's write to its mapping reached the callee"
    assert fetched_b, "the stored tensor fetched later does not have the values sent"


@pytest.mark.parametrize("where", ["first page", "middle page", "last byte"])
def test_a_modified_tensor_is_copied_back(where):
    """(c) The callee writes one element of a received tensor and returns it: the
    caller gets the modified values, in a copy (not a reference to its segment)."""
    numel = 1 << 18  # 256 KiB of uint8: 64 pages
    index = {"first page": 5, "middle page": numel // 2 + 17, "last byte": numel - 1}[where]

    def body(rank, world_size):
        if rank:
            return None
        spec = (torch.uint8, numel, 31)
        x = make(*spec)
        edits = [(index, int(x[index]) ^ 0xFF)]
        theirs0 = rpc.rpc_sync("worker1", counters)
        got = rpc.rpc_sync("worker1", modify_and_return, args=(x, edits))
        theirs = grew(theirs0, rpc.rpc_sync("worker1", counters))
        return same(got, edited(x, edits)), same(x, make(*spec)), theirs

    got_edited, x_same, theirs = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert got_edited, "the caller did not get the callee's modification"
    assert x_same
    assert theirs["sent_back"] == 0 and theirs["copies"] == 1, theirs


def test_zero_copy_echo_then_modify_then_send_own():
    """(d) An unmodified echo returns by reference (no copy); the caller writes the
    returned tensor and echoes it: the callee gets the new values; a returned tensor
    sent again unmodified goes in its own segment (no copy) and arrives intact."""
    def body(rank, world_size):
        if rank:
            return None
        spec1, spec2 = (torch.float64, 1 << 15, 41), (torch.float64, 1 << 15, 42)
        x = make(*spec1)
        mine0, theirs0 = shm.stats(), rpc.rpc_sync("worker1", counters)
        y = rpc.rpc_sync("worker1", echo, args=(x,))
        theirs1 = rpc.rpc_sync("worker1", counters)
        echo_ok = same(y, x)
        edits = [(100, 1.5), (20_000, -2.25)]
        for i, v in edits:
            y[i] = v
        mine1 = shm.stats()
        modified_arrives = rpc.rpc_sync("worker1", matches, args=(y, spec1, edits))
        mine2 = shm.stats()
        y2 = rpc.rpc_sync("worker1", echo, args=(make(*spec2),))
        mine3 = shm.stats()
        own_arrives = rpc.rpc_sync("worker1", matches, args=(y2, spec2))
        mine4 = shm.stats()
        return (echo_ok, modified_arrives, own_arrives, grew(mine0, mine1),
                grew(theirs0, theirs1), grew(mine1, mine2), grew(mine3, mine4))

    (echo_ok, modified_arrives, own_arrives, echo_mine, echo_theirs, modified_mine,
     own_mine) = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert echo_ok
    assert echo_theirs["copies"] == 0 and echo_theirs["sent_back"] == 1, echo_theirs
    assert echo_mine["copies"] == 1 and echo_mine["received"] == 0, echo_mine  # by reference
    assert modified_arrives, "the callee did not get the caller's modification"
    assert modified_mine["copies"] == 1 and modified_mine["sent_own"] == 0, modified_mine
    assert own_arrives
    assert own_mine["sent_own"] == 1 and own_mine["copies"] == 0, own_mine


def test_a_held_tensor_survives_segment_recycling():
    """(e) A receiver holds a tensor (or only a slice of it) while the sender recycles
    segments for later transfers of the same size: what it holds never changes.
    Both directions: arguments the callee keeps, results the caller keeps."""
    def body(rank, world_size):
        if rank:
            return None
        size = 1 << 16  # 64 KiB
        first, second = (torch.uint8, size, 50), (torch.uint8, size, 51)
        rpc.rpc_sync("worker1", store, args=("e0", make(*first)))
        rpc.rpc_sync("worker1", store_slice, args=("e1", make(*second), 4000, 9000))
        mine0, arrived = shm.stats(), []
        for i in range(6):
            spec = (torch.uint8, size, 60 + i)
            arrived.append(rpc.rpc_sync("worker1", matches, args=(make(*spec), spec)))
            # its segment released before the next send: that one reuses it
            assert wait_for(lambda: shm.stats()["leased"] == 2)
        recycled = grew(mine0, shm.stats())["reused"]
        held = (rpc.rpc_sync("worker1", held_matches, args=("e0", first)),
                rpc.rpc_sync("worker1", held_matches, args=("e1", second, 4000, 9000)))
        # the other way: a result kept here while the callee recycles its segments
        kept = rpc.rpc_sync("worker1", fresh, args=(first,))
        theirs0 = rpc.rpc_sync("worker1", counters)
        for i in range(6):
            spec = (torch.uint8, size, 70 + i)
            arrived.append(same(rpc.rpc_sync("worker1", fresh, args=(spec,)), make(*spec)))
            assert wait_for(lambda: rpc.rpc_sync("worker1", counters)["leased"] == 1)
        theirs_recycled = grew(theirs0, rpc.rpc_sync("worker1", counters))["reused"]
        return recycled, held, theirs_recycled, same(kept, make(*first)), arrived

    recycled, held, theirs_recycled, kept_same, arrived = run_world(
        body, 2, _channel_threshold=SMALL)[0]
    assert arrived == [True] * 12
    assert recycled == 5 and theirs_recycled == 5, "segments were not recycled"
    assert held == (True, True), "a recycled segment changed a tensor the callee holds"
    assert kept_same, "a recycled segment changed a tensor the caller holds"


def test_an_echoed_segment_is_waited_for_not_replaced(monkeypatch):
    """(e) continued: echoing a big tensor again and again reuses one segment.  The
    callee's RELEASE leaves after its reply, so the caller's next send often comes
    before it: the sender waits (bounded) for that segment rather than creating and
    faulting in a new one (over a second for 1 GiB).  A callee that keeps what it
    sends back makes such waits vain: the sender stops waiting for it after a few."""
    # The bound is what creating the segment would cost, ~17 ms for these 32 MiB: a
    # loaded machine can miss it.  Here it is 0.5 s, so the counts are the mechanism's.
    monkeypatch.setattr(shm, "_FAULT_RATE", 32e6)

    def body(rank, world_size):
        if rank:
            return None
        size = 32 << 20  # above shm._WAIT_MIN
        x = make(torch.uint8, size, 95)
        assert same(rpc.rpc_sync("worker1", echo, args=(x,)), x)  # warm-up: one segment
        mine0 = shm.stats()
        arrived = []
        for _ in range(8):
            y = rpc.rpc_sync("worker1", echo, args=(x,))
            arrived.append(same(y, x))
            del y
        echoed = dict(grew(mine0, shm.stats()), vain=shm.stats()["vain_waits"])
        kept = []
        for i in range(5):  # the callee keeps each one
            spec = (torch.uint8, size, 100 + i)
            kept.append(same(rpc.rpc_sync("worker1", store_and_echo,
                                          args=(f"k{i}", make(*spec))), make(*spec)))
        held = [rpc.rpc_sync("worker1", held_matches, args=(f"k{i}", (torch.uint8, size,
                                                                      100 + i)))
                for i in range(5)]
        return arrived, echoed, kept, held, shm.stats()["vain_waits"]

    arrived, echoed, kept, held, vain = run_world(body, 2)[0]
    assert arrived == [True] * 8
    assert echoed["created"] == 0 and echoed["reused"] == 8, echoed
    assert echoed["vain"] == 0, echoed
    assert kept == [True] * 5 and held == [True] * 5
    assert 1 <= vain <= shm._VAIN_MAX, vain  # waited in vain, then no more


def checksums(named):
    """Per tensor of a state dict: its sum (a callee that reads, then drops, them all)."""
    return {k: int(v.sum()) for k, v in named.items()}


def test_a_state_dict_of_many_large_tensors_reuses_its_segments():
    """A message with more tensors over the threshold than a small cache of free
    segments holds (a state dict: one segment each) finds its segments again each
    time it is sent, rather than creating and faulting in most of them anew (with a
    cache of 8: 32 new segments a send)."""
    n = 40

    def body(rank, world_size):
        if rank:
            return None
        base = {f"layer{i}.weight": make(torch.int32, 4096 + 512 * i, 300 + i) for i in range(n)}
        expected = {k: int(v.sum()) for k, v in base.items()}
        sent = {k: v.clone() for k, v in base.items()}
        assert rpc.rpc_sync("worker1", checksums, args=(sent,)) == expected  # warm-up
        mine0 = shm.stats()
        right, settled = [], []
        for _ in range(15):
            # the last message's segments are back (its releases follow the reply)
            settled.append(wait_for(lambda: shm.stats()["leased"] == 0))
            sent = {k: v.clone() for k, v in base.items()}  # fresh tensors each step
            right.append(rpc.rpc_sync("worker1", checksums, args=(sent,)) == expected)
        return right, settled, grew(mine0, shm.stats())

    right, settled, moved = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert right == [True] * 15 and settled == [True] * 15
    assert moved["copies"] == 15 * n, moved
    # every send finds the segments of the one before it: none is made anew
    assert moved["created"] == 0 and moved["reused"] == 15 * n, moved


def test_a_segment_leased_twice_is_not_reused_until_both_leases_end():
    """(e) continued: a segment the callee maps twice (as received, and as sent on again
    by the caller in its own segment) stays out of reuse when one mapping goes."""
    def body(rank, world_size):
        if rank:
            return None
        size = 1 << 16
        spec = (torch.uint8, size, 90)
        y = rpc.rpc_sync("worker1", store_and_echo, args=("m1", make(*spec)))
        mine0 = shm.stats()
        rpc.rpc_sync("worker1", store, args=("m2", y))  # the same segment, a second lease
        sent_own = grew(mine0, shm.stats())["sent_own"]
        del y
        released = shm.stats()["released"]
        rpc.rpc_sync("worker1", drop, args=("m1",))
        assert wait_for(lambda: shm.stats()["released"] == released + 1)
        arrived = []
        for i in range(4):
            other = (torch.uint8, size, 91 + i)
            arrived.append(rpc.rpc_sync("worker1", matches, args=(make(*other), other)))
            assert wait_for(lambda: shm.stats()["leased"] == 1)
        return sent_own, arrived, rpc.rpc_sync("worker1", held_matches, args=("m2", spec))

    sent_own, arrived, held = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert sent_own == 1
    assert arrived == [True] * 4
    assert held, "the segment was reused while the callee still mapped it"


def test_a_forked_child_of_the_receiver_keeps_what_it_inherited():
    """(e) continued: the receiver forks (a DataLoader worker, say) while it holds a
    received tensor, then drops its own reference.  The child still holds the tensor:
    the sender recycling the segment must not change it.  (Through the socket or CMA
    the child's copy is ordinary private memory.)  Both kinds of mapping: a segment
    of the peer's (the callee forks), and one's own returned by reference (the
    caller forks)."""
    def body(rank, world_size):
        if rank:
            return None
        size = 1 << 16
        x = make(torch.uint8, size, 95)
        rpc.rpc_sync("worker1", fork_holder, args=(x,))
        assert wait_for(lambda: shm.stats()["leased"] == 0)  # released by the parent
        y = rpc.rpc_sync("worker1", echo, args=(make(torch.uint8, size, 96),))
        fork_holder(y)  # our own segment, mapped again: our child inherits it
        del y
        mine0, theirs0 = shm.stats(), rpc.rpc_sync("worker1", counters)
        for i in range(3):
            other = (torch.uint8, size, 97 + i)
            rpc.rpc_sync("worker1", matches, args=(make(*other), other))
            rpc.rpc_sync("worker1", fresh, args=(other,))
        recycled = grew(mine0, shm.stats())["reused"]
        theirs_recycled = grew(theirs0, rpc.rpc_sync("worker1", counters))["reused"]
        theirs_seen, mine_seen = rpc.rpc_sync("worker1", child_digest), child_digest()
        digest = [hashlib.sha256(bytes(make(torch.uint8, size, s).numpy())).digest()
                  for s in (95, 96)]
        return recycled, theirs_recycled, [theirs_seen, mine_seen] == digest

    recycled, theirs_recycled, unchanged = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert recycled >= 1 and theirs_recycled >= 1
    assert unchanged, "a later transfer changed a tensor a forked child holds"


def test_a_forked_child_dropping_an_inherited_tensor_ends_no_lease():
    """The child of a fork drops a received tensor it inherited while the receiver still
    holds it: the child must send nothing (on connections it inherited) and end no
    lease, or the sender recycles the segment under the receiver's tensor."""
    def body(rank, world_size):
        if rank:
            return None
        size, tries = 1 << 16, []
        for i in range(5):  # until the child's copy of the mapping dies there
            rpc.rpc_sync("worker1", store, args=(i, make(torch.uint8, size, 100 + i)))
            rpc.rpc_sync("worker1", counters)  # the thread that stored it is done
            tries.append(rpc.rpc_sync("worker1", fork_and_drop, args=(i,)))
            if tries[-1][0]:
                break
        leased = shm.stats()["leased"]
        for i in range(3):
            other = (torch.uint8, size, 110 + i)
            rpc.rpc_sync("worker1", matches, args=(make(*other), other))
        held = [rpc.rpc_sync("worker1", held_matches, args=(i, (torch.uint8, size, 100 + i)))
                for i in range(len(tries))]
        return tries, leased, held

    tries, leased, held = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert tries[-1][0], f"the child's mapping never died: {tries}"
    assert not any(posted for _, posted in tries), "a forked child sent a RELEASE"
    assert leased == len(tries), "a forked child ended its parent's lease"
    assert all(held), "the sender recycled a segment under the receiver's tensor"


def test_a_received_tensor_sent_on_another_connection_arrives_intact():
    """A tensor received from a peer, sent back to it in a request (not the response
    on the connection it came on), cannot go by reference: it is copied, intact."""
    def body(rank, world_size):
        if rank:
            return None
        spec = (torch.int64, 1 << 14, 81)
        rpc.rpc_sync("worker1", store, args=("r", make(*spec)))
        theirs0 = rpc.rpc_sync("worker1", counters)
        ok = rpc.rpc_sync("worker1", send_held_to, args=("worker0", "r", spec))
        return ok, grew(theirs0, rpc.rpc_sync("worker1", counters))

    ok, theirs = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert ok
    assert theirs["copies"] == 1 and theirs["sent_back"] == 0, theirs
