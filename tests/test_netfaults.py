"""Network faults across hosts: 3 workers on 3 network namespaces joined by a bridge.

Each worker runs in a network namespace of its own (its own stack, so torchwire
sees three hosts and uses TCP), with one veth into a "hub" namespace that
bridges them on 10.213.<n>.0/24 (addresses made here and nowhere else).
Rendezvous goes through a FileStore on the shared filesystem.  Cutting a link
is ``ip link set down`` on the hub side of a worker's veth.  Skipped where
namespaces cannot be created (not root, no iproute2, no veth or bridge).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

import torchwire
import torchwire.rpc as rpc
from _cluster import new_init_method, options, wait_until
from torchwire._agent.links import LinkState

_ctx = mp.get_context("fork")
_CLONE_NEWNET = 0x40000000
# what `ip` says where a container or kernel forbids namespaces, veth or bridges
_NOT_ALLOWED_HERE = ("Operation not permitted", "Permission denied", "not supported",
                     "Unknown device type", "Read-only file system")

pytestmark = pytest.mark.timeout(150)


def add(a, b):
    return a + b


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True,
                          timeout=10)


class Hosts:
    """Namespaces ``<tag>-h0..h2`` bridged in ``<tag>-hub``; deleted in :meth:`close`."""

    def __init__(self, n: int = 3) -> None:
        self.tag = f"tw{uuid.uuid4().hex[:6]}"
        self.subnet = 10 + os.getpid() % 200  # 10.213.<subnet>.0/24
        self.hub = f"{self.tag}-hub"
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.addrs = [f"10.213.{self.subnet}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            for ns in [self.hub, *self.names]:
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                # both ends are made inside the hub, then one end moves to the host
                _ip("-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name",
                    f"e{i}")
                _ip("-n", self.hub, "link", "set", f"e{i}", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", f"e{i}")
                _ip("-n", ns, "link", "set", f"e{i}", "up")
        except BaseException:
            self.close()
            raise

    def cut(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "up")

    def enter(self, i: int) -> None:
        """Move the calling (single-threaded, just forked) process into host ``i``."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.names[i]}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns failed")
        finally:
            os.close(fd)

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)  # takes its veth ends along
        self._made = []


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: iproute2 (`ip`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: creating them needs root")
    try:
        h = Hosts(3)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = str(getattr(exc, "stderr", "") or exc)
        if not any(why in detail for why in _NOT_ALLOWED_HERE):
            raise  # the machine allows them: a failure here is the test's to report
        pytest.skip(f"network namespaces with veth and a bridge cannot be created here: "
                    f"{detail}")
    try:
        yield h
    finally:
        h.close()


class _Warnings(logging.Handler):
    """torchwire's warnings in this (forked) worker, init's included."""

    messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _child(conn, hosts, rank, init_method, body, opts):
    try:
        logging.getLogger("torchwire").addHandler(_Warnings(logging.WARNING))
        hosts.enter(rank)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3,
                     rpc_backend_options=options(init_method, listen_addr=hosts.addrs[rank],
                                                 **opts))
        value = body(rank)
        rpc.shutdown()
        conn.send(("ok", value))
    except BaseException as exc:
        import traceback
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        os._exit(0)


def _run(hosts, body, timeout=90, **opts):
    init_method = new_init_method()
    procs = []
    try:
        for rank in range(3):
            parent, child = _ctx.Pipe(duplex=False)
            p = _ctx.Process(target=_child,
                             args=(child, hosts, rank, init_method, body, opts))
            p.start()
            child.close()
            procs.append((p, parent))
        out = []
        for rank, (_p, conn) in enumerate(procs):
            assert conn.poll(timeout), f"rank {rank}: no answer within {timeout}s"
            status, value = conn.recv()
            assert status == "ok", f"rank {rank}: {value}"
            out.append(value)
        return out
    finally:
        for p, _ in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def test_three_hosts_talk_over_tcp(hosts):
    def body(rank):
        peers = [r for r in range(3) if r != rank]
        got = [rpc.rpc_sync(f"worker{r}", add, args=(rank, r)) for r in peers]
        warned = [m for m in _Warnings.messages if "no auth_secret" in m]
        return got, rpc.api._get_current_rpc_agent().stats()["transports"], warned

    for rank, (got, transports, warned) in enumerate(_run(hosts, body)):
        assert got == [rank + r for r in range(3) if r != rank]
        assert transports == ["tcp"]
        # no secret across hosts: one warning for the job, by rank 0, naming the risk
        assert len(warned) == (rank == 0), warned
        assert not warned or ("3 hosts" in warned[0] and "can join the job" in warned[0])


def test_cut_link_honours_deadlines_and_a_restored_link_works_at_once(hosts):
    """Default options throughout.  worker0 and worker1 talk to worker2 before the
    cut, except that worker1 never reaches worker2 before it (first contact during
    the cut); worker0's heartbeat then declares worker2 down; after the restore the
    first call from each worker succeeds, with no retry."""
    cut, restored = _ctx.Event(), _ctx.Event()
    step = _ctx.Barrier(4)  # three workers and this process

    def body(rank):
        agent = rpc.api._get_current_rpc_agent()
        if rank == 0:
            assert rpc.rpc_sync("worker2", add, args=(1, 1)) == 2
        if rank != 2:
            assert rpc.rpc_sync(f"worker{1 - rank}", add, args=(1, 1)) == 2
        step.wait(30)  # now the link of worker2 goes down
        assert cut.wait(30)
        report = {}
        if rank != 2:
            t0 = time.monotonic()
            with pytest.raises((torchwire.RpcTimeoutError, torchwire.WorkerUnavailableError),
                               match="worker2"):
                rpc.rpc_sync("worker2", add, args=(1, 1), timeout=3)
            report["cut_call"] = time.monotonic() - t0
            assert rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 2), timeout=5) == 4
        if rank == 0:  # the heartbeat (10 s by default) finds the link silent
            assert wait_until(lambda: agent.links.state(2) is LinkState.DOWN, 20), \
                agent.links.state(2)
            report["down"] = agent.health.down()[2]
        step.wait(30)  # now the link comes back
        assert restored.wait(30)
        t0 = time.monotonic()
        peers = [r for r in range(3) if r != rank]
        for r in peers:
            assert rpc.rpc_sync(f"worker{r}", add, args=(3, 3), timeout=5) == 6
        report["recovered"] = time.monotonic() - t0
        report["state"] = [agent.links.state(r).value for r in peers]
        step.wait(30)
        return report

    results = {}

    def drive():
        try:
            step.wait(60)
            hosts.cut(2)
            cut.set()
            step.wait(60)
            hosts.restore(2)
            restored.set()
            step.wait(60)
        except Exception as exc:  # a broken barrier: the workers report why
            results["driver"] = exc

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    reports = _run(hosts, body)
    t.join(10)
    print("netns cut/restore:", reports)
    assert "driver" not in results, results
    assert "heartbeat" in reports[0]["down"]
    for r in reports[:2]:
        assert r["cut_call"] < 3.5
    for r in reports:
        assert r["recovered"] < 5
        # connected again: UP, or SUSPECT while the heartbeat awaits the answer to a PING
        assert set(r["state"]) <= {"up", "suspect"}, r["state"]


def _sum(t):
    return float(t.sum())


def test_a_transfer_longer_than_the_heartbeat_timeout_is_not_silence(hosts):
    """worker0's link is limited to 32 Mbit/s, so a 16 MiB call takes about 4 s, four
    heartbeat timeouts.  The receiver counts its reads; the sender, whose pings wait
    behind the frame, counts its writes the receiver drained: neither declares the
    other lost, and the call returns."""
    import torch
    subprocess.run(["ip", "netns", "exec", hosts.names[0], "tc", "qdisc", "add", "dev", "e0",
                    "root", "tbf", "rate", "32mbit", "burst", "64kb", "latency", "4s"],
                   check=True, capture_output=True, timeout=10)

    def body(rank):
        agent = rpc.api._get_current_rpc_agent()
        out = {}
        if rank == 0:
            t0 = time.monotonic()
            out["sum"] = rpc.rpc_sync("worker1", _sum, args=(torch.ones(4 << 20),),
                                      timeout=60)
            out["seconds"] = time.monotonic() - t0
        out["down"] = sorted(agent.health.down())
        return out

    reports = _run(hosts, body, heartbeat_interval=0.25, heartbeat_timeout=1.0)
    assert reports[0]["sum"] == 4 << 20
    assert reports[0]["seconds"] > 2.0, reports  # the limit held: longer than the timeout
    assert [r["down"] for r in reports] == [[], [], []], reports
