"""Per-peer call metrics: what ``rpc.stats()["peers"]``, ``get_metrics()`` and the
Prometheus endpoint report.

Calls and requests per peer are the termination counters (``counters.py``) and bytes
per peer are the connections' own counts: both read at report time, so the call path
pays nothing for them.  What the call path does pay, once per reply, timeout or
failure, is one clock read at send (stored on the pending call) and one histogram
increment here.

Connections come and go (a peer restarted, a link cut and dialled again), the peer's
totals must not: when a connection ends, :meth:`CallMetrics.link_closed` folds its
histogram and its byte counts into its peer's record and forgets it.  The tables hold
the live connections and one record per peer, and the totals ``stats()`` and the
Prometheus counters report only grow.

The latency histogram has a fixed size: octaves of nanoseconds split in quarters
(bucket ``4 * b + k`` holds latencies of ``b`` bits whose next two bits are ``k``:
from ``(4 + k) << (b - 3)`` ns up to ``(5 + k) << (b - 3)``), integer arithmetic
only; a percentile is the upper bound of the bucket it falls in (within 25 %).
"""

from __future__ import annotations

import math
import threading
import weakref

_BUCKETS = 4 * 41  # 41 bits of nanoseconds: 36 min; longer calls land in the last bucket


def bucket_of(ns: int) -> int:
    """The bucket of a latency of ``ns`` nanoseconds (below 8 ns: the first)."""
    b = ns.bit_length()
    if b <= 3:
        return 0
    i = (b << 2) | ((ns >> (b - 3)) & 3)
    return i if i < _BUCKETS else _BUCKETS - 1


def bucket_upper_s(i: int) -> float:
    """Upper bound of bucket ``i``, in seconds."""
    b, k = divmod(i, 4)
    return ((5 + k) << (b - 3)) / 1e9 if b >= 3 else 8e-9


class LatencyHistogram:
    """Counts of call latencies in fixed quarter-octave buckets (not thread-safe: the
    owner's lock guards it)."""

    __slots__ = ("counts", "total", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0
        self.sum_ns = 0

    def __repr__(self) -> str:
        return f"<LatencyHistogram n={self.total} p50={self.percentile(50)}>"

    def add(self, ns: int) -> None:
        self.counts[bucket_of(ns)] += 1
        self.total += 1
        self.sum_ns += ns

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s counts to this one's."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.sum_ns += other.sum_ns

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
    """What one peer's calls came to: errors by kind, timeouts, the latency histograms
    of the live connections its replies came on (``hists``), and what its closed
    connections came to: their histograms summed (``closed``), their bytes each way."""

    __slots__ = ("hists", "closed", "bytes_out", "bytes_in", "errors", "timeouts")

    def __init__(self) -> None:
        self.hists: list[LatencyHistogram] = []
        self.closed = LatencyHistogram()
        self.bytes_out = 0
        self.bytes_in = 0
        self.errors: dict[str, int] = {}
        self.timeouts = 0

    def __repr__(self) -> str:
        return (f"<PeerMetrics n={self.closed.total + sum(h.total for h in self.hists)} "
                f"links={len(self.hists)} errors={sum(self.errors.values())} "
                f"timeouts={self.timeouts}>")

    def latency(self) -> LatencyHistogram:
        """The peer's histograms summed, closed connections' included."""
        total = LatencyHistogram()
        total.merge(self.closed)
        for h in self.hists:
            total.merge(h)
        return total


class CallMetrics:
    """Per-peer metrics of the calls this worker sent, keyed by rank.

    Thread rule: a reply is completed by the thread reading its connection (one at a
    time per connection), so each connection's histogram has one writer and its
    increments take no lock; errors, timeouts, new histograms and the folding of a
    closed connection go under the lock.  The fold runs on that same reading thread,
    after its last reply (``Links.on_close``): no increment races it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[int, PeerMetrics] = {}
        # id(conn) -> (rank, h), live connections only: an id is free for reuse once
        # its connection is gone, and by then link_closed has taken it out
        self._by_link: dict[int, tuple[int, LatencyHistogram]] = {}
        # connections whose bytes are in their peer's record already, as long as
        # something (a report's list of connections) still holds them
        self._folded: weakref.WeakSet = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"<CallMetrics {len(self._peers)} peers {len(self._by_link)} links>"

    def _peer(self, rank: int) -> PeerMetrics:
        m = self._peers.get(rank)
        if m is None:
            m = self._peers[rank] = PeerMetrics()
        return m

    def _new_link(self, link: int, rank: int) -> LatencyHistogram:
        h = LatencyHistogram()
        with self._lock:
            self._peer(rank).hists.append(h)
            self._by_link[link] = (rank, h)  # an id reused by a later connection: its own
        return h

    def replied(self, link: int, rank: int, ns: int, error: BaseException | None) -> None:
        """A reply arrived on connection ``link`` (its ``id``) from ``rank``, ``ns``
        nanoseconds after the send (a value, or the remote ``error``).  Every reply's
        path: the histogram's add is inlined."""
        b = ns.bit_length()
        i = (b << 2) | ((ns >> (b - 3)) & 3) if b > 3 else 0
        if i >= _BUCKETS:
            i = _BUCKETS - 1
        entry = self._by_link.get(link)
        h = entry[1] if entry is not None and entry[0] == rank else self._new_link(link, rank)
        h.counts[i] += 1
        h.total += 1
        h.sum_ns += ns
        if error is not None:
            self.failed(rank, error)

    def link_closed(self, conn, lane: bool = False) -> None:
        """Connection ``conn`` ended: fold its histogram and its byte counts into its
        peer's record, and forget it.

        Called once per connection by the thread that read it, after its last reply and
        before the connection leaves the agent's tables (``Links.on_close``), so a
        report sees its bytes live or folded, never neither (Prometheus would read a
        dip as a counter reset), and :meth:`bytes_by_peer` counts it once.

        Args:
            lane: ``conn`` is a lane (either side's): its bytes stay out of the
                totals, as they do while it lives (each half it carried belongs to a
                frame its main connection counted whole).
        """
        with self._lock:
            entry = self._by_link.pop(id(conn), None)
            if entry is not None:
                rank, h = entry
                m = self._peer(rank)
                m.hists.remove(h)
                m.closed.merge(h)
            out, in_ = (0, 0) if lane else (conn.bytes_out, conn.bytes_in)
            if out or in_:
                m = self._peer(conn.peer_rank)
                m.bytes_out += out
                m.bytes_in += in_
            self._folded.add(conn)

    def bytes_by_peer(self, conns) -> dict[int, list[int]]:
        """``{rank: [bytes_out, bytes_in]}``: what closed connections moved, and what
        the live ``conns`` (listed before this call) moved so far; peers with bytes
        only.  A connection that closed after it was listed is counted once."""
        with self._lock:
            io = {rank: [m.bytes_out, m.bytes_in] for rank, m in self._peers.items()
                  if m.bytes_out or m.bytes_in}
            folded = self._folded
            for conn in conns:
                if conn in folded or conn.lane:
                    continue
                b = io.setdefault(conn.peer_rank, [0, 0])
                b[0] += conn.bytes_out
                b[1] += conn.bytes_in
        return io

    def failed(self, rank: int, error: BaseException, timeout: bool = False) -> None:
        """A call ended in an error: the remote function's, or without a reply (its
        deadline passed, or its peer or link failed)."""
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
            peers = [(rank, m.latency(), dict(m.errors), m.timeouts)
                     for rank, m in self._peers.items()]
        for rank, h, errors, timeouts in peers:
            out[rank] = {
                "replies": h.total,
                "latency_p50_s": h.percentile(50),
                "latency_p99_s": h.percentile(99),
                "latency_mean_s": h.sum_ns / h.total / 1e9 if h.total else None,
                "errors": errors,
                "timeouts": timeouts,
            }
        return out
