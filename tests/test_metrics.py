"""Per-peer metrics: rpc.stats()["peers"], the agent's get_metrics()/get_debug_info()
under torch's keys, the latency histogram, and the optional Prometheus endpoint."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from _cluster import run_world
from torchwire._agent.metrics import LatencyHistogram, bucket_of, bucket_upper_s


def test_histogram_percentiles_within_a_bucket():
    h = LatencyHistogram()
    assert h.percentile(50) is None
    for _ in range(98):
        h.add(100_000)  # 100 us
    h.add(500_000_000)
    h.add(500_000_000)
    p50, p99 = h.percentile(50), h.percentile(99)
    assert 100e-6 < p50 <= 100e-6 * 1.25
    assert 0.5 < p99 <= 0.5 * 1.25
    assert len(h.counts) == 164  # fixed size, whatever was added
    h.add(3)
    h.add(10 ** 15)
    assert h.counts[0] == 1 and h.counts[-1] == 1
    for ns in (8, 9, 15, 16, 1000, 123_456_789):
        i = bucket_of(ns)
        assert bucket_upper_s(i - 1) * 1e9 <= ns < bucket_upper_s(i) * 1e9, ns


def _slow(x):
    return x + 1


def _fail():
    raise ValueError("boom")


def _sleep(s):
    import time
    time.sleep(s)


def _per_peer(rank, world_size):
    import torchwire.rpc as rpc
    from torchwire.rpc import _get_current_rpc_agent
    if rank != 0:
        return None
    for _ in range(20):
        rpc.rpc_sync("worker1", _slow, args=(torch.ones(1000),))
    rpc.rpc_sync("worker2", _slow, args=(1,))
    with pytest.raises(ValueError):
        rpc.rpc_sync("worker1", _fail)
    with pytest.raises(RuntimeError, match="timeout"):
        rpc.rpc_sync("worker2", _sleep, args=(1.0,), timeout=0.1)
    s = rpc.stats()
    agent = _get_current_rpc_agent()
    return s, agent.get_metrics(), agent.get_debug_info(), rpc._get_debug_info()


def test_stats_per_peer_and_torch_keys():
    s, metrics, debug, summary = run_world(_per_peer, 3)[0]
    assert s["calls_sent"] >= 23 and "metrics_url" in s and s["metrics_url"] is None
    w1, w2 = s["peers"]["worker1"], s["peers"]["worker2"]
    assert w1["rank"] == 1 and w1["calls_sent"] >= 21 and w1["replies"] == 21
    assert w1["bytes_out"] > 20 * 4000 and w1["bytes_in"] > 20 * 4000
    assert w1["errors"] == {"ValueError": 1} and w1["timeouts"] == 0
    assert 0 < w1["latency_p50_s"] <= w1["latency_p99_s"] < 10
    assert w2["timeouts"] == 1 and w2["errors"] == {"RpcTimeoutError": 1}
    assert w2["replies"] == 1
    for key in ("agent.thread_pool_size", "agent.num_idle_threads",
                "agent.client_active_calls", "agent.server_active_calls",
                "agent.server_active_async_calls"):
        assert isinstance(metrics[key], str) and int(metrics[key]) >= 0
    assert int(metrics["agent.thread_pool_size"]) == 16
    assert set(debug) == set(metrics) | {"agent.num_pending_requests"}
    assert set(debug) <= set(summary)


def _scrape(rank, world_size):
    import torchwire.rpc as rpc
    if rank == 0:
        rpc.rpc_sync("worker1", _slow, args=(1,))
    rpc.api._barrier(["worker0", "worker1"])
    url = rpc.stats()["metrics_url"]
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    rpc.api._barrier(["worker0", "worker1"])
    return url, text


def test_prometheus_endpoint_serves_the_stats():
    pytest.importorskip("prometheus_client")
    (url0, text0), (url1, _) = run_world(_scrape, 2, metrics_port=0)
    assert url0 != url1 and url0.startswith("http://127.0.0.1:")
    sent = re.search(r'^torchwire_peer_calls_sent_total\{peer="worker1",worker="worker0"\} '
                     r'([0-9.]+)$', text0, re.M)
    assert sent and float(sent.group(1)) >= 1  # the call, and the barrier's
    assert 'torchwire_peer_latency_seconds{peer="worker1",quantile="0.5",worker="worker0"}' \
        in text0


def test_metrics_port_is_checked():
    import torchwire.rpc as rpc
    with pytest.raises(ValueError, match="metrics_port"):
        rpc.TensorPipeRpcBackendOptions(metrics_port=70000)
