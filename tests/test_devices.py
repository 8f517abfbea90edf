"""Device maps (torch's TensorPipe rules): options, init-time checks, routing, CUDA data.

The checks and the routing are plain Python and run everywhere; moving CUDA
tensors needs a GPU and is skipped without one.
"""

from __future__ import annotations

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire._base import devices as _devices
from torchwire._base.worker_record import WorkerRecord

cuda = torch.device("cuda", 0)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_options_normalize_and_merge_device_maps():
    opts = rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {0: "cuda:1"}},
                                           devices=[0, "cuda:1"])
    assert opts.device_maps == {"worker1": {cuda: torch.device("cuda", 1)}}
    assert opts.devices == [cuda, torch.device("cuda", 1)]
    opts.set_device_map("worker1", {1: 0})
    opts.set_device_map("worker2", {torch.device("cuda:0"): "cuda:3"})
    assert opts.device_maps["worker1"] == {cuda: torch.device("cuda", 1),
                                           torch.device("cuda", 1): cuda}
    assert opts.device_maps["worker2"] == {cuda: torch.device("cuda", 3)}
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping, trying to map "
                                         "cuda:2 and cuda:0 to cuda:1"):
        opts.set_device_map("worker1", {2: 1})
    assert opts.device_maps["worker1"][cuda] == torch.device("cuda", 1)  # unchanged
    with pytest.raises(ValueError, match="expect a list of CUDA devices"):
        opts.set_devices(["cpu"])
    with pytest.raises(TypeError, match="device_maps must be a dict"):
        rpc.TensorPipeRpcBackendOptions(device_maps=[("worker1", {0: 0})])


def _records(maps0=None, devices0=(), count0=2, count1=1):
    return [WorkerRecord("a", 0, "h", ("127.0.0.1", 1), device_count=count0,
                         devices=tuple(devices0), device_maps=maps0 or {}),
            WorkerRecord("b", 1, "h", ("127.0.0.1", 2), device_count=count1)]


@pytest.mark.parametrize("records,message", [
    (_records({"c": {"cuda:0": "cuda:0"}}), "invalid target node names"),
    (_records({"b": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}), "duplicated target devices"),
    (_records({"b": {"cuda:5": "cuda:0"}}), "source devices with invalid indices"),
    (_records({"b": {"cuda:0": "cuda:1"}}), "target devices with invalid indices"),
    (_records({"b": {"cuda:1": "cuda:0"}}, devices0=["cuda:0"]), "unexpected source devices"),
    (_records(devices0=["cuda:0", "cuda:0"]), "duplicated devices"),
    (_records(devices0=["cuda:2"]), "devices with invalid indices"),
    (_records({"b": {"cuda:0": "cuda:0"}}, count0=0, count1=0),
     "source devices with invalid indices"),
])
def test_init_checks_every_workers_device_maps(records, message):
    with pytest.raises(ValueError, match=f"Node [ab] has {message}"):
        _devices.check_all(records)


def test_valid_maps_route_requests_and_replies_through_the_inverse():
    records = _records({"b": {"cuda:0": "cuda:0", "cuda:1": "cpu"}})
    _devices.check_all(records)
    a = _devices.Router("a", records)
    b = _devices.Router("b", records)
    assert a and b
    assert a.target(1, True, cuda) == cuda and a.target(1, True, torch.device("cuda", 1)) \
        == torch.device("cpu")
    assert a.target(1, True, torch.device("cuda", 2)) is None  # unmapped: refused
    # b replies to a through the inverse of a's map
    assert b.target(0, False, torch.device("cpu")) == torch.device("cuda", 1)
    assert b.target(0, True, cuda) is None  # b has no map of its own to a
    # a one-way message (a backward pass's gradients) goes by whichever map covers it
    assert b.target(0, None, torch.device("cpu")) == torch.device("cuda", 1)
    assert a.target(1, None, cuda) == cuda and a.target(1, None, torch.device("cuda", 2)) is None
    assert not _devices.Router("a", _records())


def test_a_map_naming_the_cpu_routes_cpu_tensors_and_plain_messages_stand_aside():
    from torchwire import _serialization as ser
    from torchwire._serialization.hooks import hooks
    routed = _devices.Router("a", _records({"b": {"cpu": "cuda:0"}}))
    assert routed.routes_cpu and routed.target(1, True, torch.device("cpu")) == cuda
    assert not _devices.Router("a", _records({"b": {"cuda:0": "cuda:0"}})).routes_cpu
    assert not _devices.Router("a", _records({"b": {"cpu": "cpu"}})).routes_cpu
    t = torch.ones(3)
    assert ser.plain_meta(t) is not None
    before = (hooks.device_router, hooks.cpu_routed, hooks.device_ipc)
    try:
        hooks.set_device_router(routed.target, cpu_routed=routed.routes_cpu)
        assert ser.plain_meta(t) is None  # pickled, so that the pickler routes it
        hooks.set_device_router(routed.target, cpu_routed=False)
        assert ser.plain_meta(t) is not None
    finally:
        hooks.set_device_router(before[0], cpu_routed=before[1], ipc=before[2])


def _ipc_record(rank, host="h", visible=None, ipc=True):
    return WorkerRecord(f"w{rank}", rank, host, ("127.0.0.1", rank + 1),
                        cuda_visible=visible, cuda_ipc=ipc)


def test_cuda_ipc_only_to_other_willing_processes_of_this_host_with_the_same_gpus():
    records = [_ipc_record(0), _ipc_record(1), _ipc_record(2, host="other"),
               _ipc_record(3, visible="1,0"), _ipc_record(4, ipc=False)]
    r = _devices.Router("w0", records)
    assert [r.ipc(rank) for rank in range(5)] == [False, True, False, False, False]
    unwilling = [_ipc_record(0, ipc=False), _ipc_record(1)]
    assert not _devices.Router("w0", unwilling).ipc(1)


def test_a_map_naming_missing_gpus_fails_init_on_every_worker_without_hanging():
    if torch.cuda.is_available() and torch.cuda.device_count() > 3:
        pytest.skip("this machine has the GPUs the map names")

    def body(rank, world_size, init_method):
        from _cluster import options
        maps = {"worker1": {0: 3}} if rank == 0 else {}
        try:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                         rpc_backend_options=options(init_method, device_maps=maps))
        except ValueError as exc:
            return str(exc).splitlines()[0]
        rpc.shutdown()
        return "initialized"

    # cuda:0 exists on a machine with a GPU: then the map's target, cuda:3, is the bad one
    bad = "target" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "source"
    assert run_world(body, 2, init=False, timeout=60) == [
        f"Node worker0 has {bad} devices with invalid indices in its device map for worker1"
    ] * 2


def cuda_roundtrip(x):
    return x.device.type, x * 2


def _init_with_map(rank, world_size, init_method) -> None:
    """init_rpc with worker0's cuda:0 mapped to worker1's cuda:0 (worker1 has no map)."""
    from _cluster import options
    opts = options(init_method)
    if rank == 0:
        opts.set_device_map("worker1", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)


def _cuda_roundtrip_body(rank, world_size, init_method):
    _init_with_map(rank, world_size, init_method)
    result = None
    if rank == 0:
        where, y = rpc.rpc_sync("worker1", cuda_roundtrip,
                                args=(torch.ones(3, device="cuda:0"),))
        result = (where, y.device.type, y.cpu().tolist())
        rref = rpc.remote("worker1", cuda_roundtrip, args=(torch.ones(2, device="cuda:0"),))
        assert rref.to_here()[1].device.type == "cuda"  # the reply maps back
        if torch.cuda.device_count() >= 2:  # cuda:1 is not in the map
            with pytest.raises(rpc.SerializationError, match="only supports CPU tensors"):
                rpc.rpc_sync("worker1", cuda_roundtrip, args=(torch.ones(1, device="cuda:1"),))
    rpc.shutdown()
    return result


@needs_gpu
def test_cuda_tensor_lands_on_the_mapped_device_and_the_reply_comes_back():
    assert run_world(_cuda_roundtrip_body, 2, init=False, timeout=90, spawn=True)[0] == \
        ("cuda", "cuda", [2.0] * 3)


def cuda_double(x):
    return x * 2


def _cuda_autograd_body(rank, world_size, init_method):
    import torchwire.autograd as dist_autograd
    _init_with_map(rank, world_size, init_method)
    result = None
    if rank == 0:
        x = torch.ones(3, device="cuda:0", requires_grad=True)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", cuda_double, args=(x,))  # 2x, computed on worker1
            z = rpc.remote("worker1", cuda_double, args=(y,)).to_here()  # 4x, through an RRef
            dist_autograd.backward(cid, [(y * z).sum()])  # d/dx sum(8 x^2) = 16 x
            grad = dist_autograd.get_gradients(cid)[x]
        result = (y.device.type, z.device.type, grad.device.type, grad.cpu().tolist())
    rpc.shutdown()
    return result


@needs_gpu
def test_distributed_autograd_and_rrefs_carry_cuda_tensors_under_a_device_map():
    assert run_world(_cuda_autograd_body, 2, init=False, timeout=90, spawn=True)[0] == \
        ("cuda", "cuda", "cuda", [16.0] * 3)


def to_gpu_and_back(x):
    return x.device.type, x.to("cuda:0") + 1  # a new CUDA tensor in the reply


def _cpu_map_body(rank, world_size, init_method):
    """worker0 maps its CPU to worker1's cuda:0: CPU tensors arrive there on the GPU,
    and the reply's cuda:0 tensors come back on worker0's CPU (the inverse)."""
    from _cluster import options
    opts = options(init_method)
    if rank == 0:
        opts.set_device_map("worker1", {"cpu": 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    result = None
    if rank == 0:
        where, y = rpc.rpc_sync("worker1", to_gpu_and_back, args=(torch.zeros(3),))
        result = (where, y.device.type, y.tolist())
    rpc.shutdown()
    return result


@needs_gpu
def test_a_map_naming_the_cpu_moves_cpu_tensors_to_the_gpu_and_replies_back():
    assert run_world(_cpu_map_body, 2, init=False, timeout=90, spawn=True)[0] == \
        ("cuda", "cpu", [1.0] * 3)


def make_cuda(n):
    return torch.full((n,), 7.0, device="cuda:0")


def _no_reply_map_body(rank, world_size, init_method):
    """worker1 returns a CUDA tensor to worker0, whose map to worker1 does not cover
    it: torch's words, and the workers keep serving."""
    _init_with_map(rank, world_size, init_method)
    result = None
    if rank == 1:
        try:
            rpc.rpc_sync("worker0", make_cuda, args=(4,))
        except RuntimeError as exc:
            result = str(exc)
        result = (result, rpc.rpc_sync("worker0", torch.add, args=(torch.ones(2), 1)).tolist())
    rpc.shutdown()
    return result


@needs_gpu
def test_a_reply_no_map_covers_fails_with_torchs_words_and_rpc_keeps_working():
    message, after = run_world(_no_reply_map_body, 2, init=False, timeout=90, spawn=True)[1]
    assert "Response device mapping is not available" in message
    assert "set_device_map" in message
    assert after == [2.0, 2.0]


def fresh_times(x, k):
    return x * k


def allocated_on_callee():
    return torch.cuda.memory_allocated(0)


def _ipc_body(rank, world_size, init_method, ipc: str):
    """64 MiB CUDA tensors both ways, 30 round trips (before them a 32 MiB view and a
    2 MiB tensor); what path they took, whether the values are right, and both
    workers' allocated memory along the way."""
    import os

    from torchwire._serialization import cuda_host, cuda_ipc
    os.environ["TORCHWIRE_CUDA_IPC"] = ipc
    _init_with_map(rank, world_size, init_method)
    result = None
    if rank == 0:
        x = torch.arange(16 * 2**20, device="cuda:0", dtype=torch.float32)
        view = x.view(4096, -1)[:, ::2]  # a strided view of part of a storage
        ok = torch.equal(rpc.rpc_sync("worker1", fresh_times, args=(view, 3)), view * 3)
        small = torch.arange(2**19 + 7, device="cuda:0", dtype=torch.float32)  # just over 2 MiB
        ok = ok and torch.equal(rpc.rpc_sync("worker1", fresh_times, args=(small, 5)), small * 5)
        allocated = []
        for k in range(30):
            y = rpc.rpc_sync("worker1", fresh_times, args=(x, k))
            ok = ok and y.device == x.device and torch.equal(y, x * k)
            del y
            allocated.append((torch.cuda.memory_allocated(0),
                              rpc.rpc_sync("worker1", allocated_on_callee)))
        result = (ok, cuda_ipc.shared_count, allocated[5], allocated[-1],
                  cuda_host.staged_count)
    rpc.shutdown()
    return result


def _ipc_on(rank, world_size, init_method):
    return _ipc_body(rank, world_size, init_method, "1")


def _ipc_off(rank, world_size, init_method):
    return _ipc_body(rank, world_size, init_method, "0")


@needs_gpu
def test_cuda_tensors_on_one_host_are_shared_by_cuda_ipc_and_released():
    ok, shared, early, late, staged = run_world(_ipc_on, 2, init=False, timeout=120,
                                                spawn=True)[0]
    assert ok
    # every request's tensor; the replies were shared by worker1
    assert shared == 32 and staged == 0
    # blocks a receiver let go of are freed on both sides, not piled up: 24 more
    # round trips may leave at most one 64 MiB block waiting for its receiver
    assert late[0] <= early[0] + 2**26 and late[1] <= early[1] + 2**26


@needs_gpu
def test_turning_cuda_ipc_off_sends_cuda_tensors_through_pinned_host_memory():
    ok, shared, _, _, staged = run_world(_ipc_off, 2, init=False, timeout=120, spawn=True)[0]
    # every request staged on its way out, every reply on its way in
    assert ok and shared == 0 and staged == 64


def bump(t):
    t += 1
    return t


def _self_call_body(rank, world_size, init_method):
    """A worker's call to itself with a large CUDA tensor (no IPC to itself)."""
    from _cluster import options
    opts = options(init_method)
    opts.set_device_map(f"worker{rank}", {0: 0})
    opts.set_device_map(f"worker{1 - rank}", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    from torchwire._serialization import cuda_host, cuda_ipc
    x = torch.ones(2**20, device="cuda:0")
    y = rpc.rpc_sync(f"worker{rank}", fresh_times, args=(x, 2))
    z = rpc.remote(f"worker{rank}", fresh_times, args=(x, 3)).to_here()
    view = torch.arange(2**20, device="cuda:0", dtype=torch.float64).view(1024, -1)[:, ::2]
    w = rpc.rpc_sync(f"worker{rank}", fresh_times, args=(view, 1))
    bumped = rpc.rpc_sync(f"worker{rank}", bump, args=(x,))  # the callee's own copy
    same = torch.equal(w, view) and float(x.sum()) == 2**20 and float(bumped.sum()) == 2**21
    rpc.shutdown()
    # each of the 4 requests and 3 replies stayed on the device (remote()'s value
    # stays with its owner, the caller)
    return float(y.sum()), float(z.sum()), same, cuda_ipc.local_count >= 7, \
        cuda_host.staged_count


@needs_gpu
def test_a_workers_call_to_itself_carries_large_cuda_tensors_on_the_device():
    assert run_world(_self_call_body, 2, init=False, timeout=90, spawn=True) == \
        [(2.0 * 2**20, 3.0 * 2**20, True, True, 0)] * 2
