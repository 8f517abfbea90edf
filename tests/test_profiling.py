"""RPC calls in torch's profilers: the caller's event named as torch names it, the
callee's events in the caller's legacy profile, ranges under torch.profiler."""

from __future__ import annotations

import warnings

import torch

from _cluster import run_world


def _ops():
    with torch.autograd.profiler.record_function("##forward##"):
        return torch.add(torch.ones(2), 1).relu()


def _nested(to):
    import torchwire.rpc as rpc
    return rpc.rpc_sync(to, torch.mul, args=(torch.ones(2), 3))


def _legacy(rank, world_size):
    import torchwire.rpc as rpc
    from torch.autograd.profiler_legacy import profile
    if rank != 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile() as p:
            rpc.rpc_sync("worker1", _ops)
            rpc.rpc_async("worker1", _nested, args=("worker2",)).wait()
            rref = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
            rref._get_profiling_future().wait()
    events = [(e.name, e.node_id, e.is_remote, e.time_range.start, e.time_range.end)
              for e in p.function_events]
    averages = {a.key for a in p.key_averages()}
    return events, averages


def test_legacy_profile_has_the_call_and_the_callees_events():
    events, averages = run_world(_legacy, 3)[0]
    by_name = {name: (node, remote, start, end) for name, node, remote, start, end in events}
    sync = "rpc_sync#_ops(worker0 -> worker1)"
    assert by_name[sync][:2] == (0, False)  # the caller's event: node_id = its rank
    inner = f"{sync}#remote_op: ##forward##"
    assert by_name[inner][:2] == (1, True)  # the callee's, under its rank
    assert by_name[f"{sync}#remote_op: aten::add"][:2] == (1, True)
    # the callee's events lie within the call's span (one host: one clock)
    assert by_name[sync][2] <= by_name[inner][2] <= by_name[inner][3] <= by_name[sync][3]
    outer = "rpc_async#_nested(worker0 -> worker1)"
    nested = f"{outer}#remote_op: rpc_sync#aten::mul(worker1 -> worker2)"
    assert by_name[nested][:2] == (1, True)
    assert by_name[f"{nested}#remote_op: aten::mul"][:2] == (2, True)
    remote = "rpc_remote#aten::add(worker0 -> worker2)"
    assert by_name[remote][:2] == (0, False)
    assert by_name[f"{remote}#remote_op: aten::add"][:2] == (2, True)
    assert sync in averages and inner in averages


def _kineto(rank, world_size):
    import torchwire.rpc as rpc
    if rank != 0:
        return None
    with torch.profiler.profile() as p:
        with torch.profiler.record_function("step"):
            rpc.rpc_sync("worker1", _ops)
            rpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1)).wait()
    events = [(e.name, e.node_id, e.is_remote, e.time_range.start, e.time_range.end)
              for e in p.events()]
    return events, {a.key for a in p.key_averages()}


def test_torch_profiler_shows_the_calls_and_the_callees_events():
    events, averages = run_world(_kineto, 2)[0]
    by_name = {name: (node, remote, start, end) for name, node, remote, start, end in events}
    sync = "rpc_sync#_ops(worker0 -> worker1)"
    assert sync in by_name and "rpc_async#aten::add(worker0 -> worker1)" in by_name
    inner = f"{sync}#remote_op: ##forward##"
    assert by_name[inner][:2] == (1, True)
    assert by_name[sync][2] <= by_name[inner][2] <= by_name[inner][3] <= by_name[sync][3]
    assert "rpc_async#aten::add(worker0 -> worker1)#remote_op: aten::add" in averages


def _off(rank, world_size):
    import torchwire.rpc as rpc
    from torchwire._agent import profiling
    if rank != 0:
        return None
    # no profiler: the reply is the function's value as is, no events gathered
    value = rpc.rpc_sync("worker1", _ops)
    gathered = getattr(profiling._local, "gathered", None)
    return value.tolist(), gathered is None or not gathered.events


def test_no_profiler_no_events():
    value, nothing = run_world(_off, 2)[0]
    assert value == [2.0, 2.0] and nothing


def _train(rank, world_size):
    import torchwire.autograd as dist_autograd
    import torchwire.rpc as rpc
    from torch.autograd.profiler_legacy import profile
    from torchwire.optim import DistributedOptimizer
    if rank != 0:
        return None
    w = rpc.remote("worker1", torch.ones, args=(3,), kwargs={"requires_grad": True})
    local = torch.ones(3, requires_grad=True)
    opt = DistributedOptimizer(torch.optim.SGD, [w, rpc.RRef(local)], lr=0.1)
    with torch.profiler.profile() as p:
        with dist_autograd.context() as ctx:
            x = rpc.rpc_sync("worker1", torch.mul, args=(local, 2))
            dist_autograd.backward(ctx, [x.sum()])
            opt.step(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with dist_autograd.context() as ctx, profile() as legacy:
            x = rpc.rpc_sync("worker1", torch.mul, args=(local, 2))
            dist_autograd.backward(ctx, [x.sum()])
            opt.step(ctx)
    return [e.name for e in p.events()], [e.name for e in legacy.function_events]


def test_backward_and_optimizer_steps_are_ranges():
    names, legacy = run_world(_train, 2)[0]
    for name in ("torch::distributed::autograd::backward", "torchwire::autograd::local_pass",
                 "torchwire::autograd::send_gradients", "torchwire::autograd::wait",
                 "torchwire::optim::DistributedOptimizer.step", "torchwire::optim::local_step",
                 "torchwire::optim::wait"):
        assert name in names, name
    # the owner's step, as the callee recorded it
    assert any(n.startswith("rpc_sync#_local_step(worker0 -> worker1)#remote_op: ")
               and n.endswith("torchwire::optim::local_step") for n in legacy)


def _mm(x):
    return torch.mm(x, x).sum()


def _job(rank, world_size, path):
    import torchwire.rpc as rpc
    from torchwire.profiler import JobProfile
    if rank == 0:
        with JobProfile(path) as job:
            for _ in range(3):
                rpc.rpc_sync("worker1", _mm, args=(torch.ones(20, 20),))
                rpc.rpc_async("worker2", _mm, args=(torch.ones(20, 20),)).wait()
        result = job.offsets_us
    else:
        result = None
    rpc.api._barrier([f"worker{r}" for r in range(world_size)])
    return result


def test_job_profile_writes_one_stitched_trace(tmp_path):
    import gzip
    import json
    path = str(tmp_path / "job.json.gz")
    offsets = run_world(lambda r, w: _job(r, w, path), 3)[0]
    assert set(offsets) == {"worker0", "worker1", "worker2"}
    assert all(abs(o) < 50_000 for o in offsets.values())  # one host: one clock, about
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert rows == {0: "worker0", 1: "worker1", 2: "worker2"}
    calls = [e for e in events if e["ph"] == "X" and e["name"].startswith("rpc_sync#_mm(")]
    runs = [e for e in events if e["ph"] == "X"
            and e["name"] == "rpc_serve#_mm(worker0 -> worker1)"]
    assert len(calls) == 3 and len(runs) == 3 and {e["pid"] for e in runs} == {1}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = [e for e in events if e["ph"] == "f"]
    assert len(ends) == 6 and all(starts[e["id"]]["pid"] == 0 for e in ends)
    for call, run in zip(sorted(calls, key=lambda e: e["ts"]), sorted(runs, key=lambda e: e["ts"])):
        # aligned clocks: the run lies inside its call
        assert call["ts"] <= run["ts"] and run["ts"] + run["dur"] <= call["ts"] + call["dur"]
    for call in calls:  # 20x20 float32 out, a 0-dim tensor back, plus the messages
        assert call["args"]["bytes_sent"] > 1600 and call["args"]["bytes_received"] >= 4
    assert not any("torchwire.profiler.control" in e.get("name", "") for e in events)
    assert any(e["ph"] == "X" and e["name"] == "aten::mm" and e["pid"] == 2 for e in events)


def _recv_node(rank, world_size):
    import torchwire.autograd as dist_autograd
    import torchwire.rpc as rpc
    if rank != 0:
        return None
    with dist_autograd.context():
        t = torch.ones(2, requires_grad=True)
        y = rpc.rpc_sync("worker1", torch.mul, args=(t, 2))
        return y.grad_fn.name()


def test_a_received_tensor_has_torchs_node_name():
    assert run_world(_recv_node, 2)[0] == "RecvRpcBackward"
