"""A worker killed with SIGKILL and started again rejoins the running job under its name.

Real forked processes and real stores; this process sends the signals and starts
the new incarnation, so the others never stop running.  Static groups
(``world_size`` given) and dynamic ones alike: calls and RRefs pending on the dead
incarnation fail naming it, calls made after the rejoin reach the new process, and
a claim on a live worker's rank is refused.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

import torchwire
import torchwire.autograd as dist_autograd
from torchwire.optim import DistributedOptimizer
import torchwire.rpc as rpc
from _cluster import child_result, new_init_method, options, start_child, wait_until
from test_failures import _reap

_ctx = mp.get_context("fork")
WAIT = 30  # seconds any child waits for an event before failing

pytestmark = pytest.mark.timeout(120)


def nap(seconds):
    time.sleep(seconds)
    return seconds


def add(a, b):
    return a + b


def pid():
    return os.getpid()


_held: dict = {}


def keep(name, rref):
    _held[name] = rref
    return True


def make_param():
    return torch.nn.Parameter(torch.ones(2))


def scaled(param_rref, x):
    return param_rref.local_value() * x


def read(param_rref):
    return param_rref.local_value().detach().clone()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_pid_of(name: str, old: int) -> int:
    """Call ``name`` until a process other than ``old`` answers (it rejoined)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            now = rpc.rpc_sync(name, pid, timeout=5)
            if now != old:
                return now
        except torchwire.WorkerUnavailableError:
            pass  # the old incarnation is gone and the new one not here yet
        assert time.monotonic() < deadline, f"{name} did not rejoin within {WAIT}s"
        time.sleep(0.05)


def _init(name, rank, world_size, init_method, **kw):
    kw.setdefault("rpc_timeout", 20)
    rpc.init_rpc(name, rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method, **kw))


def _survivor_checks(old_pid, killed, ready):
    """Rank 0 of either kind of group: what it held on worker2 fails, then it works."""
    owned = rpc.remote("worker2", torch.ones, args=(2,))  # an RRef owned by worker2
    assert owned.to_here().tolist() == [1.0, 1.0]
    mine = rpc.RRef(torch.zeros(3))
    assert rpc.rpc_sync("worker2", keep, args=("held", mine))  # worker2 holds a fork
    assert int(rpc.api._rref_context_get_debug_info()["num_forks"]) == 1
    assert rpc.rpc_sync("worker2", pid) == old_pid
    stale_opt = DistributedOptimizer(torch.optim.SGD, [rpc.remote("worker2", make_param)],
                                     lr=0.5)
    with dist_autograd.context() as cid:
        x = torch.ones(2, requires_grad=True)
        y = rpc.rpc_sync("worker2", torch.mul, args=(x, 2))
        pending = [rpc.rpc_async("worker2", nap, args=(30,)) for _ in range(5)]
        ready.wait(WAIT)
        assert killed.wait(WAIT)
        for f in pending:
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
                f.wait()
            assert info.value.worker_name == "worker2"
        new_pid = _new_pid_of("worker2", old_pid)
        # what lived in the dead incarnation is gone, and says so
        with pytest.raises(torchwire.WorkerUnavailableError, match="restarted") as info:
            owned.to_here()
        assert info.value.worker_name == "worker2" and "worker2 (rank 2)" in str(info.value)
        with pytest.raises(torchwire.WorkerUnavailableError, match="restarted"):
            owned.rpc_sync().sum()
        with pytest.raises(torchwire.WorkerUnavailableError, match="restarted"):
            rpc.rpc_sync("worker1", keep, args=("passed on", owned))
        # the fork the dead incarnation held of ours is released: no leak
        assert wait_until(lambda: int(rpc.api._rref_context_get_debug_info()["num_forks"]) == 0)
        with pytest.raises(torchwire.WorkerUnavailableError, match="worker2") as info:
            dist_autograd.backward(cid, [y.sum()])
        assert info.value.worker_name == "worker2"
    with dist_autograd.context() as cid:
        with pytest.raises(torchwire.WorkerUnavailableError, match="restarted") as info:
            stale_opt.step(cid)
        assert "build a new DistributedOptimizer" in str(info.value)
    # the new incarnation serves RRefs, distributed autograd and optimizers as any worker
    param = rpc.remote("worker2", make_param)
    opt = DistributedOptimizer(torch.optim.SGD, [param], lr=0.5)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker2", scaled, args=(param, torch.full((2,), 2.0)))
        dist_autograd.backward(cid, [y.sum()])
        opt.step(cid)
    assert rpc.rpc_sync("worker2", read, args=(param,)).tolist() == [0.0, 0.0]
    fresh = rpc.remote("worker2", torch.ones, args=(3,))
    assert fresh.to_here().tolist() == [1.0] * 3
    with dist_autograd.context() as cid:
        x = torch.ones(2, requires_grad=True)
        y = rpc.rpc_sync("worker2", torch.mul, args=(x, 3))
        dist_autograd.backward(cid, [y.sum()])
        assert dist_autograd.get_gradients(cid)[x].tolist() == [3.0, 3.0]
    assert rpc.rpc_sync("worker1", add, args=(2, 3)) == 5
    del owned, fresh, mine, stale_opt, opt, param
    # contexts the dead incarnation opened here are dropped (it never releases them)
    assert wait_until(lambda: dist_autograd._debug_info()["num_autograd_contexts"] == 0), \
        dist_autograd._debug_info()
    return new_pid


def _open_context_and_wait(victim_ready):
    """The victim's first incarnation: a context of its own reaches worker0, then it
    waits to be killed (the context is never released)."""
    ctx = dist_autograd.context()
    cid = ctx.__enter__()
    x = torch.ones(2, requires_grad=True)
    rpc.rpc_sync("worker0", torch.mul, args=(x, 2))
    assert cid >> 48 == 2
    victim_ready.set()
    time.sleep(60)


def test_static_group_takes_a_killed_worker_back_and_refuses_a_live_ranks_claim():
    init_method = new_init_method()
    ready = _ctx.Barrier(3)  # ranks 0 and 1 set up, plus this process
    killed = _ctx.Event()
    victim_ready = _ctx.Event()
    claimed = _ctx.Event()  # the impostor is done: worker1 (alive until then) may leave
    old_pid = _ctx.Value("i", 0)

    def body(rank, world_size, init_method):
        _init(f"worker{rank}", rank, world_size, init_method)
        if rank == 2:  # the victim's first incarnation
            _open_context_and_wait(victim_ready)
        if rank == 1:
            pending = rpc.rpc_async("worker2", nap, args=(30,))
            ready.wait(WAIT)
            assert killed.wait(WAIT)
            with pytest.raises(torchwire.WorkerUnavailableError, match="worker2"):
                pending.wait()
            new = _new_pid_of("worker2", old_pid.value)
            assert claimed.wait(WAIT)
            rpc.shutdown()
            return new
        old_pid.value = rpc.rpc_sync("worker2", pid)
        new = _survivor_checks(old_pid.value, killed, ready)
        stats = rpc.api._rref_context_get_debug_info()
        rpc.shutdown()
        return new, int(stats["num_forks"])

    def reborn(rank, world_size, init_method):
        _init("worker2", 2, 3, init_method)
        assert rpc.rpc_sync("worker0", add, args=(1, 1)) == 2
        rpc.shutdown()
        return os.getpid()

    def impostor(rank, world_size, init_method):
        with pytest.raises(torchwire.RendezvousError) as live:
            _init("worker1", 1, 3, init_method, init_timeout=10)
        with pytest.raises(torchwire.RendezvousError) as renamed:
            _init("someone", 0, 3, init_method, init_timeout=10)
        return str(live.value), str(renamed.value)

    procs = [start_child(body, r, 3, init_method) for r in range(3)]
    try:
        ready.wait(60)
        assert victim_ready.wait(60)
        os.kill(procs[2][0].pid, signal.SIGKILL)
        procs[2][0].join(5)
        killed.set()
        procs.append(start_child(reborn, 2, 3, init_method))
        try:
            live, renamed = child_result(start_child(impostor, 1, 3, init_method))
        finally:
            claimed.set()
        new0, forks = child_result(procs[0])
        new1 = child_result(procs[1])
        assert child_result(procs[3]) == new0 == new1
    finally:
        _reap(procs)
    assert new0 != old_pid.value and forks == 0
    assert "rank 1 is already taken by worker 'worker1'" in live and "alive" in live
    assert "rank 0 is already taken by worker 'worker0'" in renamed


def test_dynamic_group_takes_a_killed_member_back_under_its_name():
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ready = _ctx.Barrier(2)  # rank 0 set up, plus this process
    joined = _ctx.Barrier(4)  # every member joined, plus this process
    killed, parked = _ctx.Event(), _ctx.Event()
    done = _ctx.Barrier(3)  # ranks 0, 1 and the new worker2: checks made, all may leave
    old_pid = _ctx.Value("i", 0)

    def body(rank, world_size, init_method):
        rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=rpc.
                     TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=20))
        joined.wait(WAIT)
        if rank == 2:
            parked.set()  # out of the barrier: killed inside it, it would hold its lock
            time.sleep(60)
        if rank == 1:
            assert killed.wait(WAIT)
            new = _new_pid_of("worker2", old_pid.value)
            done.wait(WAIT)
            rpc.shutdown()
            return new
        old_pid.value = rpc.rpc_sync("worker2", pid)
        new = _survivor_checks(old_pid.value, killed, ready)
        done.wait(WAIT)
        rpc.shutdown()
        return new

    def reborn(rank, world_size, init_method):
        rpc.init_rpc("worker2", rank=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, rpc_timeout=20))
        names = sorted(i.name for i in rpc._get_current_rpc_agent().get_worker_infos())
        done.wait(WAIT)
        rpc.shutdown()
        return names

    procs = [start_child(body, r, None, init_method) for r in range(3)]
    try:
        joined.wait(60)
        ready.wait(60)
        assert parked.wait(60)
        os.kill(procs[2][0].pid, signal.SIGKILL)
        procs[2][0].join(5)
        killed.set()
        procs.append(start_child(reborn, 2, None, init_method))
        new0 = child_result(procs[0])
        assert child_result(procs[1]) == new0 != old_pid.value
        assert child_result(procs[3]) == ["worker0", "worker1", "worker2"]
    finally:
        _reap(procs)


def test_a_restarted_rank_0_that_hosted_the_store_fails_with_a_clear_error():
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    up = _ctx.Event()  # rank 0 dies once rank 1 is up: its init still reads rank 0's store

    def body(rank, world_size, init_method):
        from _cluster import die
        _init(f"worker{rank}", rank, world_size, init_method)
        if rank == 0:
            assert up.wait(60)
            die("died", signal.SIGKILL)
        up.set()
        assert wait_until(lambda: not _reachable(0), 10)
        return "up"

    def reborn(rank, world_size, init_method):
        with pytest.raises(torchwire.RendezvousError) as info:
            _init("worker0", 0, 2, init_method, init_timeout=2)
        return str(info.value)

    procs = [start_child(body, r, 2, init_method) for r in range(2)]
    try:
        assert child_result(procs[0]) == "died"
        assert child_result(procs[1]) == "up"
        message = child_result(start_child(reborn, 0, 2, init_method))
    finally:
        _reap(procs)
    assert "rendezvous store lived in its process and died with it" in message


def _reachable(rank):
    from torchwire._wire.listener import listener_alive
    record = rpc.api._get_current_rpc_agent().names.member(rank).record
    return listener_alive(record.tcp, record.unix)


def test_a_dial_to_the_dead_process_failing_after_the_rejoin_marks_nothing():
    """worker1 is killed and started again while worker0 dials the dead process: that
    dial fails (its listener refused) only once the new process is known (a fault
    hook holds it until then).  The failure is the old process's: worker0 reaches the
    new one at its next call instead of taking the rank for dead for good."""
    init_method = new_init_method()
    hooked = _ctx.Event()
    killed = _ctx.Event()
    done = _ctx.Event()

    def body(rank, world_size, init_method):
        _init(f"worker{rank}", rank, world_size, init_method)
        if rank == 1:  # the first incarnation: killed while it waits
            time.sleep(2 * WAIT)
            return None
        from torchwire._base.errors import ConnectError
        agent = rpc.api._get_current_rpc_agent()
        old_pid = rpc.rpc_sync("worker1", pid)
        stale = agent.names.member(1)
        real = agent.links._connect
        held: list = []

        def connect(member, *args, **kwargs):  # the fault hook
            if member is not stale:
                return real(member, *args, **kwargs)
            held.append(wait_until(lambda: agent.names.member(1) is not stale, WAIT))
            raise torchwire.WorkerUnavailableError(
                "cannot connect to worker1") from ConnectError("refused", refused=True)

        agent.links._connect = connect
        hooked.set()
        assert killed.wait(WAIT)
        new_pid = _new_pid_of("worker1", old_pid)
        done.set()
        rpc.shutdown()
        return new_pid, held

    def reborn(rank, world_size, init_method):
        _init("worker1", 1, 2, init_method)
        assert rpc.rpc_sync("worker0", add, args=(1, 1)) == 2
        assert done.wait(WAIT)
        rpc.shutdown()
        return os.getpid()

    procs = [start_child(body, r, 2, init_method) for r in range(2)]
    try:
        assert hooked.wait(60)
        os.kill(procs[1][0].pid, signal.SIGKILL)
        procs[1][0].join(5)
        killed.set()
        procs.append(start_child(reborn, 1, 2, init_method))
        new_pid, held = child_result(procs[0])
        assert child_result(procs[2]) == new_pid
    finally:
        _reap(procs)
    # the dial to the dead process was held until the new one was known, then failed
    assert held and all(held), held
