"""Nothing is left behind: file descriptors, shared memory, memory, after many transfers
and after a peer dies in the middle of one."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._wire.channels import segments as shm

CHANNELS = {"shm": None, "cma": ["cma"], "socket": ["socket"]}


def echo(x):
    return x


_started = None  # a fork-shared Event, made before the workers fork


def echo_started(x):
    """``echo`` that tells the caller its request has arrived (the reply goes next)."""
    _started.set()
    return x


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _sockets() -> dict:
    """Socket inode -> its addresses, from /proc/net (for failure messages)."""
    out = {}
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{proto}") as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    out[cols[9]] = f"{proto} {cols[1]}->{cols[2]} st={cols[3]}"
        except OSError:
            pass
    try:
        with open("/proc/net/unix") as f:
            for line in list(f)[1:]:
                cols = line.split()
                out[cols[6]] = f"unix st={cols[5]} {cols[7] if len(cols) > 7 else '(unnamed)'}"
    except OSError:
        pass
    return out


def _peer_of(inode: str) -> str:
    """The other end of a Unix socket and its owner, from ``ss`` if there is one."""
    import subprocess
    try:
        out = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    rows = {cols[5]: cols for cols in map(str.split, out.splitlines()) if len(cols) > 7}
    mine = rows.get(inode)
    if mine is None:
        return ""
    peer = rows.get(mine[7], [])
    return f" (pid {os.getpid()}) peer {mine[7]} {' '.join(peer[8:]) or '?'}"


def _fd_targets() -> list:
    """What the open descriptors point at, for a failure message to name."""
    out = []
    socks = None
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            socks = _sockets() if socks is None else socks
            target += " " + socks.get(target[8:-1], "?") + _peer_of(target[8:-1])
        out.append(f"{fd}:{target}")
    return sorted(out)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _shm() -> set:
    """/dev/shm's entries, less multiprocessing's semaphores ("sem.mp-"): tests that run
    beside this one (pytest-xdist) create and remove theirs meanwhile."""
    try:
        return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}
    except OSError:
        return set()


def _segment_maps() -> int:
    """Mappings of shared-memory segments (memfds named torchwire) in this process."""
    with open("/proc/self/maps") as f:
        return sum("memfd:torchwire" in line for line in f)


_measuring = threading.Lock()
_warmed = threading.Event()


def _wait_warmed() -> bool:
    return _warmed.wait(60)


def _state():
    """Released segments are a bounded cache (counted, then closed); what stays
    open or mapped after that is a leak.

    A worker measures itself while its peer's call measures it too, on a pool
    thread: one measurement's open /proc file would show in the other's count.
    The lock makes them take turns.  The descriptor count is the least of a few
    samples 20 ms apart: a descriptor that is open only for a moment (a liveness
    probe's socket, say) is not a leak, and a leaked one shows in every sample."""
    with _measuring:
        cached = shm.stats()["segments"]
        shm.clear()
        fds, targets = _fds(), _fd_targets()
        for _ in range(4):
            time.sleep(0.02)
            n = _fds()
            if n < fds:
                fds, targets = n, _fd_targets()
        return fds, _rss(), _shm(), _segment_maps(), cached, targets + [
            f"pid {os.getpid()} rpc.stats connections {rpc.stats()['connections']}"]


@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_ten_thousand_transfers_leave_no_fd_segment_or_memory_behind(channel):
    def body(rank, world_size):
        peer = f"worker{1 - rank}"
        sizes = [0, 1, 1000, 300_000, 2_000_000]  # bytes: inline and (>= 256 KiB) CMA
        tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
        for t in tensors:  # warm up: connections, buffer pool
            assert torch.equal(rpc.rpc_sync(peer, echo, args=(t,)), t)
        # Both warmed up before either measures: on a loaded machine one worker can
        # finish its warm-up before the other has opened its connection, and would
        # count that connection as grown.
        _warmed.set()
        assert rpc.rpc_sync(peer, _wait_warmed)
        before = rpc.rpc_sync(peer, _state), _state()
        for i in range(5000):  # 5000 each way at once: 10 000 transfers per worker pair
            t = tensors[i % len(tensors)]
            back = rpc.rpc_sync(peer, echo, args=(t,))
            if i % 997 == 0:
                assert torch.equal(back, t)
            del back
        # A descriptor that closes within a second or two (an accepted socket whose
        # handshake thread has not yet run, on a loaded machine) is not a leak; one
        # that stays through every sample is.
        for _ in range(10):
            time.sleep(0.2)
            after = rpc.rpc_sync(peer, _state), _state()
            if all(a[0] <= b[0] for a, b in zip(after, before)):
                break
        return before, after

    results = run_world(body, 2, timeout=180, _channels=CHANNELS[channel])
    for before, after in results:
        for (fds0, rss0, shm0, _, _, t0), (fds1, rss1, shm1, maps1, cached, t1) in zip(
                before, after):
            new = sorted(set(t1) - set(t0))
            assert fds1 <= fds0, f"file descriptors grew: {fds0} -> {fds1}; new: {new}; " \
                f"gone: {sorted(set(t0) - set(t1))}"
            assert maps1 == 0, f"{maps1} shared-memory segments still mapped"
            assert cached <= 4, f"{cached} segments cached for 2 sizes of buffer"
            assert shm1 <= shm0, f"new /dev/shm entries: {shm1 - shm0}"
            assert rss1 - rss0 < 64 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"


@pytest.mark.parametrize("link", [{"_channels": ["cma"]}, {"_transports": ["tcp"]}],
                         ids=["unix-cma", "tcp-lanes"])
def test_a_peer_dying_mid_transfer_leaves_the_survivor_clean(link):
    global _started
    _started = mp.get_context("fork").Event()

    def body(rank, world_size, init_method):
        from _cluster import die, options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20, **link))
        # 64 MiB; 256 MiB over TCP, whose lanes move 64 MiB within tens of ms
        big = torch.ones((256 if "_transports" in link else 64) << 20, dtype=torch.uint8)
        if rank == 1:
            rpc.rpc_sync("worker0", echo, args=(torch.ones(4),))
            inflight = rpc.rpc_async("worker0", echo_started, args=(big,))
            assert _started.wait(20), "worker0 never ran the call"
            die(("died", inflight.done()))  # its reply on the way: not done
        fds0, rss0, shm0, _, _, _ = _state()  # no call of ours: worker1 may already be dying
        from _cluster import wait_until
        health = rpc.api._get_current_rpc_agent().health
        assert wait_until(lambda: health.is_down(1), 10)  # its death is known here
        with pytest.raises(rpc.WorkerUnavailableError, match="worker1"):
            rpc.rpc_sync("worker1", echo, args=(big,), timeout=10)
        del big
        import gc
        gc.collect()
        # Readers of the closed connections (and lanes) close their sockets as they
        # exit: give them a bounded moment.
        wait_until(lambda: _fds() <= fds0, timeout=5.0)
        fds1, rss1, shm1, maps1, _, _ = _state()
        rpc.shutdown(graceful=False)
        return fds0, fds1, rss0, rss1, shm0, shm1, maps1

    results = run_world(body, 2, init=False, timeout=90)
    assert results[1] == ("died", False)
    fds0, fds1, rss0, rss1, shm0, shm1, maps1 = results[0]
    assert fds1 <= fds0, f"file descriptors grew: {fds0} -> {fds1}"
    assert maps1 == 0, f"{maps1} shared-memory segments still mapped"
    assert shm1 <= shm0
    assert rss1 - rss0 < 96 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"


def hold(x, seconds):
    time.sleep(seconds)
    return x


def test_a_peer_dying_while_mapping_segments_leaves_the_survivor_clean():
    """Shared memory: each worker maps a segment of the other's when worker1 dies.
    worker0 then holds a mapping of a dead peer's segment (freed when its tensor
    goes) and a segment leased to the dead peer (never reused; closed)."""
    def body(rank, world_size, init_method):
        from _cluster import die, options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=20))
        big = torch.ones(64 << 20, dtype=torch.uint8)
        peer = f"worker{1 - rank}"
        rpc.rpc_sync(peer, echo, args=(torch.ones(4),))
        if rank == 0:
            fds0, rss0, shm0, _, _, _ = _state()
        rpc.api._barrier(["worker0", "worker1"])
        fut = rpc.rpc_async(peer, hold, args=(big, 5 if rank == 1 else 30))  # runs on peer
        if rank == 1:
            from _cluster import wait_until
            # worker0's hold() has our segment mapped (leased to it); we map theirs
            assert wait_until(lambda: shm.stats()["mappings"] == 1
                              and shm.stats()["leased"] >= 1, 10), shm.stats()
            die(("died", fut.done(), shm.stats()["mappings"]))
        with pytest.raises(rpc.WorkerUnavailableError, match="worker1"):
            fut.wait()
        # the reader fails pending calls first, then closes the connection, which ends
        # its leases: give it a bounded moment
        from _cluster import wait_until
        wait_until(lambda: shm.stats()["leased"] == 0, timeout=5.0)
        leased = shm.stats()["leased"]
        del big, fut
        import gc
        gc.collect()
        # our hold() returns (its reply cannot go) and drops its mapping
        wait_until(lambda: shm.stats()["mappings"] == 0, 10)
        fds1, rss1, shm1, maps1, _, _ = _state()
        rpc.shutdown(graceful=False)
        return fds0, fds1, rss0, rss1, shm0, shm1, maps1, leased

    if not shm.available():
        pytest.skip("memfd and descriptor passing are not available on this platform")
    results = run_world(body, 2, init=False, timeout=90)
    assert results[1] == ("died", False, 1)  # worker1 mapped worker0's segment
    fds0, fds1, rss0, rss1, shm0, shm1, maps1, leased = results[0]
    assert leased == 0, "a segment leased to the dead peer is still counted as leased"
    assert fds1 <= fds0, f"file descriptors grew: {fds0} -> {fds1}"
    assert maps1 == 0, f"{maps1} shared-memory segments still mapped"
    assert shm1 <= shm0
    assert rss1 - rss0 < 96 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"
