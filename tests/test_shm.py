"""What is particular to the shared-memory channel (torchwire/_wire/channels/shm.py and
segments.py).

tests/test_channels.py runs the same transfers through every channel; this file
covers shared memory alone: every dtype and size through it, views, the
descriptor cap per frame, copy-on-write isolation in both directions, the
zero-copy returns (back-references, own segments), segment recycling, when the
channel is (not) used, what 10 000 transfers leave behind, and what a receiver
does with a malformed descriptor.

Most tests set ``_channel_threshold=4096`` so that small tensors (cheap to make
and compare) take the channel; the default threshold (``shm_channel.MIN_SIZE``) is used
for the big ones.  Every job is fresh (``run_world``), so counters start at zero.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import gc
import hashlib
import os
import socket
import threading

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world, wait_until
from torchwire import ProtocolError
from torchwire._wire import frame as F
from torchwire._wire.channels import MAX_FDS
from torchwire._wire.channels import segments as shm
from torchwire._wire.channels import shm as shm_channel
from torchwire._wire.channels.link import ChannelSet
from torchwire._wire.connection import Connection

pytestmark = pytest.mark.skipif(not shm.available(),
                                reason="memfd and descriptor passing are not available")

SMALL = 4096  # _channel_threshold of the tests that send small tensors through shm
DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.bool]
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


# ----------------------------------------------------------------- helpers


def make(dtype, numel, seed, shape=None):
    """``numel`` elements of ``dtype`` with random bits (NaN payloads included), the
    same on every worker for the same ``seed``; 1-D unless ``shape`` is given."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw &= 1  # a bool byte other than 0 or 1 is not a value
    t = raw.view(dtype)
    return t if shape is None else t.view(shape)


def same(a, b) -> bool:
    """Same dtype, shape and bytes (bit-exact: NaN == NaN)."""
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def edited(t, edits):
    t = t.clone()
    for i, v in edits:
        t[i] = v
    return t


def bumped(t):
    t = t.clone()
    t[0] += 1
    return t


def wait_for(pred) -> bool:
    return wait_until(pred, 10.0)


def grew(before, after):
    return {k: after[k] - before[k] for k in ("created", "reused", "copies", "copied_bytes",
                                              "sent_back", "sent_own", "received")}


def connections():
    agent = rpc.api._get_current_rpc_agent()
    return agent.links.all()


def settled(peer) -> bool:
    """Neither this worker nor ``peer`` leases a segment or maps one."""
    theirs = rpc.rpc_sync(peer, counters)
    mine = shm.stats()
    return not (mine["leased"] or mine["mappings"] or theirs["leased"] or theirs["mappings"])


# ----------------------------------------------------------------- remote functions

_held: dict = {}  # tensors a callee keeps between calls


def counters():
    return shm.stats()


def echo(x):
    return x


def check_and_return(specs, tensors):
    """Compare with what ``make`` gives; return the tensors as received (unmodified:
    back-references) and fresh copies of them (new segments)."""
    ok = [same(t, make(*s)) for s, t in zip(specs, tensors)]
    return ok, tensors, [t.clone() for t in tensors]


def matches(t, spec, edits=()):
    return same(t, edited(make(*spec), edits))


def store(key, t):
    _held[key] = t


def store_and_echo(key, t):
    _held[key] = t
    return t


def store_slice(key, t, start, stop):
    _held[key] = t[start:stop]  # only a view: the received tensor itself is dropped


def held_matches(key, spec, start=0, stop=None):
    return same(_held[key], make(*spec)[start:stop])


def fetch(key):
    return _held[key]


def drop(key):
    del _held[key]


def mutate(t):
    """Write every byte of ``t`` in place; True if its values changed."""
    before = t.clone()
    t.bitwise_not_()
    return not torch.equal(t, before)


def mutate_held(key):
    return mutate(_held[key])


def modify_and_return(t, edits):
    for i, v in edits:
        t[i] = v
    return t


def bump(t):
    t[0] += 1
    return t


def fresh(spec):
    return make(*spec)


def fork_holder(t):
    """Fork a child that inherits ``t`` (as a DataLoader worker inherits a dataset) and
    waits; this process then drops ``t``."""
    ask, answer = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # only os calls and C code here: other threads' locks may be held
        os.read(ask[0], 1)
        os.write(answer[1], hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes)).digest())
        os._exit(0)
    os.close(ask[0])
    os.close(answer[1])
    _held["child"] = (pid, ask[1], answer[0])


def child_digest():
    """The digest of the tensor the child of :func:`fork_holder` inherited, as it sees it now."""
    pid, ask, answer = _held.pop("child")
    os.write(ask, b"?")
    digest = os.read(answer, 64)
    os.waitpid(pid, 0)
    os.close(ask)
    os.close(answer)
    return digest


def fork_and_drop(key):
    """A forked child drops its copy of the held tensor.  Returns whether the mapping
    died there (not if a thread that was finishing the call that stored it still
    held it at the fork) and whether the child then tried to send a RELEASE for it
    (it holds no lease of its own)."""
    done = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn = next(iter(rpc.api._get_current_rpc_agent().links.incoming))
        sent, mapped = conn.frames_out, shm.stats()["mappings"]
        del _held[key]
        gc.collect()
        died = shm.stats()["mappings"] < mapped
        posted = shm._releaser.pid == os.getpid()  # the child started a release thread
        if posted:  # let it write what it has to before this process exits
            wait_until(lambda: conn.frames_out > sent, 5.0)
        os.write(done[1], bytes([died, posted]))
        os._exit(0)
    os.close(done[1])
    died, posted = os.read(done[0], 2)
    os.waitpid(pid, 0)
    os.close(done[0])
    return bool(died), bool(posted)


def send_held_to(dst, key, spec):
    """Send a tensor received from ``dst`` back to it in a request of our own (a
    connection other than the one it came on: it cannot travel by reference)."""
    return rpc.rpc_sync(dst, matches, args=(_held[key], spec))


# ----------------------------------------------------------------- 1. integrity


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
        return [same(b, e) for b, e in zip(back, slices_back(x))], theirs

    intact, theirs = run_world(body, 2, _channel_threshold=SMALL)[0]
    assert intact == [True] * 5
    assert theirs["sent_back"] == 5 and theirs["copies"] == 0, theirs


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


# ----------------------------------------------------------------- 2. copy-on-write


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


def test_an_echoed_segment_is_waited_for_not_replaced():
    """(e) continued: echoing a big tensor again and again reuses one segment.  The
    callee's RELEASE leaves after its reply, so the caller's next send often comes
    before it: the sender waits (bounded) for that segment rather than creating and
    faulting in a new one (over a second for 1 GiB).  A callee that keeps what it
    sends back makes such waits vain: the sender stops waiting for it after a few."""
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


# ----------------------------------------------------------------- 3. channel choice


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


# ----------------------------------------------------------------- 4. hygiene


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


# ----------------------------------------------------------------- 5. bad input


class _StandIn:
    """A connection, as far as shm's import and export functions look at one."""

    closed = False
    peer_rank = 1


def _closed(fd) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        return exc.errno == errno.EBADF
    return False


def _memfd(size, sealed=True):
    fd = os.memfd_create("twtest", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    return fd


_IMPORT_ERRORS = {  # case -> what the ProtocolError says
    "unsealed": "not sealed",
    "pipe": "does not fit",  # not a regular file
    "smaller than said": "does not fit",
    "out of range": "does not fit",
    "empty": "cannot map",
}


@pytest.mark.parametrize("case", list(_IMPORT_ERRORS))
def test_import_fd_rejects_a_malformed_descriptor(case):
    extra = []
    if case == "pipe":
        fd, w = os.pipe()
        extra.append(w)
        args = (1, 4096, 0, 4096)
    elif case == "unsealed":
        fd, args = _memfd(4096, sealed=False), (1, 4096, 0, 4096)
    elif case == "smaller than said":
        fd, args = _memfd(4096), (1, 8192, 0, 8192)
    elif case == "out of range":
        fd, args = _memfd(4096), (1, 4096, 4000, 200)
    else:  # a buffer of 0 bytes: no sender makes one
        fd, args = _memfd(4096), (1, 4096, 0, 0)
    try:
        with pytest.raises(ProtocolError, match=_IMPORT_ERRORS[case]):
            shm.import_fd(_StandIn(), fd, *args)
        assert _closed(fd), "the descriptor was left open"
    finally:
        for x in extra:
            os.close(x)


def test_import_back_of_an_unknown_segment():
    with pytest.raises(ProtocolError, match="does not hold"):
        shm.import_back(_StandIn(), 987_654, 0, 4096)


def test_import_of_valid_segments_and_back_references():
    """The counterpart of the two tests above, in a child process (it maps segments and
    starts the release thread): a sealed segment maps, with its bytes; a back-reference
    is accepted only from the connection that holds the segment, within its size."""
    def body(rank, world_size, init_method):
        conn, other = _StandIn(), _StandIn()
        data = make(torch.uint8, 3 * 4096, 5)
        fd = _memfd(3 * 4096)
        os.pwrite(fd, data.numpy().tobytes(), 0)
        t = shm.import_fd(conn, fd, 1, 3 * 4096, 4096 + 10, 5000)
        imported = same(t, data[4096 + 10:4096 + 10 + 5000]) and _closed(fd)
        seg_id, _, offset, how, dup = shm.export(data, data.nbytes, conn)
        os.close(dup)
        errors = []
        for c, off, n in ((other, 0, 4096), (conn, 0, 4 * 4096), (conn, 3 * 4096, 1)):
            try:
                shm.import_back(c, seg_id, off, n)
                errors.append(None)
            except ProtocolError as exc:
                errors.append(str(exc))
        back = shm.import_back(conn, seg_id, 100, 1000)
        return (imported, how == shm.HOW_FD, errors, same(back, data[100:1100]),
                shm.stats()["own_mappings"])

    imported, by_fd, errors, back_same, own = run_world(body, 1, init=False)[0]
    assert imported
    assert by_fd
    assert all(e is not None for e in errors), errors
    assert back_same and own == 1


def _raw_frame(nbytes, ref):
    """A REQUEST (id 7, empty payload) of one shared-memory buffer."""
    return F.encode_header(F.K_REQUEST, 0, 7, 0, [nbytes | F.SHM_BIT]) + ref


def _memfd_links() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:twtest" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return n


_READ_ERRORS = {  # case -> what the ProtocolError closing the connection says
    "valid": None,
    "unsealed": "not sealed",
    "no descriptor": "without its descriptor",
    "unknown mode": "unknown shared-memory buffer mode",
    "unknown back-reference": "does not hold",
    "channel off": "without that channel",
}


@pytest.mark.parametrize("case", list(_READ_ERRORS))
def test_a_connection_reading_a_malformed_shm_buffer_closes(case):
    """A real Connection on a socketpair, fed frames by hand: a malformed buffer ends
    the connection with a ProtocolError, and the descriptor that came with it is
    closed; a valid one arrives, and its RELEASE goes back once it is dropped."""
    def body(rank, world_size, init_method):
        links0 = _memfd_links()  # descriptors inherited from the test process
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got, closed = [], threading.Event()
        result = {}

        def on_frames(conn, frames, at_rest):
            got.extend(frames)
            return False

        def on_close(conn, exc):
            result["exc"] = exc
            closed.set()

        conn = Connection(ours, 0, on_frames, on_close, initiated=False, transport="unix",
                          channels=ChannelSet(shm_recv=case != "channel off"))
        conn.start()
        fd = _memfd(2 * 4096, sealed=case != "unsealed")
        os.pwrite(fd, bytes(range(256)) * 32, 0)
        how = {"unknown mode": 9, "unknown back-reference": shm.HOW_BACK}.get(case, shm.HOW_FD)
        msg = _raw_frame(5000, F.SHM_REF.pack(3, 2 * 4096, 100, how))
        anc = [] if case == "no descriptor" else [
            (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        theirs.sendmsg([msg], anc)
        os.close(fd)
        if case == "valid":
            assert wait_for(lambda: got)
            (kind, _, rid, _, tensors), = got
            expect = (bytes(range(256)) * 32)[100:5100]
            ok = kind == F.K_REQUEST and rid == 7 and bytes(tensors[0].numpy()) == expect
            got.clear()
            del tensors
            theirs.settimeout(10)
            release = F.HEADER.unpack(theirs.recv(F.HEADER_SIZE, socket.MSG_WAITALL))
            theirs.close()
            closed.wait(10)
            return ok, release[2:5], _memfd_links() - links0
        done = closed.wait(10)
        exc = result.get("exc")
        theirs.close()
        return done, type(exc).__name__, str(exc), _memfd_links() - links0

    result = run_world(body, 1, init=False)[0]
    if case == "valid":
        ok, release, links = result
        assert ok
        assert release == (F.K_RELEASE, F.F_SHM, 3)  # kind, flags, segment id
        assert links == 0
        return
    done, exc_type, message, links = result
    assert done, "the connection stayed open"
    assert exc_type == "ProtocolError", message
    assert _READ_ERRORS[case] in message, message
    assert links == 0, "the descriptor the peer sent is still open"
