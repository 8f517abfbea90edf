"""The receiver's kept mappings of a peer's segments (torchwire/_wire/channels/mappings.py).

A receiver keeps a peer's segment mapped after the tensor over it dies, so the next
buffer that arrives in the same segment is read without page faults.  These tests
check what that must never change: every message reads exactly what was sent (also
after the previous tensor wrote its pages), the kept mappings go when their owner
closes the segment or the connection closes, and they stay under their bound.
"""

from __future__ import annotations

import resource

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world, wait_until
from torchwire._wire.channels import mappings
from torchwire._wire.channels import segments as shm

pytestmark = pytest.mark.skipif(not shm.available(),
                                reason="memfd and descriptor passing are not available")

SMALL = 4096  # _channel_threshold: small tensors take the shm channel
MIB = 1 << 20


def make(numel, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)


def counters():
    return shm.stats()


def read_all(t, seed):
    """Whether ``t`` holds ``make(t.numel(), seed)``, and the page faults this thread
    took reading every byte of it."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.max()  # a reduction: reads every byte, allocates nothing
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    return torch.equal(t, make(t.numel(), seed)), faults


def check_then_write(t, seed, pages):
    """Whether ``t`` holds what was sent; then overwrite its first ``pages`` pages."""
    ok = torch.equal(t, make(t.numel(), seed))
    t[:pages * 4096].bitwise_not_()
    return ok


def set_cache_limit(n):
    mappings.CACHE_LIMIT = n


def _reuse_body(rank, world_size):
    if rank:
        return None
    n = 8 * MIB
    before = rpc.rpc_sync("worker1", counters)
    results = [rpc.rpc_sync("worker1", read_all, args=(make(n, i), i)) for i in range(8)]
    after = rpc.rpc_sync("worker1", counters)
    return (results, after["cache_hits"] - before["cache_hits"],
            after["received"] - before["received"])


def test_a_segment_received_again_is_read_without_page_faults():
    results, hits, received = run_world(_reuse_body, 2, _channel_threshold=SMALL)[0]
    assert all(ok for ok, _ in results), "a message read other bytes than were sent"
    assert received == 8 and hits >= 5, (received, hits)
    # Uncached, reading 8 MiB of a fresh private mapping faults once per 64 KiB (128);
    # from a kept mapping the page table is filled already.
    assert sorted(f for _, f in results)[len(results) // 2] < 32, results


def _scrub_body(rank, world_size):
    if rank:
        return None
    n = 4 * MIB
    before = rpc.rpc_sync("worker1", counters)
    ok = []
    for i in range(10):  # half the pages, all of them, none, in turn
        pages = (n // 4096) * (i % 3) // 2
        ok.append(rpc.rpc_sync("worker1", check_then_write, args=(make(n, 100 + i), 100 + i,
                                                                 pages)))
    after = rpc.rpc_sync("worker1", counters)
    return ok, after["cache_hits"] - before["cache_hits"], after["scrubbed_pages"]


def test_pages_a_tensor_wrote_never_show_in_the_next_message():
    """The callee writes (copy-on-write) pages of each tensor it gets; the next tensor
    that arrives in the same segment must read the sender's bytes, not those writes."""
    ok, hits, scrubbed = run_world(_scrub_body, 2, _channel_threshold=SMALL)[0]
    assert all(ok), f"a message showed the previous tensor's writes: {ok}"
    assert hits >= 6, hits
    assert scrubbed > 0


def _forget_body(rank, world_size):
    if rank:
        return None
    for i in range(3):
        rpc.rpc_sync("worker1", read_all, args=(make(2 * MIB, i), i))
    cached = rpc.rpc_sync("worker1", counters)["cached"]
    assert wait_until(lambda: shm.stats()["leased"] == 0, 10.0)
    shm.clear()  # closes our released segments: worker1 must unmap what it keeps of them
    forgotten = wait_until(lambda: rpc.rpc_sync("worker1", counters)["cached"] == 0, 10.0)
    return cached, forgotten, shm.stats()["segments"]


def test_a_segment_its_owner_closes_is_unmapped_by_the_receiver():
    cached, forgotten, segments = run_world(_forget_body, 2, _channel_threshold=SMALL)[0]
    assert cached >= 1
    assert segments == 0
    assert forgotten, "the receiver kept a mapping of a segment its owner closed"


_held: dict = {}


def store(key, t):
    _held[key] = t


def held_intact(seeds):
    ok = all(torch.equal(_held[s], make(MIB, s)) for s in seeds)
    _held.clear()
    return ok


def _bound_body(rank, world_size):
    if rank:
        return None
    rpc.rpc_sync("worker1", set_cache_limit, args=(3 * MIB,))
    seeds = list(range(6))
    for s in seeds:  # all held at once: six segments
        rpc.rpc_sync("worker1", store, args=(s, make(MIB, s)))
    stats = rpc.rpc_sync("worker1", counters)
    ok = rpc.rpc_sync("worker1", held_intact, args=(seeds,))
    rpc.rpc_sync("worker1", set_cache_limit, args=(1 << 30,))
    return ok, stats


def test_the_kept_mappings_stay_under_their_bound():
    ok, stats = run_world(_bound_body, 2, _channel_threshold=SMALL)[0]
    assert ok, "a tensor held beyond the bound changed"
    assert stats["mappings"] == 6 and 0 < stats["cached_bytes"] <= 3 * MIB, stats


def _close_body(rank, world_size, init_method):
    from _cluster import options
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method, _channel_threshold=SMALL))
    before = None
    if rank == 0:
        for i in range(3):
            rpc.rpc_sync("worker1", read_all, args=(make(2 * MIB, i), i))
            rpc.rpc_sync("worker1", make, args=(2 * MIB, i))  # worker0 keeps one of theirs
        before = [shm.stats()["cached"], rpc.rpc_sync("worker1", counters)["cached"]]
    rpc.shutdown()
    return before, shm.stats()["cached"], shm.stats()["cached_bytes"]


def test_kept_mappings_go_with_their_connection():
    results = run_world(_close_body, 2, init=False)
    assert min(results[0][0]) >= 1, results
    assert all(after == 0 and nbytes == 0 for _, after, nbytes in results), results
