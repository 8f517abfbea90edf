"""Per-peer metrics outlive the connections they were counted on.

A worker keeps a latency histogram per live connection its calls went on, and reads
bytes from its connections.  When a connection ends (its peer killed and started
again, a member that left a dynamic group), what it counted is folded into its
peer's record: the per-connection table stays as small as the live connections, and
the totals of ``rpc.stats()`` and the Prometheus counters keep everything ever
counted, so they never go down.

Real forked processes, as in ``test_rejoin.py``: this process kills each incarnation
of ``worker1`` and starts the next one, while ``worker0`` keeps running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import (_kill, child_result, new_init_method, options, start_child,
                      wait_until)
from torchwire._agent.metrics import CallMetrics

_ctx = mp.get_context("fork")
WAIT = 30  # seconds any process waits for an event before failing
RESTARTS = 3  # incarnations of worker1 killed; one more is alive at the end
CALLS = 4  # echo calls worker0 makes to each incarnation
SIZE = 64 << 10  # floats per echoed tensor (256 KiB each way)
LANED = 9 << 20  # bytes of the one tensor per incarnation big enough for a TCP lane

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- the fold itself


class _Conn:
    """What ``CallMetrics.link_closed`` and ``bytes_by_peer`` read of a connection."""

    def __init__(self, rank: int, out: int, in_: int) -> None:
        self.peer_rank, self.bytes_out, self.bytes_in = rank, out, in_
        self.lane = False


def test_a_closed_connection_is_folded_into_its_peer_and_counted_once():
    m = CallMetrics()
    conns = []
    for k in range(5):
        conn = _Conn(1, 100, 1000)
        conns.append(conn)
        for ns in (1_000, 2_000_000):
            m.replied(id(conn), 1, ns, None)
        assert repr(m) == "<CallMetrics 1 peers 1 links>"
        listed = [conn]  # what a report listed, before the connection closed
        m.link_closed(conn)
        assert repr(m) == "<CallMetrics 1 peers 0 links>"
        assert m.bytes_by_peer(listed) == {1: [100 * (k + 1), 1000 * (k + 1)]}
    lane = _Conn(1, 50, 0)  # a lane's halves belong to frames counted whole elsewhere
    m.link_closed(lane, lane=True)
    live = _Conn(2, 7, 8)
    m.replied(id(live), 2, 500, ValueError("remote"))
    assert m.bytes_by_peer([live]) == {1: [500, 5000], 2: [7, 8]}
    snap = m.snapshot()
    assert snap[1]["replies"] == 10 and snap[2]["replies"] == 1
    assert snap[2]["errors"] == {"ValueError": 1}
    assert 1e-6 <= snap[1]["latency_p50_s"] <= 1.25e-6
    assert 2e-3 <= snap[1]["latency_p99_s"] <= 2.5e-3
    assert snap[1]["latency_mean_s"] == pytest.approx((1_000 + 2_000_000) / 2 / 1e9)
    assert len(m._by_link) == 1 and repr(m._peers[1]) == \
        "<PeerMetrics n=10 links=0 errors=0 timeouts=0>"


# ---------------------------------------------------------------- a peer restarted


def echo(t):
    return t


def pid():
    return os.getpid()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork(fn, *args):
    """A process running ``fn(*args)`` (no ``init_rpc`` of its own: ``fn`` makes it)."""
    return start_child(lambda *_: fn(*args), 0, None, "")


def _result(proc, timeout=90):
    return child_result(proc, timeout)


_COUNTER = re.compile(r"^(torchwire_\w+_total)(\{[^}]*\})? ([0-9.e+]+)$", re.M)


def _scrape(url: str) -> dict[str, float]:
    """The Prometheus counters the endpoint serves, by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {name + (labels or ""): float(v) for name, labels, v in _COUNTER.findall(text)}


def _new_incarnation(old: int | None) -> tuple[int, int]:
    """Call worker1 until a process other than ``old`` answers; returns its pid and
    how many calls got a reply."""
    deadline = time.monotonic() + WAIT
    replies = 0
    while True:
        try:
            now = rpc.rpc_sync("worker1", pid, timeout=5)
            replies += 1
            if now != old:
                return now, replies
        except (torchwire.WorkerUnavailableError, rpc.UnknownWorkerError):
            pass  # the old incarnation is gone and the new one not here (or in) yet
        assert time.monotonic() < deadline, f"worker1 did not rejoin within {WAIT}s"
        time.sleep(0.05)


def _calling(agent) -> int:
    """The live connections this worker's calls go on (those it opened)."""
    return sum(c.initiated for c in agent.links.all())


def _survivor(up, served, done, init_method, world_size, kw):
    """worker0: calls each incarnation of worker1, samples its metrics, lets the test
    kill it (``served[i]``); returns what it saw."""
    rpc.init_rpc("worker0", rank=0, world_size=world_size,
                 rpc_backend_options=options(init_method, rpc_timeout=20, metrics_port=0, **kw))
    agent = rpc.api._get_current_rpc_agent()
    metrics = agent.pending.metrics
    url = rpc.stats()["metrics_url"]
    up.set()
    replies, scrapes, live_bytes, bounded = 0, [], [], []
    old = None
    payload = torch.ones(SIZE)
    for i in range(RESTARTS + 1):
        old, n = _new_incarnation(old)
        replies += n
        scrapes.append(_scrape(url))  # just after the rejoin
        for _ in range(CALLS):
            assert torch.equal(rpc.rpc_sync("worker1", echo, args=(payload,)), payload)
            replies += 1
        big = torch.ones(LANED // 4)
        assert torch.equal(rpc.rpc_sync("worker1", echo, args=(big,)), big)
        replies += 1
        # the old incarnation's connection is folded once its reader has ended: a
        # histogram per live connection that calls went on (the one to worker1)
        bounded.append(wait_until(lambda: len(metrics._by_link) <= _calling(agent), 10)
                       and sum(len(m.hists) for m in metrics._peers.values()) == 1)
        # what this incarnation's connections moved, just before it dies (a lane's
        # halves belong to frames counted whole on the connections)
        conns = [c for c in agent.links.all() if c.peer_rank == 1 and not c.lane]
        live_bytes.append([sum(c.bytes_out for c in conns), sum(c.bytes_in for c in conns)])
        scrapes.append(_scrape(url))  # just before the kill
        if i < RESTARTS:
            served[i].set()
    final = rpc.stats()["peers"]["worker1"]
    scrapes.append(_scrape(url))
    sizes = (len(metrics._by_link), _calling(agent), repr(metrics))
    done.set()
    rpc.shutdown()
    return replies, final, live_bytes, scrapes, bounded, sizes


def _victim(last, done, init_method, world_size, kw):
    """One incarnation of worker1: calls worker0 once (a connection in), then waits
    for worker0 to be done; all but the last are killed meanwhile."""
    rpc.init_rpc("worker1", rank=1, world_size=world_size,
                 rpc_backend_options=options(init_method, rpc_timeout=20, **kw))
    rpc.rpc_sync("worker0", echo, args=(torch.ones(SIZE),))
    if not last:
        # killed while it waits: never in a wait on a shared event (a process killed
        # there leaves the event's set() waiting for it)
        threading.Event().wait(2 * WAIT)
        raise AssertionError("this incarnation of worker1 was not killed")
    assert done.wait(2 * WAIT)
    rpc.shutdown()
    return os.getpid()


def _wait_for(event, *procs) -> None:
    """Wait until ``event`` is set, or one of ``procs`` answered early (it failed:
    ``_result`` says why)."""
    assert wait_until(lambda: event.is_set() or any(c.poll() for _, c in procs), 60)
    if not event.is_set():
        for proc in procs:
            if proc[1].poll():
                _result(proc)


@pytest.mark.parametrize("kind", ["unix", "tcp", "dynamic"])
def test_a_restarted_peer_leaves_one_histogram_and_totals_that_only_grow(kind):
    kw = {"_transports": ["tcp"]} if kind == "tcp" else {}
    if kind == "dynamic":
        init_method, world_size = f"tcp://127.0.0.1:{_free_port()}", None
    else:
        init_method, world_size = new_init_method(), 2
    served = [_ctx.Event() for _ in range(RESTARTS)]
    done = _ctx.Event()
    up = _ctx.Event()
    survivor = _fork(_survivor, up, served, done, init_method, world_size, kw)
    procs = [survivor]
    try:
        if world_size is None:  # a dynamic group's first member hosts its store
            _wait_for(up, survivor)
        for i in range(RESTARTS + 1):
            last = i == RESTARTS
            victim = _fork(_victim, last, done, init_method, world_size, kw)
            procs.append(victim)
            if not last:
                _wait_for(served[i], survivor, victim)
                os.kill(victim[0].pid, signal.SIGKILL)
                victim[0].join(5)
        _result(procs[-1])
        replies, final, live_bytes, scrapes, bounded, sizes = _result(survivor)
    finally:
        for p, _ in procs:
            _kill(p)

    # the per-connection table held the live connections only, after every rejoin
    assert all(bounded), (bounded, sizes)
    assert sizes[0] <= sizes[1] and sizes[2].endswith(f"{sizes[0]} links>"), sizes
    # every reply of every incarnation is in the histogram, and every call
    assert final["replies"] == replies, (final, replies)
    assert final["calls_sent"] >= replies
    # bytes: at least what each incarnation's connections had moved before it died
    out, in_ = (sum(b[k] for b in live_bytes) for k in (0, 1))
    assert final["bytes_out"] >= out and final["bytes_in"] >= in_, (final, live_bytes)
    moved = (RESTARTS + 1) * (CALLS * SIZE * 4 + LANED)
    assert final["bytes_out"] >= moved and final["bytes_in"] >= moved, final
    # Prometheus counters never went down, from one scrape to the next
    for before, after in zip(scrapes, scrapes[1:]):
        for key, value in before.items():
            assert after.get(key, 0.0) >= value, (key, value, after.get(key))
    peer_out = 'torchwire_peer_bytes_out_total{peer="worker1",worker="worker0"}'
    assert scrapes[-1][peer_out] >= moved, scrapes[-1]
