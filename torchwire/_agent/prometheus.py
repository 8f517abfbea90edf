"""The optional Prometheus endpoint: an HTTP server (``prometheus_client``'s) that
serves this worker's ``rpc.stats()`` in Prometheus text format.

Off by default.  ``TorchwireRpcBackendOptions(metrics_port=P)`` serves on port ``P``
(0: any free port; the URL is in ``rpc.stats()["metrics_url"]``); else the
environment variable ``TORCHWIRE_METRICS_PORT=B`` serves worker rank ``r`` on port
``B + r`` (one variable for every worker of a host).  It listens on
``metrics_addr`` (127.0.0.1 unless set).  The metrics are read at each scrape, from
the same counters as ``stats()``: serving them costs the calls nothing.
"""

from __future__ import annotations

import os

from .._base.errors import RpcStateError

ENV_PORT = "TORCHWIRE_METRICS_PORT"


def wanted_port(options, rank: int) -> int | None:
    """The port the endpoint should use, or None when it is off.

    Raises:
        ValueError: ``TORCHWIRE_METRICS_PORT`` is not a port number.
    """
    port = getattr(options, "metrics_port", None)
    if port is not None:
        return int(port)
    env = os.environ.get(ENV_PORT)
    if not env:
        return None
    try:
        base = int(env)
    except ValueError:
        raise ValueError(f"{ENV_PORT} must be a port number, got {env!r}") from None
    return base + rank if base else 0


class _Collector:
    """A ``prometheus_client`` collector that reads the agent's stats at each scrape."""

    def __init__(self, agent) -> None:
        self._agent = agent

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._agent.stats()
        worker = s["name"]
        for key, what in (("calls_sent", "requests this worker sent"),
                          ("calls_served", "requests this worker received"),
                          ("bytes_out", "bytes written to peers"),
                          ("bytes_in", "bytes read from peers")):
            c = CounterMetricFamily(f"torchwire_{key}", what, labels=["worker"])
            c.add_metric([worker], s[key])
            yield c
        g = GaugeMetricFamily("torchwire_pending_calls", "calls awaiting a reply",
                              labels=["worker"])
        g.add_metric([worker], s["pending"])
        yield g
        per_peer = {
            "calls_sent": CounterMetricFamily(
                "torchwire_peer_calls_sent", "requests sent to a peer", labels=["worker", "peer"]),
            "calls_received": CounterMetricFamily(
                "torchwire_peer_calls_received", "requests received from a peer",
                labels=["worker", "peer"]),
            "bytes_out": CounterMetricFamily(
                "torchwire_peer_bytes_out", "bytes written to a peer", labels=["worker", "peer"]),
            "bytes_in": CounterMetricFamily(
                "torchwire_peer_bytes_in", "bytes read from a peer", labels=["worker", "peer"]),
            "timeouts": CounterMetricFamily(
                "torchwire_peer_timeouts", "calls to a peer that timed out",
                labels=["worker", "peer"]),
        }
        errors = CounterMetricFamily("torchwire_peer_errors", "calls to a peer that failed",
                                     labels=["worker", "peer", "kind"])
        latency = GaugeMetricFamily("torchwire_peer_latency_seconds",
                                    "latency of calls to a peer (histogram percentile)",
                                    labels=["worker", "peer", "quantile"])
        for peer, m in s["peers"].items():
            for key, family in per_peer.items():
                family.add_metric([worker, peer], m[key])
            for kind, n in m["errors"].items():
                errors.add_metric([worker, peer, kind], n)
            for q, key in (("0.5", "latency_p50_s"), ("0.99", "latency_p99_s")):
                if m[key] is not None:
                    latency.add_metric([worker, peer, q], m[key])
        yield from per_peer.values()
        yield errors
        yield latency


class MetricsEndpoint:
    """The HTTP server of one agent's metrics.

    Raises (on construction):
        RpcStateError: ``prometheus_client`` is not installed.
        OSError: the port cannot be bound.
    """

    def __init__(self, agent, port: int, addr: str) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise RpcStateError(
                "the metrics endpoint needs prometheus_client: pip install "
                "'torchwire[metrics]' (or unset metrics_port / TORCHWIRE_METRICS_PORT)"
            ) from None
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(agent))
        self._server, self._thread = prometheus_client.start_http_server(
            port, addr=addr, registry=registry)
        host, bound = self._server.server_address[:2]
        self.url = f"http://{host}:{bound}/metrics"

    def __repr__(self) -> str:
        return f"<MetricsEndpoint {self.url}>"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
