"""A reader polls for the next request after serving (``_wire/polling.py``): when it
does, how its window adapts, when it cedes, and the option that turns it off."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._base.options import DEFAULT_POLL_US, TorchwireRpcBackendOptions
from torchwire._wire import polling
from torchwire._wire.polling import MISS_LIMIT, POLL_START_NS, REST_READS, RestPoll


def _plus_one(x):
    return x + 1


def _polls():
    return rpc.stats()["polls"]


# ------------------------------------------------------------------ end to end


def _calls_until_polled(fn, enough, *, chunk=100, most=4000):
    """Call ``worker1`` in chunks of ``chunk`` calls (``fn(i)`` makes call ``i``) until
    its polling counters (``rpc.stats()["polls"]``) satisfy ``enough(polls)``, at most
    ``most`` calls.  On an idle machine the first chunks do; with the cores busy,
    polling cedes more often (by design) and it takes more calls to get there.
    Returns the results of the calls and the last counters."""
    results = []
    polls = rpc.rpc_sync("worker1", _polls)
    while len(results) < most and not enough(polls):
        base = len(results)
        results.extend([fn(base + i) for i in range(chunk)])
        polls = rpc.rpc_sync("worker1", _polls)
    return results, polls


def _polled_enough(polls):
    return polls["episodes"] >= 100 and polls["hits"] >= 50


def test_a_callee_polls_between_back_to_back_requests_and_a_mere_caller_never_does():
    def body(rank, world_size):
        if rank:
            return None
        results, callee = _calls_until_polled(
            lambda i: rpc.rpc_sync("worker1", _plus_one, args=(i,)), _polled_enough)
        return results, callee, _polls()

    results, callee, caller = run_world(body, 2)[0]
    assert results == list(range(1, len(results) + 1))
    # the next request usually comes while the callee still polls: episodes hit
    assert _polled_enough(callee), callee
    assert callee["seconds"] > 0
    assert caller == {"episodes": 0, "hits": 0, "ceded": 0, "seconds": 0.0}


def _reply_polls():
    return rpc.stats()["reply_polls"]


def test_a_caller_reading_its_own_replies_polls_for_them_and_a_mere_callee_never_does():
    def body(rank, world_size):
        if rank:
            return None
        results, polls = [], _reply_polls()
        while len(results) < 4000 and not _polled_enough(polls):
            base = len(results)
            results.extend(rpc.rpc_sync("worker1", _plus_one, args=(base + i,))
                           for i in range(100))
            polls = _reply_polls()
        return results, polls, rpc.rpc_sync("worker1", _reply_polls)

    results, caller, callee = run_world(body, 2)[0]
    assert results == list(range(1, len(results) + 1))
    # the caller reads its replies itself (lending) and its reply usually comes
    # while it still polls
    assert _polled_enough(caller), caller
    assert callee == {"episodes": 0, "hits": 0, "ceded": 0, "seconds": 0.0}


def test_a_tcp_callee_polls_too():
    def body(rank, world_size):
        if rank:
            return None
        results, callee = _calls_until_polled(
            lambda i: rpc.rpc_sync("worker1", _plus_one, args=(i,)), _polled_enough)
        return results, callee, rpc.stats()["transports"]

    results, callee, transports = run_world(body, 2, _transports=["tcp"])[0]
    assert transports == ["tcp"]
    assert results == list(range(1, len(results) + 1))
    assert _polled_enough(callee), callee


def test_the_default_window_spans_a_callers_own_work_between_calls():
    """A caller that works a few hundred microseconds between a reply and its next
    request (its own layer, its loss, a local backward pass) still finds the callee
    polling under the default ``poll_us``: the window grows past such gaps."""
    def call_then_work(i):
        result = rpc.rpc_sync("worker1", _plus_one, args=(i,))
        busy_until = time.perf_counter() + 400e-6  # the caller's own work: on CPU
        while time.perf_counter() < busy_until:
            pass
        return result

    def body(rank, world_size):
        if rank:
            return None
        return _calls_until_polled(call_then_work, lambda polls: polls["hits"] > 0,
                                   most=3000)

    results, callee = run_world(body, 2)[0]
    assert results == list(range(1, len(results) + 1))
    # every gap is over 400 µs: a window capped at 200 µs never catches one (no
    # hit in 3 000 calls); on an idle machine the first hundred calls catch many
    assert callee["hits"] > 0, callee


def test_poll_us_zero_never_polls():
    def body(rank, world_size):
        if rank:
            return None
        results = [rpc.rpc_sync("worker1", _plus_one, args=(i,)) for i in range(200)]
        return results, rpc.rpc_sync("worker1", _polls), _reply_polls()

    results, callee, caller = run_world(body, 2, poll_us=0)[0]
    assert results == list(range(1, 201))
    assert callee["episodes"] == 0 and callee["hits"] == 0, callee
    assert caller["episodes"] == 0 and caller["hits"] == 0, caller  # nor for replies


def test_requests_that_come_far_apart_stop_the_polling():
    """The window grows while requests come close behind their replies, and halves
    to nothing once they come further apart than ``poll_us``: such a connection
    then never polls."""
    def body(rank, world_size):
        if rank:
            return None
        # back to back until a poll has caught one: the window has grown
        _, grown = _calls_until_polled(
            lambda i: rpc.rpc_sync("worker1", _plus_one, args=(i,)),
            lambda polls: polls["hits"] > 0)

        def spaced(fn, *args):
            time.sleep(0.005)  # a gap 25 times poll_us: pacing, not waiting for anything
            return rpc.rpc_sync("worker1", fn, args=args)

        for i in range(4):  # 200 -> 100 -> 50 -> 0 µs at most
            spaced(_plus_one, i)
        before = spaced(_polls)
        results = [spaced(_plus_one, i) for i in range(8)]
        after = spaced(_polls)
        return grown, before, after, results

    grown, before, after, results = run_world(body, 2, poll_us=200)[0]
    assert results == list(range(1, 9))
    assert grown["hits"] > 0, grown
    assert after["episodes"] == before["episodes"], (before, after)


# ------------------------------------------------------------------ one connection


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _quiet(monkeypatch):
    """Polls here see no sign to cede, which the test is not about: other processes
    may take this core meanwhile (a preemption), and the timer thread that sends the
    data may still be starting when a poll begins (CPU of another thread)."""
    monkeypatch.setattr(polling, "_preempted", lambda: 0)
    monkeypatch.setattr(polling, "_process_time", polling._thread_time)


def _reader(sock):
    def recv_nowait(view):
        return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
    return recv_nowait, sock.recv_into


def test_the_window_grows_on_close_requests_and_halves_to_nothing_on_late_ones(pair):
    a, b = pair
    poll = RestPoll(50_000_000)  # 50 ms: what is already there counts as close
    recv_nowait, recv = _reader(b)
    buf = bytearray(64)
    view = memoryview(buf)
    a.sendall(b"x")
    assert poll.read(recv_nowait, recv, view) == 1  # window 0: blocked, then grew
    assert poll.episodes == 0 and poll.window_ns == POLL_START_NS
    a.sendall(b"y")
    assert poll.read(recv_nowait, recv, view) == 1 and buf[0:1] == b"y"
    assert (poll.episodes, poll.hits) == (1, 1)  # a hit keeps the window
    assert poll.window_ns == POLL_START_NS

    late = RestPoll(1_000_000)  # 1 ms
    late.window_ns = 800_000

    def read_late():  # the next request comes 20 ms later: 20 times the longest window
        timer = threading.Timer(0.02, a.sendall, args=(b"z",))
        timer.start()
        assert late.read(recv_nowait, recv, view) == 1
        timer.join()

    for expected in (400_000, 200_000, 100_000):
        read_late()
        assert late.window_ns == expected
    assert late.hits == 0 and late.episodes == 3


def test_a_miss_grows_the_window_to_span_the_wait_it_saw(pair, monkeypatch):
    """One miss is enough to reach a caller that works between its calls: the window
    grows to cover the wait, not one doubling (four misses would rest first)."""
    _quiet(monkeypatch)
    a, b = pair
    recv_nowait, recv = _reader(b)
    view = memoryview(bytearray(64))
    poll = RestPoll(50_000_000)  # 50 ms
    poll.window_ns = POLL_START_NS
    timer = threading.Timer(0.02, a.sendall, args=(b"w",))  # 20 ms: 400 starting windows
    timer.start()
    assert poll.read(recv_nowait, recv, view) == 1
    timer.join()
    assert (poll.episodes, poll.hits, poll.misses) == (1, 0, 1)
    assert 20_000_000 <= poll.window_ns <= 50_000_000, poll.window_ns
    assert poll.window_ns // POLL_START_NS & (poll.window_ns // POLL_START_NS - 1) == 0 \
        or poll.window_ns == 50_000_000  # doublings of the start, or the cap


def test_polls_that_keep_missing_rest(pair, monkeypatch):
    """A run of ``MISS_LIMIT`` misses stops the polling for ``REST_READS`` reads, even
    while requests come close behind (a poller can hold up a starved peer)."""
    _quiet(monkeypatch)
    a, b = pair
    recv_nowait, recv = _reader(b)
    view = memoryview(bytearray(64))
    poll = RestPoll(10_000_000)
    poll.window_ns = 1_000_000  # 1 ms polls (and less), data 20 ms later: each one misses
    for _ in range(MISS_LIMIT):
        timer = threading.Timer(0.02, a.sendall, args=(b"m",))
        timer.start()
        assert poll.read(recv_nowait, recv, view) == 1
        timer.join()
    assert poll.episodes == MISS_LIMIT and poll.hits == 0
    assert poll.window_ns == 0 and poll.rest == REST_READS - 1
    for _ in range(REST_READS - 1):  # close requests: no poll, no growth while resting
        a.sendall(b"c")
        assert poll.read(recv_nowait, recv, view) == 1
    assert poll.episodes == MISS_LIMIT and poll.rest == 0 and poll.window_ns == 0
    a.sendall(b"c")
    assert poll.read(recv_nowait, recv, view) == 1
    assert poll.window_ns == POLL_START_NS  # rested: it grows again


def test_polling_cedes_when_other_threads_of_the_process_run(pair):
    a, b = pair
    recv_nowait, recv = _reader(b)
    view = memoryview(bytearray(64))
    stop = threading.Event()

    def busy():  # CPU without the GIL: hashing a large buffer releases it
        import hashlib
        data = os.urandom(1 << 20)
        while not stop.is_set():
            hashlib.sha256(data).digest()

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        poll = RestPoll(10_000_000_000)
        poll.window_ns = 10_000_000_000  # 10 s: only the busy thread can end this poll
        timer = threading.Timer(0.5, a.sendall, args=(b"!",))  # a bound, if it fails
        timer.start()
        assert poll.read(recv_nowait, recv, view) == 1
        timer.join()
    finally:
        stop.set()
        thread.join()
    assert (poll.episodes, poll.hits, poll.ceded) == (1, 0, 1)


def test_a_quiet_process_polls_for_its_whole_window(pair, monkeypatch):
    _quiet(monkeypatch)
    a, b = pair
    recv_nowait, recv = _reader(b)
    view = memoryview(bytearray(64))
    poll = RestPoll(2_000_000)
    poll.window_ns = 2_000_000
    timer = threading.Timer(0.1, a.sendall, args=(b".",))
    timer.start()
    assert poll.read(recv_nowait, recv, view) == 1
    timer.join()
    assert (poll.episodes, poll.hits, poll.ceded) == (1, 0, 0)
    assert poll.spent_ns >= 2_000_000


def test_the_end_of_the_stream_ends_a_poll(pair):
    a, b = pair
    recv_nowait, recv = _reader(b)
    poll = RestPoll(1_000_000)
    poll.window_ns = 1_000_000
    a.close()
    assert poll.read(recv_nowait, recv, memoryview(bytearray(8))) == 0
    assert poll.hits == 1


# ------------------------------------------------------------------ the option


def test_the_poll_option_its_environment_variable_and_bad_values(monkeypatch):
    monkeypatch.delenv("TORCHWIRE_POLL_US", raising=False)
    assert TorchwireRpcBackendOptions().poll_us == DEFAULT_POLL_US
    assert TorchwireRpcBackendOptions(poll_us=0).poll_us == 0
    monkeypatch.setenv("TORCHWIRE_POLL_US", "75")
    assert TorchwireRpcBackendOptions().poll_us == 75
    assert TorchwireRpcBackendOptions(poll_us=10).poll_us == 10  # the option wins
    monkeypatch.setenv("TORCHWIRE_POLL_US", "soon")
    with pytest.raises(ValueError, match="TORCHWIRE_POLL_US"):
        TorchwireRpcBackendOptions()
    for bad in (-1, float("nan"), float("inf"), True, "200"):
        with pytest.raises(ValueError, match="poll_us"):
            TorchwireRpcBackendOptions(poll_us=bad)
