"""What an agent reports about itself: ``rpc.stats()``, and torch's ``get_metrics()``
and ``get_debug_info()``.

Everything here is read when asked, from the counters (``counters.py``), the call
metrics (``metrics.py``), the connections and the pool: nothing on the call path.
"""

from __future__ import annotations

from .._wire.channels import segments


def stats(agent) -> dict:
    """``rpc.stats()``: this worker's totals, and per peer (by name) calls each way,
    bytes each way, latency percentiles of the replies, errors by kind and timeouts;
    how its readers polled (``polls``)."""
    conns = agent.links.all()
    io = agent.pending.metrics.bytes_by_peer(conns)  # closed connections' included
    c = agent.counters
    return {
        "name": agent.name,
        "calls_sent": c.sent,
        "calls_served": c.received,
        "pending": len(agent.pending),
        "replies_sent": c.replies,
        # replies an I/O thread wrote itself, without a pool hop (serving.py)
        "replies_in_place": c.replies_in_place,
        "connections": len(conns),
        "bytes_out": sum(b[0] for b in io.values()),
        "bytes_in": sum(b[1] for b in io.values()),
        "transports": sorted({x.transport for x in conns}),
        "channels": sorted({"shm" if x.channels.sends("shm") else "cma"
                            if x.channels.sends("cma") else "socket" for x in conns}),
        "shm": segments.stats(),
        "polls": polls(conns),
        "reply_polls": polls(conns, "reply_poll"),
        "peers": peers(agent, io),
        "metrics_url": agent.metrics_endpoint.url if agent.metrics_endpoint else None,
    }


def polls(conns, which: str = "poll") -> dict:
    """How the open connections' readers polled after serving (``_wire/polling.py``),
    or (``which="reply_poll"``) how callers reading their own replies polled for them:
    ``episodes`` begun, ``hits`` (what was polled for came while polling), ``ceded``
    (stopped early: other threads of the process ran) and ``seconds`` spent."""
    total = {"episodes": 0, "hits": 0, "ceded": 0, "seconds": 0.0}
    for conn in conns:
        poll = getattr(conn, which, None)  # (a loopback connection has no reader)
        if poll is not None:
            for k, v in poll.stats().items():
                total[k] += v
    return total


def peers(agent, io: dict[int, list[int]] | None = None) -> dict[str, dict]:
    """Per peer, by name: ``calls_sent``, ``calls_received``, ``bytes_out``,
    ``bytes_in`` (connections that closed included), ``replies``, ``latency_p50_s``,
    ``latency_p99_s``, ``latency_mean_s`` (None before the first reply), ``errors``
    (by exception type name) and ``timeouts``.  Only peers something went to or came
    from."""
    if io is None:  # {rank: [bytes_out, bytes_in]}
        io = agent.pending.metrics.bytes_by_peer(agent.links.all())
    c = agent.counters
    with c.lock:
        sent = dict(enumerate(c.sent_to)) if isinstance(c.sent_to, list) else dict(c.sent_to)
        received = dict(enumerate(c.recv_from)) if isinstance(c.recv_from, list) \
            else dict(c.recv_from)
    calls = agent.pending.metrics.snapshot()
    out = {}
    for rank in sorted(set(sent) | set(received) | set(io) | set(calls)):
        if not (sent.get(rank) or received.get(rank) or rank in io or rank in calls):
            continue
        m = calls.get(rank, {})
        b = io.get(rank, (0, 0))
        out[agent.name_of(rank)] = {
            "rank": rank,
            "calls_sent": sent.get(rank, 0),
            "calls_received": received.get(rank, 0),
            "bytes_out": b[0],
            "bytes_in": b[1],
            "replies": m.get("replies", 0),
            "latency_p50_s": m.get("latency_p50_s"),
            "latency_p99_s": m.get("latency_p99_s"),
            "latency_mean_s": m.get("latency_mean_s"),
            "errors": m.get("errors", {}),
            "timeouts": m.get("timeouts", 0),
        }
    return out


def get_metrics(agent) -> dict[str, str]:
    """torch's ``RpcAgent.get_metrics()``: its keys, with values as strings as torch's:
    ``agent.thread_pool_size`` (the pool's core threads), ``agent.num_idle_threads``,
    ``agent.client_active_calls`` (calls awaiting a reply), ``agent.server_active_calls``
    (pool threads running something), ``agent.server_active_async_calls``
    (``@async_execution`` functions whose future has not completed)."""
    pool = agent.pool
    idle = len(pool._idle_stack)
    return {
        "agent.thread_pool_size": str(pool._core),
        "agent.num_idle_threads": str(idle),
        "agent.client_active_calls": str(len(agent.pending)),
        "agent.server_active_calls": str(max(0, pool._threads - idle)),
        "agent.server_active_async_calls": str(agent.server.async_active),
    }


def get_debug_info(agent) -> dict[str, str]:
    """torch's ``RpcAgent.get_debug_info()``: the metrics, and the calls awaiting a
    reply under the key of torch's process-group agent."""
    info = get_metrics(agent)
    info["agent.num_pending_requests"] = str(len(agent.pending))
    return info
