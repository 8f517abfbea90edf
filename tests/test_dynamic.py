"""Dynamic groups: ``init_rpc`` without a world size; members join and leave.

Real processes, real sockets and torch's real stores.  The order of joins and
leaves is set with events the forked children share (every wait bounded); the
children return plain values that the test asserts on here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch.distributed as dist

import torchwire
import torchwire.rpc as rpc
from _cluster import die, new_init_method, run_world, wait_until
from torchwire._bootstrap.membership import read_members
from torchwire._bootstrap.rendezvous import PREFIX
from torchwire._wire.listener import listener_alive

_ctx = mp.get_context("fork")
WAIT = 30  # seconds any child waits for an event before failing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(name: str, rank: int, init_method: str, **kw) -> None:
    kw.setdefault("rpc_timeout", 20)
    rpc.init_rpc(name, rank=rank, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, **kw))


def _names() -> list[str]:
    return [i.name for i in rpc._get_current_rpc_agent().get_worker_infos()]


def _add(a, b):
    return a + b


def _whoami():
    return rpc.get_worker_info().name


_arrived = _ctx.Event()  # set by the callee of _slow_echo: the call runs there


def _slow_echo(x, seconds):
    _arrived.set()
    time.sleep(seconds)  # still running while its worker leaves
    return x


def _error(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _store(init_method: str):
    return dist.PrefixStore(PREFIX, dist.FileStore(init_method[len("file://"):], -1))


# ------------------------------------------------------------------ joining


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_late_joiners_see_earlier_members_and_are_seen_by_them(scheme):
    init_method = new_init_method() if scheme == "file" else f"tcp://127.0.0.1:{_free_port()}"
    up = [_ctx.Event() for _ in range(3)]
    done = [_ctx.Event() for _ in range(3)]

    def body(rank, _world_size, _unused):
        if rank > 0:
            assert up[rank - 1].wait(WAIT)
        _join(f"worker{rank}", rank, init_method)
        seen_at_join = _names()
        calls = {f"worker{k}": rpc.rpc_sync(f"worker{k}", _add, args=(rank, 10 * k))
                 for k in range(rank)}  # the new member calls every earlier one
        up[rank].set()
        later = {}
        if rank < 2:
            assert up[2].wait(WAIT)
            # the earlier member calls the later ones, by name, rank and WorkerInfo
            later = {k: (rpc.rpc_sync(f"worker{k}", _whoami), rpc.rpc_sync(k, _whoami),
                         rpc.rpc_sync(rpc.get_worker_info(f"worker{k}"), _whoami))
                     for k in range(rank + 1, 3)}
        seen_at_end = _names()
        infos = rpc._get_current_rpc_agent().get_worker_infos()
        done[rank].set()
        assert all(e.wait(WAIT) for e in done)
        rpc.shutdown()
        return seen_at_join, calls, later, seen_at_end, [(i.name, i.id) for i in infos]

    results = run_world(body, 3, init=False, timeout=60)
    for rank, (seen_at_join, calls, later, seen_at_end, infos) in enumerate(results):
        assert seen_at_join == [f"worker{k}" for k in range(rank + 1)]
        assert calls == {f"worker{k}": rank + 10 * k for k in range(rank)}
        assert later == {k: (f"worker{k}",) * 3 for k in range(rank + 1, 3)}
        assert seen_at_end == ["worker0", "worker1", "worker2"]
        assert infos == [("worker0", 0), ("worker1", 1), ("worker2", 2)]


def test_members_joining_and_leaving_at_once_all_meet():
    """Three join at once (the lock serializes them) and leave at once."""
    called = [_ctx.Event() for _ in range(3)]

    def body(rank, _world_size, init_method):
        _join(f"worker{rank}", rank, init_method)
        assert wait_until(lambda: len(_names()) == 3, WAIT), _names()
        replies = [rpc.rpc_sync(f"worker{k}", _whoami) for k in range(3)]
        called[rank].set()
        assert all(e.wait(WAIT) for e in called)
        t0 = time.monotonic()
        rpc.shutdown()
        return replies, time.monotonic() - t0

    for replies, elapsed in run_world(body, 3, init=False, timeout=60):
        assert replies == ["worker0", "worker1", "worker2"]
        assert elapsed < 10


# ------------------------------------------------------------------ leaving


def test_a_member_that_leaves_is_forgotten_and_calls_to_it_fail_naming_it():
    init_method = new_init_method()
    up = [_ctx.Event() for _ in range(3)]
    left = _ctx.Event()
    checked = [_ctx.Event(), _ctx.Event()]
    _arrived.clear()

    def body(rank, _world_size, _unused):
        _join(f"worker{rank}", rank, init_method)
        up[rank].set()
        assert all(e.wait(WAIT) for e in up)
        assert wait_until(lambda: len(_names()) == 3, WAIT)
        if rank == 2:  # leaves while worker0's call to it is still running here
            assert _arrived.wait(WAIT)
            t0 = time.monotonic()
            rpc.shutdown()
            left.set()
            return time.monotonic() - t0
        fut = None
        if rank == 0:
            info2 = rpc.get_worker_info("worker2")
            fut = rpc.rpc_async("worker2", _slow_echo, args=("finished", 0.5))
        assert left.wait(WAIT)
        out = {
            "in_flight": fut.wait() if fut is not None else "finished",
            "names": _names(),
            "by_name": _error(rpc.rpc_sync, "worker2", _whoami),
            "by_rank": _error(rpc.rpc_sync, 2, _whoami),
            "info": _error(rpc.get_worker_info, "worker2"),
            "remote": _error(rpc.remote, "worker2", _whoami),
            "others": rpc.rpc_sync(f"worker{1 - rank}", _whoami),
        }
        if rank == 0:
            out["by_info"] = _error(rpc.rpc_sync, info2, _whoami)
        checked[rank].set()
        assert all(e.wait(WAIT) for e in checked)
        rpc.shutdown()
        return out

    results = run_world(body, 3, init=False, timeout=60)
    assert results[2] < 10  # leaving took its own time, not the others'
    for rank in (0, 1):
        out = results[rank]
        assert out["in_flight"] == "finished"
        assert out["names"] == ["worker0", "worker1"]
        assert out["others"] == f"worker{1 - rank}"
        errors = [out["by_name"], out["by_rank"], out["info"], out["remote"]]
        errors += [out["by_info"]] if rank == 0 else []
        for name, msg in errors:
            assert name == "WorkerUnavailableError", (name, msg)
            assert "worker2" in msg and "left the RPC group" in msg


@pytest.mark.parametrize("takes_its_place", [True, False], ids=["same-rank", "new-rank"])
def test_a_member_that_died_is_dropped_when_a_newcomer_finds_it(takes_its_place):
    """worker1 dies without leaving.  A newcomer finds it dead: with its rank and name
    the newcomer takes its place; with a rank of its own it drops it from the group
    and tells worker0, whose calls to worker1 then fail naming it."""
    init_method = new_init_method()
    new = "worker1" if takes_its_place else "worker2"
    up0, died, joined, checked = (_ctx.Event() for _ in range(4))

    def body(index, _world_size, _unused):
        if index == 0:
            _join("worker0", 0, init_method)
            up0.set()
            assert joined.wait(WAIT)
            out = {"names": _names(), "pid": rpc.rpc_sync(new, os.getpid),
                   "old": _error(rpc.rpc_sync, "worker1", _whoami)}
            checked.set()
            rpc.shutdown()
            return out
        if index == 1:
            assert up0.wait(WAIT)
            _join("worker1", 1, init_method)
            assert rpc.rpc_sync("worker0", _whoami) == "worker0"
            died.set()
            die(os.getpid())  # gone without leaving
        assert died.wait(WAIT)
        record = read_members(_store(init_method))[1]
        # a dead process refuses connections: wait until its listener is closed
        assert wait_until(lambda: not listener_alive(record["tcp"], record["unix"]), WAIT)
        _join(new, int(new[-1]), init_method)
        names = _names()
        joined.set()
        assert checked.wait(WAIT)
        rpc.shutdown()
        return names, os.getpid()

    out, dead_pid, (names, new_pid) = run_world(body, 3, init=False, timeout=60)
    assert out["names"] == names == ["worker0", new]
    assert out["pid"] == new_pid != dead_pid
    if takes_its_place:
        assert out["old"] == ("no error", "")  # "worker1" is the newcomer now
    else:
        name, msg = out["old"]
        assert name == "WorkerUnavailableError"
        assert "worker1" in msg and "is gone" in msg and "worker2 joined" in msg


# ------------------------------------------------------------------ refusals


def test_a_dynamic_member_cannot_join_a_static_group_nor_the_other_way_round():
    static_first, dynamic_first = new_init_method(), new_init_method()
    static_up, dynamic_up, tried = _ctx.Event(), _ctx.Event(), _ctx.Event()
    phrase = ("RPC group mixes statically and dynamically initialized members which is not "
              "supported.")

    def body(index, _world_size, _unused):
        if index < 2:  # a static job of two
            rpc.init_rpc(f"worker{index}", rank=index, world_size=2,
                         rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                             init_method=static_first))
            static_up.set()
        elif index == 3:  # a dynamic group of one
            _join("dyn0", 0, dynamic_first)
            dynamic_up.set()
        else:
            assert static_up.wait(WAIT) and dynamic_up.wait(WAIT)
            t0 = time.monotonic()
            try:
                errors = [
                    _error(_join, "worker2", 2, static_first),
                    _error(rpc.init_rpc, "stat1", None, 1, 2, rpc.TensorPipeRpcBackendOptions(
                        init_method=dynamic_first, init_timeout=20)),
                ]
            finally:
                tried.set()
            return errors, time.monotonic() - t0
        assert tried.wait(WAIT)
        names = _names()
        rpc.shutdown()
        return names

    results = run_world(body, 4, init=False, timeout=60)
    assert results[0] == results[1] == ["worker0", "worker1"]
    assert results[3] == ["dyn0"]  # neither group was disturbed
    (dynamic_into_static, static_into_dynamic), elapsed = results[2]
    assert dynamic_into_static[0] == static_into_dynamic[0] == "RendezvousError"
    assert phrase in dynamic_into_static[1] and "called init_rpc with world_size" \
        in dynamic_into_static[1]
    assert phrase in static_into_dynamic[1] and "without world_size" in static_into_dynamic[1]
    assert elapsed < 10  # refused at once, not after the init timeout


def test_without_a_rank_init_rpc_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for init_method in ("file:///tmp/torchwire-never-created", "tcp://127.0.0.1:1"):
        with pytest.raises(ValueError, match="rank parameter missing"):
            rpc.init_rpc("worker0", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=init_method))
    with pytest.raises(ValueError, match="environment variable RANK expected"):
        rpc.init_rpc("worker0", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="env://"))
    with pytest.raises(ValueError, match="0..32767"):
        rpc.init_rpc("worker0", rank=40000, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="file:///tmp/torchwire-never-created"))
    with pytest.raises(torchwire.RpcStateError):  # and nothing was initialised
        rpc.get_worker_info()


def test_rank_or_name_of_a_live_member_and_other_security_settings_are_refused():
    init_method = new_init_method()
    up, tried = _ctx.Event(), _ctx.Event()

    def body(index, _world_size, _unused):
        if index == 0:
            _join("worker0", 0, init_method, auth_secret="job secret")
            up.set()
            assert tried.wait(WAIT)
            names = _names()
            rpc.shutdown()
            return names
        assert up.wait(WAIT)
        try:
            return [_error(_join, "other", 0, init_method, auth_secret="job secret"),
                    _error(_join, "worker0", 1, init_method, auth_secret="job secret"),
                    _error(_join, "worker1", 1, init_method)]
        finally:
            tried.set()

    names, errors = run_world(body, 2, init=False, timeout=60)
    assert names == ["worker0"]  # the member was not disturbed
    (n1, rank_taken), (n2, name_taken), (n3, security) = errors
    assert n1 == n2 == n3 == "RendezvousError"
    assert "rank 0 is already taken by worker 'worker0'" in rank_taken
    assert "'worker0' is already used by rank 0" in name_taken
    assert "disagree on security settings" in security


# ------------------------------------------------------------------ lock and store


@pytest.mark.parametrize("holder_alive", [True, False])
def test_the_membership_lock_held_by_a_live_worker_fails_the_join_in_time(holder_alive):
    """A live holder is waited for until the init timeout, then named; a dead one's
    lock (its listener refuses connections) is taken over."""
    init_method = new_init_method()
    timeout = 1.5

    def body(_rank, _world_size, _unused):
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        holder = {"name": "blocker", "rank": 7, "host": "elsewhere", "unix": None,
                  "tcp": list(blocker.getsockname()), "token": "x"}
        if not holder_alive:
            blocker.close()  # connections to its address are refused: a dead process
        _store(init_method).set("dyn/lock", json.dumps(holder))
        t0 = time.monotonic()
        try:
            _join("worker0", 0, init_method, init_timeout=timeout)
        except Exception as exc:
            return type(exc).__name__, str(exc), time.monotonic() - t0
        names = _names()
        rpc.shutdown()
        return "joined", names, time.monotonic() - t0

    what, detail, elapsed = run_world(body, 1, init=False, timeout=30)[0]
    if holder_alive:
        assert what == "RendezvousError"
        assert "membership lock" in detail and "blocker (rank 7)" in detail
        assert timeout - 0.2 <= elapsed < timeout + 1.5
    else:
        assert (what, detail) == ("joined", ["worker0"])
        assert elapsed < timeout + 1.5


def test_when_the_store_is_gone_leaving_and_joining_end_in_time():
    """tcp://: rank 0 hosts the store and dies.  The member left behind still leaves
    (it cannot take the lock) and a newcomer fails within its init timeout."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    up0, up1, died = _ctx.Event(), _ctx.Event(), _ctx.Event()

    def body(index, _world_size, _unused):
        if index == 0:
            _join("worker0", 0, init_method)
            up0.set()
            assert up1.wait(WAIT)
            die()  # the store goes with it
        if index == 1:
            assert up0.wait(WAIT)
            _join("worker1", 1, init_method)
            up1.set()
            assert wait_until(lambda: not _alive(0), WAIT)
            t0 = time.monotonic()
            rpc.shutdown()
            died.set()
            return time.monotonic() - t0
        assert died.wait(WAIT)
        t0 = time.monotonic()
        error = _error(_join, "worker2", 2, init_method, init_timeout=1.5)
        return error, time.monotonic() - t0

    results = run_world(body, 3, init=False, timeout=60)
    assert results[1] < 5  # no hang on the store that is gone
    (name, msg), elapsed = results[2]
    assert name == "RendezvousError" and "could not reach the rendezvous store" in msg
    assert elapsed < 1.5 + 1.5


def _alive(rank: int) -> bool:
    try:
        rpc.rpc_sync(rank, _whoami, timeout=2)
        return True
    except RuntimeError:
        return False


def test_the_store_host_leaves_last_and_the_others_go_on_without_it():
    """tcp://: rank 0 hosts the store.  It leaves the group at once, but its
    shutdown returns only after the others have left; meanwhile they still call
    each other (and no longer it)."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    up = [_ctx.Event() for _ in range(3)]
    called = [_ctx.Event() for _ in range(3)]

    def body(rank, _world_size, _unused):
        if rank > 0:
            assert up[0].wait(WAIT)
        _join(f"worker{rank}", rank, init_method)
        up[rank].set()
        assert all(e.wait(WAIT) for e in up)
        assert wait_until(lambda: len(_names()) == 3, WAIT)
        if rank == 0:
            rpc.shutdown()
            return time.monotonic()
        assert wait_until(lambda: "worker0" not in _names(), WAIT)
        reply = rpc.rpc_sync(f"worker{3 - rank}", _whoami)
        gone = _error(rpc.rpc_sync, "worker0", _whoami)
        called[rank].set()
        assert called[3 - rank].wait(WAIT)
        started = time.monotonic()
        rpc.shutdown()
        return reply, gone, started

    results = run_world(body, 3, init=False, timeout=60)
    zero_returned = results[0]
    for rank in (1, 2):
        reply, (name, msg), started = results[rank]
        assert reply == f"worker{3 - rank}"
        assert name == "WorkerUnavailableError" and "worker0" in msg
        assert zero_returned > started  # the store stayed up until they had left
