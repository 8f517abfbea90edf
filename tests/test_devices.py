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
