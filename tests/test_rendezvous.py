"""Rendezvous: init methods, worker names, ranks, missing peers, options.

Real processes and real torch stores (``FileStore``, ``TCPStore``), no mocks.
Every job is a fresh :func:`run_world` whose children call ``init_rpc``
themselves (``init=False``) and return plain values that the test asserts on
here, in the pytest process, which never joins a job itself.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torchwire
import torchwire.rpc as rpc
from _cluster import new_init_method, run_world
from torchwire._base.worker_info import check_worker_name
from torchwire._bootstrap.rendezvous import PREFIX, wait_count
from torchwire.rpc.api import _get_current_rpc_agent

# Keeps failed-init exceptions (and, through their tracebacks, the store objects)
# alive in a child until it exits: a FileStore that is destroyed counts towards the
# file's cleanup, and an extra process in a job must not delete the winners' file.
_keep: list = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _opts(init_method: str, **kw):
    kw.setdefault("rpc_timeout", 30)
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, **kw)


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def _peer_add(a, b):
    return a + b


def _whoami():
    info = rpc.get_worker_info()
    return info.name, info.id


def _joined_job_summary(rank: int, world_size: int) -> dict:
    """What a worker sees once init_rpc returned: names, ranks and a real call."""
    me = rpc.get_worker_info()
    peer = (rank + 1) % world_size
    peer_name = f"worker{peer}"
    out = {
        "self": (me.name, me.id),
        "self_is_workerinfo": isinstance(me, rpc.WorkerInfo),
        "by_name": rpc.get_worker_info(peer_name),
        "by_rank": rpc.get_worker_info(peer),
        "self_by_name": rpc.get_worker_info(me.name) == me,
        "self_by_rank": rpc.get_worker_info(rank) == me,
        "call": rpc.rpc_sync(peer_name, _peer_add, args=(rank, 100)),
        "peer_says": rpc.rpc_sync(peer, _whoami),
    }
    rpc.shutdown()
    return out


def _assert_joined(results: list, world_size: int) -> None:
    assert len(results) == world_size
    for rank, out in enumerate(results):
        peer = (rank + 1) % world_size
        assert out["self"] == (f"worker{rank}", rank)
        assert out["self_is_workerinfo"]
        assert out["by_name"] == rpc.WorkerInfo(f"worker{peer}", peer)
        assert out["by_rank"] == rpc.WorkerInfo(f"worker{peer}", peer)
        assert out["self_by_name"] and out["self_by_rank"]
        assert out["call"] == rank + 100
        assert out["peer_says"] == (f"worker{peer}", peer)


# ------------------------------------------------------------------ init methods


def test_init_via_file_store():
    def body(rank, world_size, init_method):
        assert init_method.startswith("file://")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=_opts(init_method))
        return _joined_job_summary(rank, world_size)

    _assert_joined(run_world(body, 3, init=False, timeout=60), 3)


def test_init_via_tcp_store():
    init_method = f"tcp://127.0.0.1:{_free_port()}"

    def body(rank, world_size, _unused):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=_opts(init_method))
        return _joined_job_summary(rank, world_size)

    _assert_joined(run_world(body, 3, init=False, timeout=60), 3)


def test_init_via_env_takes_rank_and_world_size_from_environment():
    port = _free_port()

    def body(rank, world_size, _unused):
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "RANK": str(rank), "WORLD_SIZE": str(world_size)})
        # No rank, no world_size, no options: everything comes from env:// (the default).
        rpc.init_rpc(f"worker{rank}")
        return _joined_job_summary(rank, world_size)

    _assert_joined(run_world(body, 3, init=False, timeout=60), 3)


def _env_init_error(env: dict, unset: tuple, **init_kwargs):
    """Run init_rpc("worker0", env://) in a fresh process with ``env``; return its error."""
    def body(rank, world_size, _unused):
        for key in unset:
            os.environ.pop(key, None)
        os.environ.update(env)
        try:
            rpc.init_rpc("worker0", rpc_backend_options=_opts("env://", rpc_timeout=2),
                         **init_kwargs)
        except Exception as exc:
            return _error(exc)
        rpc.shutdown()
        return ("no error", "")

    return run_world(body, 1, init=False, timeout=30)[0]


def test_env_init_without_master_addr_is_value_error():
    name, msg = _env_init_error({}, ("MASTER_ADDR", "MASTER_PORT"), rank=0, world_size=1)
    assert name == "ValueError"
    assert "MASTER_ADDR" in msg


def test_env_init_without_rank_in_environment_is_value_error():
    name, msg = _env_init_error({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                                 "WORLD_SIZE": "1"}, ("RANK",))
    assert name == "ValueError"
    assert "RANK" in msg


def test_single_worker_job():
    def body(rank, world_size, init_method):
        rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=_opts(init_method))
        me = rpc.get_worker_info()
        value = rpc.rpc_sync("solo", _peer_add, args=(1, 2))  # a call to itself
        rpc.shutdown()
        return (me.name, me.id), value

    assert run_world(body, 1, init=False, timeout=30) == [(("solo", 0), 3)]


def test_backend_type_tensorpipe_is_accepted():
    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", backend=rpc.BackendType.TENSORPIPE, rank=rank,
                     world_size=world_size, rpc_backend_options=_opts(init_method))
        value = rpc.rpc_sync(f"worker{1 - rank}", _peer_add, args=(rank, 10))
        rpc.shutdown()
        return value

    assert run_world(body, 2, init=False, timeout=60) == [10, 11]


# ------------------------------------------------------------------ worker names

BAD_NAMES = ["a b", "x" * 128, "", "é", 5, "a\n", "worker\n", "a.b", "a/b", "tab\t", None,
             b"worker0"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_worker_name_is_value_error_before_anything_starts(name):
    # The init method cannot be opened: if the name check let ``name`` through, the
    # call would fail on the init method instead of starting a job in this process.
    opts = rpc.TensorPipeRpcBackendOptions(init_method="unsupported-scheme://nowhere")
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError) as info:
        rpc.init_rpc(name, rank=0, world_size=1, rpc_backend_options=opts)
    assert "unsupported" not in str(info.value), f"name {name!r} passed the name check"
    assert "name" in str(info.value).lower()
    threads_after = {t.ident for t in threading.enumerate()}
    assert threads_after <= threads_before
    with pytest.raises(ValueError):
        check_worker_name(name)
    with pytest.raises(torchwire.RpcStateError):  # and nothing was initialised
        rpc.get_worker_info()


@pytest.mark.parametrize("name", ["a", "Z", "0", "x" * 127, "trainer:0", "ps-1_a:b", "_-:"])
def test_good_worker_names_pass_the_check(name):
    check_worker_name(name)  # must not raise


def test_longest_and_punctuated_names_join_a_real_job():
    names = ["n" * 127, "ps-1_a:b"]

    def body(rank, world_size, init_method):
        rpc.init_rpc(names[rank], rank=rank, world_size=world_size,
                     rpc_backend_options=_opts(init_method))
        other = names[1 - rank]
        out = (rpc.get_worker_info(other).id, rpc.rpc_sync(other, _whoami))
        rpc.shutdown()
        return out

    res = run_world(body, 2, init=False, timeout=60)
    assert res == [(1, (names[1], 1)), (0, (names[0], 0))]


def test_duplicate_names_fail_on_every_rank_and_name_the_duplicate():
    names = ["worker0", "twin", "twin"]

    def body(rank, world_size, init_method):
        t0 = time.monotonic()
        try:
            rpc.init_rpc(names[rank], rank=rank, world_size=world_size,
                         rpc_backend_options=_opts(init_method, rpc_timeout=10))
        except Exception as exc:
            _keep.append(exc)
            return _error(exc) + (time.monotonic() - t0,)
        rpc.shutdown()
        return ("no error", "", 0.0)

    results = run_world(body, 3, init=False, timeout=60)
    for name, msg, elapsed in results:
        assert name == "RendezvousError"
        assert "'twin'" in msg
        assert "[1, 2]" in msg  # the ranks that share it
        assert elapsed < 10  # everyone had joined: no waiting for the init timeout


# ------------------------------------------------------------------ ranks


@pytest.mark.parametrize("rank,world_size", [(5, 2), (2, 2), (-2, 2)])
def test_rank_outside_the_world_is_value_error(rank, world_size):
    def body(_rank, _world_size, init_method):
        os.environ.pop("RANK", None)
        t0 = time.monotonic()
        try:
            rpc.init_rpc("worker0", rank=rank, world_size=world_size,
                         rpc_backend_options=_opts(init_method, rpc_timeout=5))
        except Exception as exc:
            return _error(exc) + (time.monotonic() - t0,)
        rpc.shutdown()
        return ("no error", "", 0.0)

    name, msg, elapsed = run_world(body, 1, init=False, timeout=30)[0]
    assert name == "ValueError"
    assert "rank" in msg.lower()
    if rank >= 0:
        assert str(rank) in msg and str(world_size) in msg
    assert elapsed < 2  # refused up front, not after waiting for a rendezvous


@pytest.mark.parametrize("world_size", [0, -1])
def test_non_positive_world_size_is_value_error(world_size):
    def body(_rank, _world_size, init_method):
        try:
            rpc.init_rpc("worker0", rank=0, world_size=world_size,
                         rpc_backend_options=_opts(init_method, rpc_timeout=5))
        except Exception as exc:
            return _error(exc)
        rpc.shutdown()
        return ("no error", "")

    name, msg = run_world(body, 1, init=False, timeout=30)[0]
    assert name == "ValueError" and "world_size" in msg


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_two_processes_with_the_same_rank(scheme):
    # Three processes for a job of two: ranks 0, 1, 1.  One of the two rank-1 processes
    # wins the claim and the job forms; the other is refused at once.
    init_method = new_init_method() if scheme == "file" else f"tcp://127.0.0.1:{_free_port()}"
    ranks = [0, 1, 1]
    names = ["worker0", "first", "second"]

    def body(index, _world_size, _unused):
        try:
            rpc.init_rpc(names[index], rank=ranks[index], world_size=2,
                         rpc_backend_options=_opts(init_method, rpc_timeout=20))
        except Exception as exc:
            _keep.append(exc)
            return ("error",) + _error(exc)
        rank1 = rpc.get_worker_info(1).name
        me = rpc.get_worker_info()
        if me.id == 0:
            # rank 0 may host the store: stay until the second rank-1 claim has been made
            store = _get_current_rpc_agent().store
            assert wait_count(store, "rank/1", 2, time.monotonic() + 20), "no second claim"
        rpc.shutdown()
        return ("ok", (me.name, me.id), rank1)

    results = run_world(body, 3, init=False, timeout=60)
    assert results[0][0] == "ok" and results[0][1] == ("worker0", 0)
    losers = [r for r in results[1:] if r[0] == "error"]
    winners = [r for r in results[1:] if r[0] == "ok"]
    assert len(losers) == 1 and len(winners) == 1, results
    _, name, msg = losers[0]
    assert name == "RendezvousError"
    assert "rank 1" in msg
    assert "taken" in msg
    winner_name, winner_rank = winners[0][1]
    assert winner_rank == 1
    assert results[0][2] == winner_name == winners[0][2]  # everyone agrees who rank 1 is


def test_two_rank_zero_processes_on_one_tcp_port():
    # With tcp:// rank 0 hosts the store: a second rank 0 cannot bind the port.
    init_method = f"tcp://127.0.0.1:{_free_port()}"

    host, port = init_method[len("tcp://"):].split(":")

    def body(index, _world_size, _unused):
        try:
            rpc.init_rpc(f"zero{index}", rank=0 if index < 2 else 1, world_size=2,
                         rpc_backend_options=_opts(init_method, rpc_timeout=20))
        except Exception as exc:
            _keep.append(exc)
            # tell the rank 0 that did start the store that this attempt is over
            client = dist.TCPStore(host, int(port), 2, False, timedelta(seconds=20),
                                   wait_for_workers=False)
            dist.PrefixStore(PREFIX, client).set("test/second_rank0_failed", "1")
            return ("error",) + _error(exc)
        if rpc.get_worker_info().id == 0:
            # the store lives in this process: keep it until the other rank 0 has failed
            _get_current_rpc_agent().store.wait(["test/second_rank0_failed"],
                                                timedelta(seconds=20))
        rpc.shutdown()
        return ("ok", "", "")

    results = run_world(body, 3, init=False, timeout=60)
    assert results[2][0] == "ok"
    errors = [r for r in results[:2] if r[0] == "error"]
    assert len(errors) == 1, results
    assert errors[0][1] == "RendezvousError"
    assert "rank 0" in errors[0][2]


# ------------------------------------------------------------------ missing peers


@pytest.mark.parametrize("timeout_option", ["init_timeout", "rpc_timeout"])
def test_missing_peer_is_named_within_the_init_timeout(timeout_option):
    timeout = 2.0

    def body(rank, _world_size, init_method):
        opts = _opts(init_method, **{timeout_option: timeout})
        t0 = time.monotonic()
        try:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
        except Exception as exc:
            return _error(exc) + (time.monotonic() - t0,)
        rpc.shutdown()
        return ("no error", "", time.monotonic() - t0)

    t0 = time.monotonic()
    results = run_world(body, 2, init=False, timeout=30)  # rank 2 never starts
    total = time.monotonic() - t0
    for name, msg, elapsed in results:
        assert name == "RendezvousError"
        assert "rank [2]" in msg
        assert "world_size=3" in msg
        assert timeout - 0.5 <= elapsed < timeout + 3
    assert total < timeout + 8


def test_unreachable_rank_zero_on_tcp_is_reported_within_the_init_timeout():
    # Nobody ever listens on this port.  Four processes (ranks 1..4 of a job of five)
    # each try to reach rank 0's store; every one must give up within init_timeout plus
    # a small margin.  Several processes at once make an overshoot show up reliably.
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    timeout = 2.0

    def body(index, _world_size, _unused):
        t0 = time.monotonic()
        try:
            rpc.init_rpc(f"worker{index + 1}", rank=index + 1, world_size=5,
                         rpc_backend_options=_opts(init_method, init_timeout=timeout))
        except Exception as exc:
            return _error(exc) + (time.monotonic() - t0,)
        rpc.shutdown()
        return ("no error", "", time.monotonic() - t0)

    results = run_world(body, 4, init=False, timeout=60)
    for name, msg, _ in results:
        assert name == "RendezvousError"
        assert "rank 0" in msg and "could not reach" in msg
    elapsed = [round(e, 2) for _, _, e in results]
    assert max(elapsed) < timeout + 1.5, f"init_timeout={timeout}s, init_rpc took {elapsed}"


# ------------------------------------------------------------------ state


def test_init_rpc_twice_in_one_process_is_rpc_state_error():
    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=_opts(init_method))
        errors = []
        for name in (f"worker{rank}", f"other{rank}"):
            try:
                rpc.init_rpc(name, rank=rank, world_size=world_size,
                             rpc_backend_options=_opts(init_method))
            except Exception as exc:
                errors.append(_error(exc) + (isinstance(exc, RuntimeError),))
        # the first agent is untouched and still serves
        me = rpc.get_worker_info()
        value = rpc.rpc_sync(f"worker{1 - rank}", _peer_add, args=(rank, 1))
        rpc.shutdown()
        return errors, (me.name, me.id), value

    results = run_world(body, 2, init=False, timeout=60)
    for rank, (errors, me, value) in enumerate(results):
        assert len(errors) == 2
        for name, msg, is_runtime in errors:
            assert name == "RpcStateError" and is_runtime
            assert "already initialized" in msg
        assert me == (f"worker{rank}", rank)
        assert value == rank + 1


def test_init_rpc_again_after_shutdown_joins_a_new_job():
    first, second = new_init_method(), new_init_method()

    def body(rank, world_size, _unused):
        out = []
        for init_method, prefix in ((first, "a"), (second, "b")):
            rpc.init_rpc(f"{prefix}{rank}", rank=rank, world_size=world_size,
                         rpc_backend_options=_opts(init_method))
            out.append(rpc.rpc_sync(f"{prefix}{1 - rank}", _whoami))
            rpc.shutdown()
        return out

    assert run_world(body, 2, init=False, timeout=60) == [
        [("a1", 1), ("b1", 1)], [("a0", 0), ("b0", 0)]]


# ------------------------------------------------------------------ options, availability


def test_is_available():
    assert rpc.is_available() is True


def test_options_defaults_match_torch():
    opts = rpc.TensorPipeRpcBackendOptions()
    assert opts.num_worker_threads == 16
    assert opts.rpc_timeout == 60
    assert opts.init_method == "env://"
    assert rpc.DEFAULT_NUM_WORKER_THREADS == 16
    assert rpc.DEFAULT_RPC_TIMEOUT_SEC == 60
    assert rpc.DEFAULT_INIT_METHOD == "env://"
    assert rpc.TensorPipeRpcBackendOptions is rpc.TorchwireRpcBackendOptions
    assert isinstance(opts, rpc.TorchwireRpcBackendOptions)


def test_options_validation():
    with pytest.raises(ValueError):
        rpc.TensorPipeRpcBackendOptions(num_worker_threads=0)
    with pytest.raises(ValueError):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 1, 2: 1}})
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=5,
                                           init_method="tcp://127.0.0.1:1234")
    assert (opts.num_worker_threads, opts.rpc_timeout, opts.init_method) == (
        4, 5.0, "tcp://127.0.0.1:1234")


def test_options_of_another_backend_are_refused_with_torchs_errors():
    class FooBackendOptions(rpc.RpcBackendOptions):
        pass

    foo = FooBackendOptions(init_method="tcp://127.0.0.1:1")
    assert foo.rpc_timeout == 60 and issubclass(rpc.TensorPipeRpcBackendOptions,
                                                rpc.RpcBackendOptions)
    with pytest.raises(TypeError, match="Could not infer backend for options"):
        rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=foo)
    with pytest.raises(TypeError, match="`rpc_backend_options` must be a "
                                        "`TensorPipeRpcBackendOptions`"):
        rpc.init_rpc("worker0", rank=0, world_size=1, backend=rpc.BackendType.TENSORPIPE,
                     rpc_backend_options=foo)
    from datetime import timedelta
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=timedelta())


def test_backend_type_tensorpipe_names_the_torchwire_backend():
    assert rpc.BackendType.TENSORPIPE is rpc.BackendType.TORCHWIRE
    assert rpc.BackendType["TENSORPIPE"] is rpc.BackendType.TENSORPIPE


def test_torch_options_object_is_adopted():
    # Code that still builds torch's own options object keeps working.
    torch_rpc = pytest.importorskip("torch.distributed.rpc")
    if not torch_rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc")

    def body(rank, world_size, init_method):
        opts = torch_rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                                     num_worker_threads=4, rpc_timeout=20)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=opts)
        value = rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(2), rank))
        timeout = rpc.get_rpc_timeout()
        rpc.shutdown()
        return value.tolist(), timeout

    assert run_world(body, 2, init=False, timeout=60) == [([1.0, 1.0], 20.0), ([2.0, 2.0], 20.0)]


def _listening(port: int, table: str) -> bool:
    """Does ``/proc/net/<table>`` list a socket listening on ``port``?"""
    with open(f"/proc/net/{table}") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A" for r in rows)


def test_the_store_serves_over_ipv4_and_shares_a_port_served_in_process():
    """rank 0's store listens on IPv4: a dual-stack socket sees loopback peers as
    ::ffff:127.0.0.1, whose reverse lookup (the store names every client) goes to DNS;
    a resolver dropping one of a burst stalled a 32-worker join for 5 s.  A store
    already serving the port in this process is shared, as torch's multi_tenant does."""
    from torchwire._bootstrap.rendezvous import open_store

    def body(index, _world_size, _unused):
        port = _free_port()
        if index == 1:  # the user's own store on the port first (a gloo group, say)
            own = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10),
                                wait_for_workers=False, multi_tenant=True)
            own.set("torchwire/mine", "1")
        store = open_store(f"tcp://127.0.0.1:{port}", 0, 1, 10)[0]
        store.set("key", "value")
        shared = index == 1 and store.get("mine") == b"1"
        return _listening(port, "tcp"), _listening(port, "tcp6"), shared

    (v4, v6, _), (_, _, shared) = run_world(body, 2, init=False, timeout=60)
    assert v4 and not v6
    assert shared
