"""Failures of real worker processes: SIGKILL, SIGSTOP, and garbage from an authenticated peer.

Workers are forked from this process (``_cluster``); this process sends the
signals, so a kill lands while the workers are in the middle of their calls.
Times are measured against ``time.monotonic()``, which every process on the
machine shares.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

import torchwire
import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from _cluster import _world_child, freeze, new_init_method, options, wait_until
from torchwire._wire import frame as F
from torchwire._wire.auth import JobAuth, client_handshake
from torchwire._wire.listener import listener_alive

_ctx = mp.get_context("fork")

pytestmark = pytest.mark.timeout(90)


def add(a, b):
    return a + b


def nap(seconds):
    time.sleep(seconds)
    return seconds


_arrived = None  # a shared counter, set before the workers fork


def arrive_and_nap(seconds):
    with _arrived.get_lock():
        _arrived.value += 1
    return nap(seconds)


_held: dict = {}


def keep(name, rref):
    _held[name] = rref
    return True


def _start(fn, world_size, init_method=None):
    """Fork ``world_size`` ranks running ``fn(rank, world_size, init_method)``."""
    init_method = init_method or new_init_method()
    procs = []
    for rank in range(world_size):
        parent, child = _ctx.Pipe(duplex=False)
        p = _ctx.Process(target=_world_child,
                         args=(child, fn, rank, world_size, init_method, False, {}))
        p.start()
        child.close()
        procs.append((p, parent))
    return procs


def _result(procs, rank, timeout=60):
    p, conn = procs[rank]
    if not conn.poll(timeout):
        raise AssertionError(f"rank {rank}: no answer within {timeout}s")
    status, value = conn.recv()
    assert status == "ok", value
    return value


def _reap(procs):
    for p, _ in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)


# ---------------------------------------------------------------- worker death (SIGKILL)


def test_sigkill_fails_everything_that_depended_on_the_worker_and_nothing_else():
    ready = _ctx.Barrier(3)  # ranks 0 and 1 set up, plus this process
    killed_at = _ctx.Value("d", 0.0)
    killed = _ctx.Event()
    global _arrived
    _arrived = _ctx.Value("i", 0)  # calls that reached their callee

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=30,
                                                 num_worker_threads=32))  # all 25 naps run
        if rank == 2:  # the victim: serving, and calling worker1 (its incoming connection)
            threading.Thread(target=lambda: rpc.rpc_sync("worker1", arrive_and_nap,
                                                         args=(5,)),
                             daemon=True).start()
            time.sleep(60)
        if rank == 1:
            pending = [rpc.rpc_async("worker2", arrive_and_nap, args=(30,))
                       for _ in range(5)]
            ready.wait(30)
            assert killed.wait(30)
            for f in pending:
                with pytest.raises(torchwire.WorkerUnavailableError, match="worker2"):
                    f.wait()
            failed = time.monotonic() - killed_at.value
            assert rpc.rpc_sync("worker0", add, args=(1, 2)) == 3
            t0 = time.monotonic()
            rpc.shutdown()
            return failed, time.monotonic() - t0
        # rank 0
        owned = rpc.remote("worker2", torch.ones, args=(2,))  # an RRef owned by worker2
        assert owned.to_here().tolist() == [1.0, 1.0]
        mine = rpc.RRef(torch.zeros(3))
        assert rpc.rpc_sync("worker2", keep, args=("held", mine))  # worker2 holds a fork
        assert int(rpc.api._rref_context_get_debug_info()["num_forks"]) == 1
        with dist_autograd.context() as cid:
            x = torch.ones(2, requires_grad=True)
            y = rpc.rpc_sync("worker2", torch.mul, args=(x, 2))
            pending = [rpc.rpc_async("worker2", arrive_and_nap, args=(30,))
                       for _ in range(20)]
            ready.wait(30)
            assert killed.wait(30)
            errors = []
            for f in pending:
                try:
                    f.wait()
                except torchwire.WorkerUnavailableError as exc:
                    errors.append(exc)
            failed = time.monotonic() - killed_at.value
            assert len(errors) == 20 and all(e.worker_name == "worker2" for e in errors)
            assert isinstance(errors[0], RuntimeError)
            t0 = time.monotonic()
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2"):
                rpc.rpc_sync("worker2", add, args=(1, 1))
            new_call = time.monotonic() - t0
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
                owned.to_here()
            assert info.value.worker_name == "worker2"
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2"):
                owned.rpc_sync().sum()
            assert wait_until(lambda: int(rpc.api._rref_context_get_debug_info()["num_forks"]) == 0)
            t0 = time.monotonic()
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
                dist_autograd.backward(cid, [y.sum()])
            assert info.value.worker_name == "worker2"
            backward = time.monotonic() - t0
        assert rpc.rpc_sync("worker1", add, args=(2, 3)) == 5  # survivors serve each other
        del owned, mine
        t0 = time.monotonic()
        rpc.shutdown()
        return failed, new_call, backward, time.monotonic() - t0

    procs = _start(body, 3)
    try:
        ready.wait(60)
        assert wait_until(lambda: _arrived.value == 26, timeout=30), _arrived.value
        killed_at.value = time.monotonic()
        os.kill(procs[2][0].pid, signal.SIGKILL)
        killed.set()
        failed0, new_call, backward, shutdown0 = _result(procs, 0)
        failed1, shutdown1 = _result(procs, 1)
    finally:
        _reap(procs)
    print(f"pending failed after {failed0:.3f}/{failed1:.3f} s; new call {new_call * 1000:.1f} "
          f"ms; backward {backward * 1000:.1f} ms; shutdown {shutdown0:.2f}/{shutdown1:.2f} s")
    assert failed0 < 2 and failed1 < 2
    assert new_call < 0.5 and backward < 2  # at once: not a probe (1 s) nor a handshake
    assert shutdown0 < 10 and shutdown1 < 10


# ---------------------------------------------------------------- death in a backward pass


class _InBackward(torch.autograd.Function):
    """Identity forward; its backward runs ``then(grad)``."""

    @staticmethod
    def forward(ctx, x, then):
        ctx.then = then
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return ctx.then(grad), None


def _crash(grad):
    from _cluster import die
    die("died in backward")  # a crash mid-pass


_stalls_ended = []


def _stall(grad):
    time.sleep(3)
    _stalls_ended.append(True)
    return grad


def stalls_ended():
    return len(_stalls_ended)


def crash_in_backward(x):
    return _InBackward.apply(x, _crash)


def slow_in_backward(x):
    return _InBackward.apply(x, _stall)


def _backward_through_worker1(x):
    """A pass that stays clear of worker2 still works, and leaves nothing running."""
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3))
        dist_autograd.backward(cid, [y.sum()])
        assert dist_autograd.get_gradients(cid)[x].tolist() == [3.0] * 3
        assert dist_autograd._debug_info()["num_current_backward_passes"] == 0


def relay(to, x):
    return rpc.rpc_sync(to, crash_in_backward, args=(x * 2,))


@pytest.mark.parametrize("path", ["direct", "through_another_worker"])
def test_a_worker_lost_in_its_part_of_a_backward_pass_fails_the_pass_naming_it(path):
    # The pass reaches worker2 from the root (direct) or from worker1, which then
    # tells the root (worker0 never talked to worker2).  worker2's part crashes.
    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=30))
        if rank == 2:
            time.sleep(60)
        if rank == 1:
            assert rpc.rpc_sync("worker0", add, args=(1, 2)) == 3  # after worker0's pass
            rpc.shutdown()
            return "served"
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as cid:
            if path == "direct":
                y = rpc.rpc_sync("worker2", crash_in_backward, args=(x,))
            else:
                y = rpc.rpc_sync("worker1", relay, args=("worker2", x))
            t0 = time.monotonic()
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
                dist_autograd.backward(cid, [y.sum()])
            failed = time.monotonic() - t0
            assert info.value.worker_name == "worker2"
        _backward_through_worker1(x)
        rpc.shutdown()
        return failed

    procs = _start(body, 3)
    try:
        failed = _result(procs, 0)
        assert [_result(procs, r) for r in (1, 2)] == ["served", "died in backward"]
    finally:
        _reap(procs)
    print(f"the pass failed {failed:.3f} s after it started")
    assert failed < 5


def test_a_backward_pass_that_makes_no_progress_times_out_naming_the_worker():
    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=1, init_timeout=60))
        if rank == 1:
            rpc.shutdown()
            return "served"
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", slow_in_backward, args=(x,))
            t0 = time.monotonic()
            with pytest.raises(torchwire.RpcTimeoutError, match="no progress.*worker1"):
                dist_autograd.backward(cid, [y.sum()])
            timed_out = time.monotonic() - t0
        # worker1's part ends; its late report is dropped
        assert wait_until(lambda: rpc.rpc_sync("worker1", stalls_ended) == 1, 30)
        _backward_through_worker1(x)
        rpc.shutdown()
        return timed_out

    procs = _start(body, 2)
    try:
        timed_out = _result(procs, 0)
        assert _result(procs, 1) == "served"
    finally:
        _reap(procs)
    assert 0.9 < timed_out < 2.5


def test_worker_killed_before_anyone_connected_to_it_is_reported_at_once():
    def body(rank, world_size, init_method):
        from _cluster import die
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        if rank == 1:
            die("died")  # a crash: no shutdown, no GOODBYE, no connection ever opened
        assert wait_until(lambda: not _probe_alive(1), 10)
        t0 = time.monotonic()
        for _ in range(3):
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker1"):
                rpc.rpc_sync("worker1", add, args=(1, 1))
        calls = time.monotonic() - t0
        t0 = time.monotonic()
        rpc.shutdown()
        return calls, time.monotonic() - t0

    procs = _start(body, 2)
    try:
        calls, shutdown = _result(procs, 0)
        assert _result(procs, 1) == "died"
    finally:
        _reap(procs)
    assert calls < 0.5 and shutdown < 5


def test_rank_0_death_ends_the_others_shutdown_with_an_error_when_it_hosted_the_store():
    # tcp:// (and env:// outside torchrun): rank 0 hosts the rendezvous store, which the
    # graceful shutdown's rounds go through; with it gone they cannot complete.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # rank 0 dies once the others are up: their init still reads its store
    up = [_ctx.Event() for _ in range(3)]

    def body(rank, world_size, init_method):
        from _cluster import die
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        up[rank].set()
        if rank == 0:
            assert all(e.wait(60) for e in up)
            die("died")
        assert wait_until(lambda: not _probe_alive(0), 10)
        t0 = time.monotonic()
        with pytest.raises(torchwire.RpcTimeoutError, match="the rendezvous store is gone"):
            rpc.shutdown()
        took = time.monotonic() - t0
        with pytest.raises(torchwire.RpcStateError):  # the local shutdown was carried out
            rpc.rpc_sync("worker1", add, args=(1, 1))
        return took

    procs = _start(body, 3, f"tcp://127.0.0.1:{port}")
    try:
        assert _result(procs, 0) == "died"
        took = [_result(procs, 1), _result(procs, 2)]
    finally:
        _reap(procs)
    assert max(took) < 20, took  # not the 30 s rpc_timeout of a store wait, nor a hang


def _probe_alive(rank):
    agent = rpc.api._get_current_rpc_agent()
    record = agent.names.member(rank).record
    return listener_alive(record.tcp, record.unix)


# ---------------------------------------------------------------- frozen worker (SIGSTOP)


def test_frozen_worker_times_calls_out_then_heartbeat_marks_it_unavailable():
    ready = _ctx.Barrier(3)
    frozen_at = _ctx.Value("d", 0.0)
    frozen = _ctx.Event()
    # Not tighter: on a loaded 2-core machine a healthy but starved peer can be silent
    # for over a second, which a shorter timeout would (rightly) report as lost.
    hb = dict(heartbeat_interval=0.3, heartbeat_timeout=3.0, handshake_timeout=2.0)

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=30, **hb))
        if rank == 2:
            time.sleep(60)
        if rank == 1:  # never talks to worker2: shutdown must still not wait for it
            ready.wait(30)
            assert frozen.wait(30)
            assert rpc.rpc_sync("worker0", add, args=(1, 2)) == 3
            t0 = time.monotonic()
            rpc.shutdown()
            return time.monotonic() - t0
        assert rpc.rpc_sync("worker2", add, args=(1, 1)) == 2
        ready.wait(30)
        assert frozen.wait(30)
        t0 = time.monotonic()
        with pytest.raises(torchwire.RpcTimeoutError, match="worker2"):
            rpc.rpc_sync("worker2", add, args=(1, 1), timeout=0.5)
        timed_out = time.monotonic() - t0
        slow = rpc.rpc_async("worker2", add, args=(1, 1))  # the 30 s default timeout
        assert rpc.rpc_sync("worker1", add, args=(2, 3)) == 5  # others are unaffected
        with pytest.raises(torchwire.WorkerUnavailableError, match="heartbeat") as info:
            slow.wait()
        assert info.value.worker_name == "worker2"
        detected = time.monotonic() - frozen_at.value
        # Down, not dead: a new call tries to reconnect, and the attempt gives up after
        # handshake_timeout (the frozen process accepts but never answers).
        t0 = time.monotonic()
        with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
            rpc.rpc_sync("worker2", add, args=(1, 1))
        new_call = time.monotonic() - t0
        assert "connect" in info.value.reason, info.value.reason  # tried again, in vain
        t0 = time.monotonic()
        rpc.shutdown()
        return timed_out, detected, new_call, time.monotonic() - t0

    procs = _start(body, 3)
    try:
        ready.wait(60)
        frozen_at.value = time.monotonic()
        freeze(procs[2][0].pid)
        frozen.set()
        timed_out, detected, new_call, shutdown0 = _result(procs, 0)
        shutdown1 = _result(procs, 1)
    finally:
        _reap(procs)  # SIGKILL ends a stopped process too
    print(f"timeout after {timed_out:.2f} s; heartbeat detection {detected:.2f} s; new call "
          f"{new_call * 1000:.1f} ms; shutdown {shutdown0:.2f}/{shutdown1:.2f} s")
    assert 0.4 < timed_out < 1.5
    assert 2.9 < detected < 3.0 + 2.0
    # tried again: its attempt is bounded by handshake_timeout (a background attempt,
    # 1 s, may hold the link first), or fails at once if the connect itself does
    assert new_call < 2.0 + 1.0 + 0.5
    # worker1's shutdown waits for all of worker0's work after the freeze
    assert shutdown0 < 5 and shutdown1 < new_call + 6


def test_heartbeat_does_not_disturb_a_busy_or_idle_healthy_job():
    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, heartbeat_interval=0.1,
                                                 heartbeat_timeout=1.0))
        if rank == 0:
            # a call that runs 3 heartbeat timeouts, and a stretch of silence
            assert rpc.rpc_sync("worker1", nap, args=(3.0,)) == 3.0
            time.sleep(1.5)
            assert rpc.rpc_sync("worker1", add, args=(1, 1)) == 2
        down = rpc.api._get_current_rpc_agent().health.down()
        rpc.shutdown()
        return down

    procs = _start(body, 2)
    try:
        assert _result(procs, 0) == {} and _result(procs, 1) == {}
    finally:
        _reap(procs)


def test_heartbeat_options_are_validated():
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        rpc.TensorPipeRpcBackendOptions(heartbeat_interval=2.0, heartbeat_timeout=1.0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        rpc.TensorPipeRpcBackendOptions(heartbeat_interval=-1)
    off = rpc.TensorPipeRpcBackendOptions(heartbeat_interval=0)
    assert off.heartbeat_interval == 0.0


# ---------------------------------------------------------------- garbage after the handshake


def _wait_dropped(s: socket.socket, timeout: float = 5.0) -> None:
    """Read (its PINGs too) until the server closes the connection.

    Raises:
        TimeoutError: it did not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the server kept the connection for {timeout} s")
            s.settimeout(left)
            if not s.recv(4096):
                return
    except ConnectionResetError:
        return


def _garbage_sender(addr_q, done, secret):
    """Authenticate as rank 1 with the right secret, then send bad frames; each
    connection ends (the server drops it) before the next one opens."""
    try:
        (host, port) = addr_q.get(timeout=30)
        auth = JobAuth(secret, source="options", timeout=5.0)
        auth._key = addr_q.get(timeout=30)  # the job's key: this is an insider gone bad
        frames = [(b"XY" + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[2:], True),  # magic
                  (F.encode_header(F.K_REQUEST, 0, 1, 1 << 40, []), True),  # absurd length
                  # cut short (45 of 50 payload bytes; 7 of a header): closed by us
                  (F.encode_header(F.K_REQUEST, 0, 7, 50, []) + b"\x80\x05garbage" * 5, False),
                  (b"\x00" * 7, False)]
        for raw, drops in frames:
            s = socket.create_connection((host, port), timeout=5)
            s = client_handshake(s, 1, auth, 0, transport="tcp", host=host)
            s.sendall(raw)
            if not drops:  # the server waits for the rest of the frame
                s.shutdown(socket.SHUT_WR)
            _wait_dropped(s)
            s.close()
    finally:
        done.set()


def test_garbage_after_the_handshake_drops_that_connection_and_the_worker_keeps_serving():
    addr_q, done = _ctx.Queue(), _ctx.Event()
    secret = b"fuzzy secret"
    sender = _ctx.Process(target=_garbage_sender, args=(addr_q, done, secret))
    sender.start()

    def body(rank, world_size, init_method):
        import logging
        logs = []

        class Keep(logging.Handler):
            def emit(self, record):
                logs.append(record.getMessage())
        logging.getLogger("torchwire").addHandler(Keep(logging.WARNING))
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, auth_secret=secret,
                                                 _transports=["tcp"],
                                                 max_message_size=1 << 30))
        agent = rpc.api._get_current_rpc_agent()
        if rank == 0:
            addr_q.put(tuple(agent.links.listener.tcp_address))
            addr_q.put(agent.links.job._key)
        assert done.wait(30)
        # the worker serves everyone, the impersonated rank 1 included
        peer = f"worker{1 - rank}"
        deadline = time.monotonic() + 10
        while True:
            try:
                value = rpc.rpc_sync(peer, add, args=(rank, 10))
                break
            except torchwire.WorkerUnavailableError:
                assert time.monotonic() < deadline  # reconnected by the liveness thread
                time.sleep(0.05)
        rpc.shutdown()
        return value, logs

    procs = []
    try:
        procs = _start(body, 2)
        (v0, logs0), (v1, _) = _result(procs, 0), _result(procs, 1)
    finally:
        _reap(procs)
        sender.join(10)
        if sender.is_alive():
            sender.kill()
    assert sender.exitcode == 0, "the garbage sender failed (see its traceback above)"
    assert (v0, v1) == (10, 11)
    dropped = [m for m in logs0 if "dropping connection" in m]
    assert any("bad magic" in m for m in dropped), logs0
    assert any("max message size" in m for m in dropped), logs0
