"""Per-peer call metrics: what ``rpc.stats()["peers"]``, ``get_metrics()`` and the
Prometheus endpoint report.

Calls and requests per peer are the termination counters (``counters.py``) and bytes
per peer are the connections' own counts: both read at report time, so the call path
pays nothing for them.  What the call path does pay, once per reply, timeout or
failure, is one clock read at send (stored on the pending call) and one histogram
increment here.

The latency histogram has a fixed size: quarter-octave buckets of nanoseconds
(bucket ``i`` holds latencies below ``2 ** ((i + 1) / 4)`` ns), from 1 µs to 18 min;
a percentile is the upper bound of the bucket it falls in (within 19 %).
"""

from __future__ import annotations

import math
import threading

_BUCKETS = 160  # 2 ** (160 / 4) ns = 18.3 min; longer calls land in the last bucket
_FIRST = 40  # 2 ** (40 / 4) ns = 1 µs: shorter ones land in the first bucket
_log2 = math.log2


def bucket_upper_s(i: int) -> float:
    """Upper bound of bucket ``i``, in seconds."""
    return 2.0 ** ((i + 1) / 4) / 1e9


class LatencyHistogram:
    """Counts of call latencies in fixed quarter-octave buckets (not thread-safe: the
    owner's lock guards it)."""

    __slots__ = ("counts", "total", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0
        self.sum_s = 0.0

    def __repr__(self) -> str:
        return f"<LatencyHistogram n={self.total} p50={self.percentile(50)}>"

    def add(self, seconds: float) -> None:
        ns = seconds * 1e9
        i = int(_log2(ns) * 4) if ns > 1.0 else 0
        i = _FIRST if i < _FIRST else _BUCKETS - 1 if i >= _BUCKETS else i
        self.counts[i] += 1
        self.total += 1
        self.sum_s += seconds

    def percentile(self, p: float) -> float | None:
        """The ``p``-th percentile in seconds (a bucket's upper bound); None if empty."""
        if not self.total:
            return None
        rank = max(1, math.ceil(self.total * p / 100.0))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return bucket_upper_s(i)
        return bucket_upper_s(_BUCKETS - 1)


class PeerMetrics:
    """What one peer's calls came to: latencies of replies, errors by kind, timeouts."""

    __slots__ = ("latency", "errors", "timeouts")

    def __init__(self) -> None:
        self.latency = LatencyHistogram()
        self.errors: dict[str, int] = {}
        self.timeouts = 0

    def __repr__(self) -> str:
        return (f"<PeerMetrics n={self.latency.total} errors={sum(self.errors.values())} "
                f"timeouts={self.timeouts}>")


class CallMetrics:
    """Per-peer metrics of the calls this worker sent, keyed by rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[int, PeerMetrics] = {}

    def __repr__(self) -> str:
        return f"<CallMetrics {len(self._peers)} peers>"

    def _peer(self, rank: int) -> PeerMetrics:
        m = self._peers.get(rank)
        if m is None:
            m = self._peers[rank] = PeerMetrics()
        return m

    def replied(self, rank: int, seconds: float, error: BaseException | None) -> None:
        """A reply arrived after ``seconds`` (a value, or the remote ``error``)."""
        with self._lock:
            m = self._peers.get(rank) or self._peer(rank)
            m.latency.add(seconds)
            if error is not None:
                kind = type(error).__name__
                m.errors[kind] = m.errors.get(kind, 0) + 1

    def failed(self, rank: int, error: BaseException, timeout: bool = False) -> None:
        """A call ended without a reply: its deadline passed, or its peer or link failed."""
        with self._lock:
            m = self._peer(rank)
            kind = type(error).__name__
            m.errors[kind] = m.errors.get(kind, 0) + 1
            if timeout:
                m.timeouts += 1

    def snapshot(self) -> dict[int, dict]:
        """``{rank: {latency_p50_s, latency_p99_s, latency_mean_s, replies, errors,
        timeouts}}`` for every peer a call went to."""
        out = {}
        with self._lock:
            for rank, m in self._peers.items():
                h = m.latency
                out[rank] = {
                    "replies": h.total,
                    "latency_p50_s": h.percentile(50),
                    "latency_p99_s": h.percentile(99),
                    "latency_mean_s": h.sum_s / h.total if h.total else None,
                    "errors": dict(m.errors),
                    "timeouts": m.timeouts,
                }
        return out
