"""What is particular to the shared-memory channel (torchwire/_wire/channels/shm.py and
segments.py).

tests/test_channels.py runs the same transfers through every channel; this file
covers shared memory alone: every dtype and size through it, views, the
descriptor cap per frame, transfers both ways at once, when the channel is (not)
used, and what 10 000 transfers leave behind.  Copy-on-write isolation, zero-copy
returns and segment recycling are in tests/test_shm_copy_on_write.py; what a
receiver does with a malformed descriptor, in tests/test_shm_malformed.py.

Most tests set ``_channel_threshold=4096`` so that small tensors (cheap to make
and compare) take the channel; the default threshold (``shm_channel.MIN_SIZE``) is used
for the big ones.  Every job is fresh (``run_world``), so counters start at zero.
"""

from __future__ import annotations

import ctypes
import os
import resource

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from _shm_helpers import (SMALL, bump, bumped, check_and_return, connections, counters, drop,
                          echo, edited, grew, held_matches, make, modify_and_return, same,
                          settled, store, wait_for)
from torchwire._wire.channels import MAX_FDS
from torchwire._wire.channels import segments as shm
from torchwire._wire.channels import shm as shm_channel

pytestmark = pytest.mark.skipif(not shm.available(),
                                reason="memfd and descriptor passing are not available")

DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.bool]


# ----------------------------------------------------------------- integrity


def _sizes(dtype, threshold):
    """Element counts: empty, one, just under, at and just over the threshold, not a
    page multiple, a megabyte."""
    k = torch.empty(0, dtype=dtype).element_size()
    return [0, 1, threshold // k - 1, threshold // k, threshold // k + 1,
            (5 * 4096 + 13 * k) // k, (1 << 20) // k + 3]


def test_every_dtype_and_size_arrives_intact():
    def body(rank, world_size):
        if rank:
            return None
        failures, expected = [], 0
        mine0, theirs0 = shm.stats(), rpc.rpc_sync("worker1", counters)
        for i, dtype in enumerate(DTYPES):
            specs = [(dtype, n, 100 * i + j) for j, n in enumerate(_sizes(dtype, SMALL))]
            specs.append((dtype, 1, 99, ()))  # a 0-dim tensor
            tensors = [make(*s) for s in specs]
            expected += sum(t.nbytes >= SMALL for t in tensors)
            ok, back, copies = rpc.rpc_sync("worker1", check_and_return, args=(specs, tensors))
            for s, t, good, b, c in zip(specs, tensors, ok, back, copies):
                if not (good and same(b, t) and same(c, t)):
                    failures.append((s, good, same(b, t), same(c, t)))
        mine, theirs = grew(mine0, shm.stats()), grew(theirs0, rpc.rpc_sync("worker1", counters))
        return failures, expected, mine, theirs

    failures, expected, mine, theirs = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert failures == []
    assert expected == len(DTYPES) * 4  # at, just over, 5 pages and 1 MiB
    # Each buffer of >= 4096 bytes: copied into a segment here, mapped there; returned
    # as received by reference (no copy), and its clone copied there, mapped here.
    assert mine["copies"] == expected and theirs["received"] == expected, (mine, theirs)
    assert theirs["sent_back"] == expected and theirs["copies"] == expected, theirs
    assert mine["received"] == expected, mine


def test_big_tensors_at_the_default_threshold():
    def body(rank, world_size):
        if rank:
            return None
        mib = shm_channel.MIN_SIZE
        specs = [(torch.uint8, mib - 1, 1), (torch.uint8, mib, 2), (torch.uint8, mib + 1, 3),
                 (torch.int16, (3 * mib + 6) // 2, 4), (torch.float32, 16 * mib, 5)]
        tensors = [make(*s) for s in specs]
        mine0 = shm.stats()
        ok, back, copies = rpc.rpc_sync("worker1", check_and_return, args=(specs, tensors))
        intact = [good and same(b, t) and same(c, t)
                  for good, t, b, c in zip(ok, tensors, back, copies)]
        return intact, grew(mine0, shm.stats()), [t.nbytes for t in tensors]

    intact, mine, sizes = run_world(body, 2)[0]
    mib = shm_channel.MIN_SIZE
    assert sizes == [mib - 1, mib, mib + 1, 3 * mib + 6, 64 * mib]
    assert intact == [True] * 5
    # Just under the threshold goes by CMA; the four others through shared memory.
    assert mine["copies"] == 4 and mine["received"] == 4, mine
    assert mine["copied_bytes"] == sum(sizes[1:]), mine


def views_of(base):
    """Views of a (4096, 1024) float32 tensor, and of a complex one (lazy conjugate)."""
    flat = base.view(-1)
    return [
        base[100:300],  # rows in the middle: contiguous, storage offset
        base.t(),  # transposed: travels as the strided region it spans
        base[:, 1:],  # rows minus one column: strided, the region with its gaps
        base[5:900:3, 7:1000:2],  # sparse: compacted before sending
        flat[1_000_003:1_005_003],  # odd offset, not a page multiple
        base[0:1].expand(64, 1024),  # stride 0
        flat.view(torch.uint8)[1:12_290],  # another dtype, unaligned start
        torch.complex(base[:64], base[64:128]).conj(),  # lazy conjugate: its values
    ]


def check_views(views):
    expect = views_of(torch.arange(4 << 20, dtype=torch.float32).view(4096, 1024))
    ok = [same(v.contiguous(), e.resolve_conj().contiguous()) for v, e in zip(views, expect)]
    return ok, views


def test_views_send_their_own_elements():
    def body(rank, world_size):
        if rank:
            return None
        base = torch.arange(4 << 20, dtype=torch.float32).view(4096, 1024)
        views = views_of(base)
        ok, back = rpc.rpc_sync("worker1", check_views, args=(views,))
        intact = [same(b.contiguous(), v.resolve_conj().contiguous())
                  for b, v in zip(back, views)]
        # A view into the middle of a 64 MiB storage: only its own 1 MiB travels.
        storage = torch.zeros(64 << 20, dtype=torch.uint8)
        middle = storage[(20 << 20) + 123:(21 << 20) + 123]
        middle.copy_(make(torch.uint8, 1 << 20, 7))
        before = shm.stats()
        got = rpc.rpc_sync("worker1", echo, args=(middle,))
        moved = grew(before, shm.stats())["copied_bytes"]
        return (ok, intact, moved, got.untyped_storage().nbytes(), same(got, middle))

    ok, intact, moved, got_storage, got_same = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert all(ok), ok
    assert all(intact), intact
    assert moved == 1 << 20 and got_storage == 1 << 20 and got_same


def slices_back(t):
    """Views of a received tensor, returned unmodified: by reference, each at its offset."""
    return [t[3:], t[1000:2000], t.view(4, -1)[1], t[7::2], t]


def test_views_of_a_received_tensor_return_by_reference():
    def body(rank, world_size):
        if rank:
            return None
        x = make(torch.float64, 1 << 16, 3)  # 512 KiB
        theirs0 = rpc.rpc_sync("worker1", counters)
        back = rpc.rpc_sync("worker1", slices_back, args=(x,))
        theirs = grew(theirs0, rpc.rpc_sync("worker1", counters))
        storages = {b.untyped_storage().data_ptr() for b in back}
        return [same(b, e) for b, e in zip(back, slices_back(x))], theirs, len(storages)

    intact, theirs, storages = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert intact == [True] * 5
    # the five views of one storage go back as one region of it, and arrive sharing it
    assert theirs["sent_back"] == 1 and theirs["copies"] == 0, theirs
    assert storages == 1


def test_more_buffers_than_descriptors_per_frame():
    n = MAX_FDS + 50

    def body(rank, world_size):
        if rank:
            return None
        specs = [(torch.uint8, 8192, i) for i in range(n)]
        tensors = [make(*s) for s in specs]
        theirs0 = rpc.rpc_sync("worker1", counters)
        ok, back, copies = rpc.rpc_sync("worker1", check_and_return, args=(specs, tensors))
        theirs = grew(theirs0, rpc.rpc_sync("worker1", counters))
        intact = sum(good and same(b, t) and same(c, t)
                     for good, t, b, c in zip(ok, tensors, back, copies))
        return intact, theirs

    intact, theirs = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert intact == n
    # One frame carries at most _MAX_FDS descriptors; the other buffers go inline.
    assert theirs["received"] == MAX_FDS, theirs
    assert theirs["copies"] == MAX_FDS, theirs


def test_concurrent_transfers_in_both_directions():
    def body(rank, world_size):
        peer = f"worker{1 - rank}"
        sizes = [100, 5000, 70_000, (1 << 20) + 3]
        specs = [(torch.uint8, sizes[i % 4], 1000 * rank + i) for i in range(200)]
        futs = []
        for i, s in enumerate(specs):  # both workers at once, every call in flight
            fn, args = ((echo, (make(*s),)) if i % 3 == 0 else
                        (modify_and_return, (make(*s), [(0, 1)])) if i % 3 == 1 else
                        (check_and_return, ([s], [make(*s)])))
            futs.append(rpc.rpc_async(peer, fn, args=args))
        bad = []
        for i, (s, fut) in enumerate(zip(specs, futs)):
            got = fut.wait()
            if i % 3 == 0:
                good = same(got, make(*s))
            elif i % 3 == 1:
                good = same(got, edited(make(*s), [(0, 1)]))
            else:
                good = got[0] == [True] and same(got[1][0], make(*s)) and same(got[2][0], make(*s))
            if not good:
                bad.append(i)
        del futs, fut, got  # the last value would keep its segment mapped
        rpc.api._barrier(["worker0", "worker1"])
        return bad, wait_for(lambda: settled(peer)), shm.stats()["copies"]

    for bad, clean, copies in run_world(body, 2, _channel_threshold=SMALL):
        assert bad == []
        assert clean, "segments still leased or mapped after every call returned"
        assert copies >= 100  # the channel carried them


# ----------------------------------------------------------------- channel choice


@pytest.mark.parametrize("opts, uses_shm", [
    ({}, True),
    ({"_channels": ["cma"]}, False),
    ({"_channels": ["socket"]}, False),
    ({"_transports": ["tcp"]}, False),
], ids=["default", "cma", "socket", "tcp"])
def test_which_connections_use_shared_memory(opts, uses_shm):
    def body(rank, world_size):
        peer = f"worker{1 - rank}"
        x = make(torch.uint8, 4 << 20, rank)
        ok = same(rpc.rpc_sync(peer, echo, args=(x,)), x)
        rpc.api._barrier(["worker0", "worker1"])
        conns = connections()
        return (ok, [c.channels.sends("shm") for c in conns],
                [c.channels.receives("shm") for c in conns],
                [c.transport for c in conns], shm.stats())

    for ok, send, recv, transports, stats in run_world(body, 2, **opts):
        assert ok
        assert len(send) == 2  # one connection each way
        if uses_shm:
            assert transports == ["unix", "unix"]
            assert send == [True, True] and recv == [True, True]
            assert stats["copies"] >= 1 and stats["received"] >= 1, stats
        else:
            assert send == [False, False] and recv == [False, False]
            assert all(v == 0 for v in stats.values()), stats


# ----------------------------------------------------------------- hygiene


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _segment_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:torchwire" in line for line in f)


def test_ten_thousand_transfers_leave_nothing_behind():
    calls = 2500  # per worker, both at once, each a transfer there and one back

    def body(rank, world_size):
        peer = f"worker{1 - rank}"
        tensors = [make(torch.uint8, n, 10 * rank + i)
                   for i, n in enumerate((5000, 8192, 20_000, 70_000))]
        for t in tensors:  # warm up: connections, segments of each size
            assert same(rpc.rpc_sync(peer, echo, args=(t,)), t)
            assert same(rpc.rpc_sync(peer, bump, args=(t,)), bumped(t))
        rpc.api._barrier(["worker0", "worker1"])
        assert wait_for(lambda: settled(peer))
        shm.clear()
        before = _fds(), _segment_maps(), shm.stats()["leased"]
        stats0 = shm.stats()
        rpc.api._barrier(["worker0", "worker1"])  # the peer's calls start after it
        for i in range(calls):
            t = tensors[i % len(tensors)]
            back = rpc.rpc_sync(peer, echo if i % 2 else bump, args=(t,))
            if i % 101 == 0:
                assert same(back, t if i % 2 else bumped(t)), i
            del back
        rpc.api._barrier(["worker0", "worker1"])  # the peer's calls (served here) done too
        moved = grew(stats0, shm.stats())
        clean = wait_for(lambda: settled(peer))
        cached = shm.stats()["free"]  # every segment released: kept for reuse
        shm.clear()
        after = _fds(), _segment_maps(), shm.stats()["leased"]
        rpc.api._barrier(["worker0", "worker1"])
        return before, after, clean, cached, moved, shm.stats()["segments"]

    for before, after, clean, cached, moved, left in run_world(
            body, 2, timeout=120, _channel_threshold=SMALL):
        assert moved["copies"] >= calls, moved  # sends went through shared memory
        assert moved["sent_back"] >= calls // 2, moved  # and echoes came back by reference
        assert clean, "segments still leased or mapped after every call returned"
        assert after == before, f"(fds, segment mappings, leased): {before} -> {after}"
        assert left == 0, f"{left} segments still open after clear()"
        # the cache is bounded (shm.MAX_FREE), however late the releases came
        assert cached <= shm.MAX_FREE, (f"{cached} segments cached for 4 sizes of buffer "
                             f"({moved['created']} created during the run)")



def test_a_large_new_segment_is_faulted_in_a_chunk_at_a_time_outside_the_lock(monkeypatch):
    # One MAP_POPULATE of a 3 GiB segment held the process's memory-map lock for 5 s:
    # no thread could start meanwhile (a pool thread sending a heartbeat's reply), and
    # the peer declared this worker lost.
    from torchwire._wire.channels import memory
    mib = 1 << 20
    pool = shm._Segments()
    mapped, populated = [], []
    map_fd, madvise = memory.map_fd, memory._libc.madvise

    def record_map(fd, length, flags, offset=0):
        mapped.append((length, bool(flags & memory.MAP_POPULATE)))
        return map_fd(fd, length, flags, offset)

    def record_madvise(addr, length, advice):
        if advice == memory.MADV_POPULATE_WRITE:
            populated.append((length, pool.lock._is_owned()))
        return madvise(addr, length, advice)

    monkeypatch.setattr(memory, "map_fd", record_map)
    monkeypatch.setattr(memory._libc, "madvise", record_madvise)
    size = 3 * memory.POPULATE_CHUNK + mib
    small = pool._acquire(mib)
    big = pool._acquire(size)
    try:
        assert mapped == [(mib, True), (size, False)]  # a small one at once, as before
        assert [n for n, _ in populated] == [memory.POPULATE_CHUNK] * 3 + [mib]
        assert not any(held for _, held in populated), "populated under the pool's lock"
        # the pages are in: writing every one of them faults (almost) none
        view = torch.frombuffer((ctypes.c_char * size).from_address(big.addr),
                                dtype=torch.uint8)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        view.fill_(1)
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 64
    finally:
        with pool.lock:
            for seg in (small, big):
                pool._close(seg)


def test_a_send_over_the_lease_limit_waits_for_the_peers_release():
    # A peer releases what it received after its reply; a large call sent at once found
    # the first still leased and, over MAX_LEASED, went through the socket (a second
    # 3 GiB call: 12-28 s).  It waits for the release now, and a peer that keeps what
    # it holds is not waited for again.
    import threading

    def body(rank, world_size):
        if rank:
            return None
        shm_channel.MAX_LEASED = 24 << 20  # this worker's sends only
        mib16 = 16 << 20
        rpc.rpc_sync("worker1", store, args=("a", make(torch.uint8, mib16, 1)))
        before = shm.stats()
        second = []
        sender = threading.Thread(target=lambda: second.append(
            rpc.rpc_sync("worker1", store, args=("b", make(torch.uint8, mib16, 2)))))
        sender.start()
        waiting = wait_for(lambda: shm.stats()["room_waits"] > before["room_waits"])
        rpc.rpc_sync("worker1", drop, args=("a",))  # its release lets "b" in
        sender.join(30)
        after = shm.stats()
        intact = rpc.rpc_sync("worker1", held_matches, args=("b", (torch.uint8, mib16, 2)))
        # "b" now stays held: two more sends find no room and wait in vain, then none waits
        for seed in (3, 4, 5):
            rpc.rpc_sync("worker1", store, args=(f"c{seed}", make(torch.uint8, mib16, seed)))
        last = shm.stats()
        return (waiting, second, intact, after["copies"] - before["copies"],
                after["vain_room_waits"] - before["vain_room_waits"],
                last["room_waits"] - after["room_waits"],
                last["vain_room_waits"] - after["vain_room_waits"],
                last["copies"] - after["copies"])

    waiting, second, intact, copies, vain, waits, vain_after, copies_after = \
        run_world(body, 2)[0]
    assert waiting and second == [None] and intact
    assert copies == 1 and vain == 0  # through shared memory, after one wait
    assert waits == 2 and vain_after == 2 and copies_after == 0  # then the socket
