"""DistributedDataParallel under distributed autograd, side by side with torch's.

The same program (two trainers with a DDP module over a gloo group of the two, a
remote matmul on a third worker) runs once on torch's RPC and distributed autograd
and once on torchwire's; the gradients ``get_gradients`` returns must be the very
same bits, and ``.grad`` stays untouched in both.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _cluster import run_world

pytestmark = pytest.mark.timeout(120)

TRAINERS = 2
STEPS = 3


class _Net(nn.Module):
    """Two layers, and a third used only when ``skip`` is False."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        self.extra = nn.Linear(3, 3)

    def forward(self, x, skip: bool = False):
        y = self.b(torch.relu(self.a(x)))
        return y if skip else self.extra(y)


def _api(backend: str):
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
    else:
        import torchwire.autograd as dist_autograd
        import torchwire.rpc as rpc
    return rpc, dist_autograd


def _program(backend: str, cfg: dict, rank: int, world_size: int, init_method: str):
    """Trainers 0 and 1 (DDP over their own gloo group), worker 2 runs the matmul."""
    torch.set_num_threads(1)
    if backend == "torch":  # (its TensorPipe agent warns of its own use of gloo)
        warnings.simplefilter("ignore", UserWarning)
    rpc, dist_autograd = _api(backend)
    if rank < TRAINERS:
        dist.init_process_group("gloo", init_method=init_method + ".pg", rank=rank,
                                world_size=TRAINERS)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=init_method, rpc_timeout=60))
    out = None
    if rank < TRAINERS:
        torch.manual_seed(0)
        net = _Net()
        ddp = DDP(net, bucket_cap_mb=cfg.get("bucket_cap_mb", 25),
                  find_unused_parameters=cfg.get("find_unused", False),
                  gradient_as_bucket_view=cfg.get("as_view", False))
        torch.manual_seed(1 + rank)  # each trainer its own data
        w = torch.rand(4, 4, requires_grad=True)
        out = []
        for step in range(STEPS):
            x = torch.rand(5, 4)
            with dist_autograd.context() as cid:
                h = rpc.rpc_sync(f"worker{TRAINERS}", torch.matmul, args=(x, w))
                skip = cfg.get("skip", False)
                if cfg.get("no_sync") and step == 0:
                    with ddp.no_sync():
                        y = ddp(h, skip)
                else:
                    y = ddp(h, skip)
                loss = y.pow(2).sum()
                dist_autograd.backward(cid, [loss])
                grads = dist_autograd.get_gradients(cid)
                out.append({"grads": {n: _raw(grads[p]) for n, p in net.named_parameters()
                                      if p in grads},
                            "w": _raw(grads[w]),
                            "dot_grad": [n for n, p in net.named_parameters()
                                         if p.grad is not None]})
    rpc.shutdown()
    if rank < TRAINERS:
        dist.destroy_process_group()
    return out


def _both(cfg: dict) -> tuple[list, list]:
    results = {}
    for backend in ("torch", "torchwire"):
        results[backend] = run_world(functools.partial(_program, backend, cfg),
                                     TRAINERS + 1, init=False, timeout=90)
    return results["torch"], results["torchwire"]


def _raw(t: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and bytes (tensors through a pipe would share memory)."""
    return str(t.dtype), tuple(t.shape), t.detach().contiguous().view(torch.uint8).tolist()


@pytest.mark.parametrize("cfg", [
    {},
    {"bucket_cap_mb": 0.00005},  # one bucket per parameter (or nearly)
    {"as_view": True},
    {"no_sync": True},
    {"find_unused": True},
], ids=["default", "buckets", "bucket_view", "no_sync", "find_unused"])
def test_ddp_gradients_bit_for_bit_as_torch(cfg):
    theirs, ours = _both(cfg)
    for rank in range(TRAINERS):
        for step in range(STEPS):
            t, o = theirs[rank][step], ours[rank][step]
            assert sorted(t["grads"]) == sorted(o["grads"]), (rank, step)
            for name in t["grads"]:
                assert t["grads"][name] == o["grads"][name], (rank, step, name)
            assert t["w"] == o["w"], (rank, step)
            assert t["dot_grad"] == o["dot_grad"] == [], (rank, step)
    # averaged: both trainers got the same gradients of DDP's parameters (but the step
    # that ran under no_sync)
    for step in range(1 if cfg.get("no_sync") else 0, STEPS):
        for name, g in ours[0][step]["grads"].items():
            assert g == ours[1][step]["grads"][name], (step, name)
    assert ours[0][0]["w"] != ours[1][0]["w"]  # w is not DDP's
