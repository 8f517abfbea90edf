"""A worker's life around its RPC sessions: Ctrl-C, shutdown() where it cannot
work, RRefs of an earlier session (init_rpc again on the same store:
tests/test_sessions.py).

Real processes throughout; Ctrl-C is a real SIGINT to the process, whose main thread
is the one waiting.
"""

from __future__ import annotations

import dis
import gc
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torchwire.rpc as rpc
from _cluster import child_result, new_init_method, options, run_world, start_child, wait_until
from torchwire import RRefError
from torchwire._base import threads as _threads

pytestmark = pytest.mark.timeout(90)

_fork = mp.get_context("fork")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slow(seconds):
    time.sleep(seconds)
    return "slept"


_release = threading.Event()


def _held_back():
    """Returns once released (or after 30 s)."""
    return _release.wait(30)


def _let_go():
    _release.set()


def _shut_down_here():
    rpc.shutdown()  # graceful: it would wait for this very call


def _interruptible() -> None:
    """Ctrl-C raises KeyboardInterrupt here, as in a program started from a terminal (a
    process started in the background by a shell inherits SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(wait) -> tuple:
    """``wait()`` on the main thread while a SIGINT comes; what happened and when."""
    _interruptible()
    t0 = time.monotonic()
    try:
        value = wait()
    except KeyboardInterrupt:
        return "KeyboardInterrupt", time.monotonic() - t0
    return value, time.monotonic() - t0


def _blocked_in(ident: int, wait_code) -> bool:
    """Is thread ``ident`` blocked inside ``wait_code`` (a ``wait`` method): its top
    frame ``wait_blocking``, called from it, in its call of the lock's acquire?"""
    f = sys._current_frames().get(ident)
    return (f is not None and f.f_code is _threads.wait_blocking.__code__
            and dis.opname[f.f_code.co_code[f.f_lasti]] == "CALL_FUNCTION_EX"
            and f.f_back is not None and f.f_back.f_code is wait_code)


def test_ctrl_c_interrupts_a_future_wait_and_shutdown_inside_a_call_is_refused():
    def body(rank, world_size):
        if rank == 1:
            return None
        fut = rpc.rpc_async("worker1", _held_back)
        _interruptible()  # before the helper starts: a late thread must not miss it
        main, signalled = threading.get_ident(), []

        def interrupt():  # the SIGINT comes once this thread is blocked in fut.wait()
            if wait_until(lambda: _blocked_in(main, type(fut).wait.__code__), 20):
                signalled.append(True)
                os.kill(os.getpid(), signal.SIGINT)

        helper = threading.Thread(target=interrupt, daemon=True)
        helper.start()
        outcome, waited = _interrupted(fut.wait)
        helper.join()
        # graceful shutdown() inside a served function: refused at once, no deadlock
        try:
            rpc.rpc_sync("worker1", _shut_down_here, timeout=0)
            refused = None
        except Exception as exc:
            refused = (type(exc).__name__, str(exc))
        served = rpc.rpc_sync("worker1", _slow, args=(0,))
        done = fut.done()
        rpc.rpc_sync("worker1", _let_go)
        return outcome, waited, signalled, done, fut.wait(), refused, served

    outcome, waited, signalled, done, value, refused, served = run_world(body, 2, timeout=80)[0]
    assert signalled, "the main thread was never seen blocked in fut.wait()"
    assert outcome == "KeyboardInterrupt", outcome
    assert waited < 15, f"Ctrl-C took {waited:.1f} s to interrupt a 30 s wait"
    assert not done and value is True  # the call went on, and its reply came
    assert refused is not None and refused[0] == "RpcStateError", refused
    assert "cannot run inside a function" in refused[1], refused
    assert served == "slept"


def _init_alone(rank, world_size, init_method):
    """rank 0 of a job of 2 whose rank 1 never comes: init_rpc waits for it."""
    _interruptible()
    try:
        rpc.init_rpc("worker0", rank=0, world_size=2,
                     rpc_backend_options=options(init_method))
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "joined"


def test_ctrl_c_interrupts_init_rpc_waiting_for_a_missing_worker():
    port = _free_port()
    child = start_child(_init_alone, 0, 2, f"tcp://127.0.0.1:{port}")
    try:
        # once worker0 published itself it waits for worker1: interrupt it then
        store = dist.PrefixStore("torchwire", dist.TCPStore(
            "127.0.0.1", port, None, False, timedelta(seconds=30), wait_for_workers=False))
        store.wait(["worker/0"], timedelta(seconds=30))
        t0 = time.monotonic()
        os.kill(child[0].pid, signal.SIGINT)
        outcome = child_result(child, 40)
        waited = time.monotonic() - t0
    finally:
        child[0].kill()
    assert outcome == "KeyboardInterrupt"
    assert waited < 20, f"Ctrl-C took {waited:.1f} s (the init timeout is 60 s)"


def _make(n):
    return torch.full((3,), float(n))


def test_an_rref_of_an_earlier_session_neither_reads_nor_deletes_the_next_ones():
    second = new_init_method()
    ready = _fork.Barrier(2)

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                     rpc_backend_options=options(init_method))
        held = rpc.remote("worker1", _make, args=(1,)) if rank == 0 else None
        if held is not None:
            assert held.to_here().tolist() == [1.0] * 3
        ready.wait(30)
        rpc.shutdown(graceful=False)
        ready.wait(30)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                     rpc_backend_options=options(second))
        out = None
        if rank == 0:
            fresh = rpc.remote("worker1", _make, args=(2,))
            assert fresh.to_here().tolist() == [2.0] * 3
            try:
                stale = ("read", held.to_here().tolist())
            except RRefError as exc:
                stale = ("RRefError", str(exc))
            del held  # must not delete the value of the new session's first RRef
            gc.collect()
            rpc.rpc_sync("worker1", gc.collect)  # a deletion would have arrived first
            out = stale, fresh.to_here().tolist()
        rpc.shutdown()
        return out

    stale, fresh = run_world(body, 2, init=False, timeout=80)[0]
    assert stale[0] == "RRefError" and "session that was shut down" in stale[1], stale
    assert fresh == [2.0] * 3
