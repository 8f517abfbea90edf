"""Remote references: remote(), RRef API, proxies, the reference-counting protocol."""

from __future__ import annotations

import gc
import pickle
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world, wait_until


# ---------------------------------------------------------------- remote functions

def add(a, b):
    return a + b


def raise_value_error(msg):
    raise ValueError(msg)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, by=1):
        self.value += by
        return self.value

    def get(self):
        return self.value

    def fail(self):
        raise KeyError("counter says no")

    @rpc.functions.async_execution
    def add_later(self, by):
        fut = torch.futures.Future()

        def finish():
            time.sleep(0.05)
            self.value += by
            fut.set_result(self.value)
        threading.Thread(target=finish).start()
        return fut

    @staticmethod
    @rpc.functions.async_execution
    def static_async(x):
        fut = torch.futures.Future()
        fut.set_result(x * 2)
        return fut


def debug_info():
    gc.collect()  # RRefs caught in reference cycles (tracebacks kept by pytest.raises)
    return {k: int(v) for k, v in rpc._rref_context_get_debug_info().items()}


def wait_settled(ranks=(0, 1, 2, 3), timeout=20.0):
    """Poll every worker until no value is owned, no fork or child is pending."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [rpc.rpc_sync(f"worker{r}", debug_info) for r in ranks]
        if all(i["num_live_values"] == 0 and i["num_forks"] == 0
               and i["num_pending_children"] == 0 and i["num_user_rrefs"] == 0 for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"RRef state did not settle: {infos}")
        time.sleep(0.02)


def settled(world):
    """Run wait_settled from worker0 (every worker must be idle of RRefs)."""
    return world.run(0, wait_settled)


# ---------------------------------------------------------------- basics

def _remote_basics():
    rref = rpc.remote("worker1", add, args=(torch.ones(2), 1))
    assert isinstance(rref, rpc.RRef)
    assert not rref.is_owner()
    assert rref.owner() == rpc.get_worker_info("worker1")
    assert rref.owner_name() == "worker1"
    assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
    assert rref.confirmed_by_owner()
    assert repr(rref).startswith("UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=")
    kw = rpc.remote(1, add, kwargs={"a": 2, "b": 3})  # a rank works as destination
    assert kw.to_here() == 5
    return True


def test_remote_returns_user_rref_to_the_callee_value(world):
    assert world.run(0, _remote_basics)
    settled(world)


def _owner_rref():
    rref = rpc.RRef([1, 2, 3])
    assert rref.is_owner() and rref.confirmed_by_owner()
    assert rref.owner_name() == rpc.get_worker_info().name
    assert rref.local_value() == [1, 2, 3]
    assert rref.to_here() == [1, 2, 3]
    assert repr(rref).startswith("OwnerRRef(GloballyUniqueId(created_on=")
    assert rref._get_type() is list
    me = rpc.remote(rpc.get_worker_info(), add, args=(1, 2))  # remote() to oneself
    assert me.is_owner() and me.local_value() == 3 and me.to_here() == 3
    return True


def test_owner_rref_local_and_remote_to_self(world):
    assert world.run(2, _owner_rref)
    settled(world)


def _local_value_on_user():
    rref = rpc.remote("worker1", add, args=(1, 1))
    with pytest.raises(RuntimeError, match="can't call localValue\\(\\) on user "
                       "WorkerInfo\\(id=0, name=worker0\\). Call it on owner "
                       "WorkerInfo\\(id=1, name=worker1\\)"):
        rref.local_value()
    return rref.to_here()


def test_local_value_on_a_user_is_a_clear_error(world):
    assert world.run(0, _local_value_on_user) == 2


def _plain_pickle():
    rref = rpc.RRef(1)
    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
        pickle.dumps(rref)
    return True


def test_rref_cannot_be_pickled_outside_rpc(world):
    assert world.run(1, _plain_pickle)


# ---------------------------------------------------------------- proxies

def _proxies():
    rref = rpc.remote("worker1", Counter, args=(10,))
    assert rref.rpc_sync().increment() == 11
    assert rref.rpc_sync(timeout=5).increment(by=2) == 13
    fut = rref.rpc_async().increment(5)
    assert isinstance(fut, torch.futures.Future)
    assert fut.wait() == 18
    doubled = rref.remote().get()
    assert isinstance(doubled, rpc.RRef) and doubled.owner_name() == "worker1"
    assert doubled.to_here() == 18
    assert rref.rpc_sync().add_later(2) == 20  # async_execution method
    assert rref.rpc_async().static_async(21).wait() == 42
    assert rref._get_type() is Counter
    assert rref._get_type(blocking=False).wait() is Counter
    with pytest.raises(KeyError, match="counter says no"):
        rref.rpc_sync().fail()
    with pytest.raises(AttributeError):
        rref.rpc_sync().no_such_method()
    slow = rpc.remote("worker1", sleep_then, args=(1.5, Counter()))
    with pytest.raises(rpc.RpcTimeoutError, match="RPC ran for more than"):
        slow.rpc_sync(timeout=0.2).get()
    assert slow.rpc_sync().get() == 0
    return rref.to_here().value


def test_proxies_run_methods_on_the_owner(world):
    assert world.run(0, _proxies) == 20
    settled(world)


# ---------------------------------------------------------------- errors

def _remote_failure():
    rref = rpc.remote("worker2", raise_value_error, args=("bad input",))
    with pytest.raises(ValueError, match="bad input"):
        rref.to_here()
    with pytest.raises(ValueError, match="bad input"):
        rref._get_future().wait()
    with pytest.raises(ValueError, match="bad input"):
        rref.rpc_sync().anything()
    late = rpc.remote("worker2", raise_value_error, args=("later",))
    with pytest.raises(ValueError, match="later"):
        late.rpc_async().anything().wait()  # proxy before the creation reply
    return True


def test_failing_remote_raises_from_to_here_and_proxies(world):
    assert world.run(0, _remote_failure)
    settled(world)


def _timeouts():
    slow = rpc.remote("worker1", sleep_then, args=(1.0, 7))
    t0 = time.monotonic()
    with pytest.raises(rpc.RpcTimeoutError, match="RPC ran for more than set timeout"):
        slow.to_here(timeout=0.2)
    assert time.monotonic() - t0 < 0.9
    assert slow.to_here() == 7  # the value still arrives
    short = rpc.remote("worker1", sleep_then, args=(1.0, 8), timeout=0.2)
    with pytest.raises(rpc.RpcTimeoutError, match="RRef creation via rpc.remote\\(\\) timed out"):
        short._get_future().wait()
    with pytest.raises(rpc.RpcTimeoutError, match="RRef creation"):
        short.to_here()
    del slow, short
    # the slow creations finish on worker1 and leave nothing there
    assert wait_until(lambda: rpc.rpc_sync("worker1", debug_info)["num_live_values"] == 0, 10)
    return True


def test_to_here_and_remote_time_out_cleanly(world):
    assert world.run(0, _timeouts)
    settled(world)


# ---------------------------------------------------------------- passing RRefs around

def fetch_sum(ra, rb):
    """The seed's example: runs on a third worker, pulls both values from their owners."""
    return ra.to_here() + rb.to_here()


def _coordinator():
    before = rpc.stats()
    big = 256 * 1024  # 1 MiB of float32 on each source worker
    ra = rpc.remote("worker1", torch.ones, args=(big,))
    rb = rpc.remote("worker2", torch.full, args=((big,), 2.0))
    total = rpc.remote("worker3", fetch_sum, args=(ra, rb))
    assert total.rpc_sync().sum().item() == 3.0 * big  # only a scalar comes back here
    after = rpc.stats()
    moved = (after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"])
    return moved


def test_coordinator_wires_two_workers_into_a_third(world):
    moved = world.run(0, _coordinator)
    assert moved < 64 * 1024, f"the coordinator moved {moved} bytes: data went through it"
    settled(world)


def hold(store, key, rref):
    store[key] = rref
    return rref.is_owner()


_held: dict = {}


def keep(key, rref):
    _held[key] = rref
    # as torch: a function runs only once the forks in its arguments are confirmed
    return rref.is_owner(), rref.confirmed_by_owner()


def drop(key):
    _held.pop(key, None)
    return True


def pass_on(rref, to, depth):
    """Forward ``rref`` down a chain of workers; the last one fetches the value."""
    if depth == 0:
        return rref.to_here(), rref.is_owner(), rpc.get_worker_info().name
    return rpc.rpc_sync(to[0], pass_on, args=(rref, to[1:], depth - 1))


def give_back(rref):
    return rref


def owner_sees_own(rref):
    back = rpc.rpc_sync("worker3", give_back, args=(rref,))  # a reply carrying our RRef
    return back.is_owner(), back.local_value()


def _chains():
    rref = rpc.remote("worker1", torch.arange, args=(5,))
    # A -> B -> C -> D: worker0 -> worker2 -> worker3 -> worker0 (a user again)
    value, is_owner, where = rpc.rpc_sync("worker2", pass_on,
                                          args=(rref, ["worker3", "worker0"], 2))
    assert torch.equal(value, torch.arange(5)) and not is_owner and where == "worker0"
    # back to the owner: it resolves to the owner's RRef
    value, is_owner, where = rpc.rpc_sync("worker2", pass_on, args=(rref, ["worker1"], 1))
    assert is_owner and where == "worker1" and torch.equal(value, torch.arange(5))
    # the owner gets its own RRef back inside a reply
    owner_rref = rpc.rpc_sync("worker1", make_owner_rref, args=(torch.ones(1),))
    assert not owner_rref.is_owner() and owner_rref.owner_name() == "worker1"
    is_owner, value = rpc.rpc_sync("worker1", owner_sees_own_rref, args=(owner_rref,))
    assert is_owner and torch.equal(value, torch.ones(1))
    is_owner, value = rpc.rpc_sync("worker1", owner_sees_own, args=(owner_rref,))
    assert is_owner and torch.equal(value, torch.ones(1))
    # nested in containers, in both directions
    nested = rpc.rpc_sync("worker2", nest, args=({"a": [rref, (rref,)]},))
    assert all(isinstance(r, rpc.RRef) and not r.is_owner() for r in
               (nested["a"][0], nested["a"][1][0], nested["b"]))
    assert torch.equal(nested["b"].to_here(), torch.arange(5))
    return True


def make_owner_rref(t):
    return rpc.RRef(t * 1)


def owner_sees_own_rref(rref):
    return rref.is_owner(), rref.local_value()


def nest(d):
    d["b"] = d["a"][1][0]
    return d


def test_rrefs_pass_through_chains_and_back_to_the_owner(world):
    assert world.run(0, _chains)
    settled(world)


def _fork_outlives_creator():
    rref = rpc.remote("worker1", torch.ones, args=(3,))
    assert rpc.rpc_sync("worker2", keep, args=("k", rref)) == (False, True)
    del rref  # the creator drops its fork; worker2's fork must keep the value alive
    assert wait_until(lambda: rpc.rpc_sync("worker1", debug_info)["num_forks"] == 1, 10)
    value = rpc.rpc_sync("worker2", fetch_held, args=("k",))
    info = rpc.rpc_sync("worker1", debug_info)
    assert info["num_owner_rrefs"] == 1 and info["num_forks"] == 1, info
    rpc.rpc_sync("worker2", drop, args=("k",))
    return value


def fetch_held(key):
    return _held[key].to_here()


def test_owner_keeps_the_value_while_any_fork_lives(world):
    assert torch.equal(world.run(0, _fork_outlives_creator), torch.ones(3))
    settled(world)


# ---------------------------------------------------------------- stress and leaks

def relay(rref, to):
    """Pass the fork on (async) and drop it: races forks against deletions.  The last
    hop fetches the value: it must still exist while this fork holds it."""
    if to is None:
        return rref.to_here()
    return rpc.rpc_async(to, relay, args=(rref, None)).wait()


def _race(n_threads, per_thread):
    errors = []

    def worker(tid):
        try:
            for i in range(per_thread):
                owner = f"worker{1 + (tid + i) % 3}"
                rref = rpc.remote(owner, torch.full, args=((2,), float(i)))
                target = f"worker{1 + (tid + i + 1) % 3}"
                futs = [rpc.rpc_async(target, relay, args=(rref, f"worker{1 + (i % 3)}")),
                        rpc.rpc_async(owner, relay, args=(rref, target))]
                del rref  # dropped while its forks are in flight
                for f in futs:
                    value = f.wait()
                    if not torch.equal(value, torch.full((2,), float(i))):
                        errors.append(f"thread {tid} item {i}: got {value}")
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_forks_racing_deletions_settle_to_zero(world):
    assert world.run(0, _race, 4, 50) == []
    settled(world)


def _leak_many(n):
    """n RRefs created on workers 1..3, passed around those 3 and dropped."""
    batch = []
    for i in range(n):
        owner = 1 + i % 3
        rref = rpc.remote(f"worker{owner}", add, args=(i, 1))
        nxt = f"worker{1 + (owner % 3)}"
        batch.append((i + 1, rpc.rpc_async(nxt, relay,
                                            args=(rref, f"worker{1 + ((owner + 1) % 3)}"))))
        del rref
        if len(batch) == 200 or i == n - 1:
            for expected, f in batch:
                assert f.wait() == expected
            batch = []
    return True


def test_ten_thousand_rrefs_leave_no_live_object(world):
    assert world.run(0, _leak_many, 10_000, timeout=240)
    infos = settled(world)
    assert all(i["num_owner_rrefs"] == 0 for i in infos)


# ---------------------------------------------------------------- shutdown and failures

def test_graceful_shutdown_settles_forks_and_reports_leaks_when_asked():
    def body(rank, world_size):
        import torchwire.rpc.api as api
        if rank == 0:
            rref = rpc.remote("worker1", torch.ones, args=(2,))
            rpc.rpc_async("worker2", keep, args=("s", rref))  # fork in flight at shutdown
            api._ignore_rref_leak = False
            held = rpc.remote("worker2", add, args=(1, 1))
            return held, rref
        return None, None

    # every user RRef is deleted by shutdown, so no leak is reported and it finishes
    def run(rank, world_size):
        held, rref = body(rank, world_size)
        return None if held is None else (held, rref)

    def outer(rank, world_size, init_method):
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        kept = run(rank, world_size)
        rpc.shutdown()
        if kept is not None:
            with pytest.raises(RuntimeError, match="Cannot call to_here\\(\\) on it after "
                                                   "deletion"):
                kept[0].to_here()
        return True

    assert run_world(outer, 3, init=False) == [True, True, True]


def test_shutdown_reports_a_leaked_rref_when_leak_check_is_on():
    def outer(rank, world_size, init_method):
        import unittest.mock

        import torchwire.rpc.api as api
        from _cluster import options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method))
        rref = rpc.remote(f"worker{(rank + 1) % world_size}", add, args=(1, 1))
        api._ignore_rref_leak = False
        # as torch's test: without the shutdown deletion, the owner still holds forks
        with unittest.mock.patch.object(api, "_delete_all_user_and_unforked_owner_rrefs"):
            with pytest.raises(RuntimeError, match="Leaking RRef"):
                rpc.shutdown()
        del rref
        return True

    assert run_world(outer, 2, init=False) == [True, True]


def test_rref_whose_owner_died_raises_naming_the_owner():
    def outer(rank, world_size, init_method):
        from _cluster import die, options
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=10))
        if rank == 1:
            rpc.rpc_sync("worker0", keep, args=("owner", rpc.RRef(torch.ones(1))))
            die("died")  # no shutdown: a crash, as far as worker0 can tell
        assert wait_until(lambda: "owner" in _held, 5)
        held = _held["owner"]
        assert held.owner_name() == "worker1"
        health = rpc.api._get_current_rpc_agent().health
        assert wait_until(lambda: health.is_down(1), 10)  # worker0 has seen it die
        t0 = time.monotonic()
        with pytest.raises(rpc.WorkerUnavailableError, match="worker1") as info:
            held.to_here()
        assert info.value.worker_name == "worker1"
        with pytest.raises(rpc.WorkerUnavailableError, match="worker1"):
            held.rpc_sync().sum()
        assert time.monotonic() - t0 < 5
        _held.clear()
        rpc.shutdown(graceful=False)
        return "survived"

    assert run_world(outer, 2, init=False, timeout=60) == ["survived", "died"]
