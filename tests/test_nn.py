"""RemoteModule: created on another worker, used like a local layer."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import torchwire.rpc as rpc
from torchwire.nn import RemoteModule
from torchwire.nn._remote_module import _parse_remote_device


class NotAModule:
    def __init__(self, *args):
        pass


def is_training(module_rref):
    return module_rref.local_value().training


def forward_there(remote_module, x):
    return remote_module(x), rpc.get_worker_info().name


def _linear_matches_local():
    torch.manual_seed(0)
    remote = RemoteModule("worker1/cpu", nn.Linear, args=(4, 3))
    assert remote.on == "worker1" and remote.device == "cpu"
    assert remote.get_module_rref().owner_name() == "worker1"
    weight, bias = [p.to_here() for p in remote.remote_parameters()]
    local = nn.Linear(4, 3)
    with torch.no_grad():
        local.weight.copy_(weight)
        local.bias.copy_(bias)
    x = torch.randn(5, 4)
    assert torch.allclose(remote(x), local(x))
    assert torch.allclose(remote.forward_async(x).wait(), local(x))
    # the same module by rank, and with the device left out
    again = RemoteModule.init_from_module_rref("rank:1/cpu", remote.get_module_rref())
    assert torch.allclose(again(x), local(x))
    assert RemoteModule("worker2", nn.ReLU).device == "cpu"
    return True


def test_remote_module_forward_matches_a_local_module(world):
    assert world.run(0, _linear_matches_local)


class Net(nn.Module):
    """A local model with a remote middle layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.mid = RemoteModule("worker2/cpu", nn.Linear, args=(4, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.inp(x))))


def _inside_local_module():
    net = Net()
    out = net(torch.randn(6, 3))
    assert out.shape == (6, 2)
    # local parameters only; the remote ones come from remote_parameters()
    assert len(list(net.parameters())) == 4
    assert len(net.mid.remote_parameters()) == 2
    net.eval()
    assert rpc.rpc_sync("worker2", is_training, args=(net.mid.get_module_rref(),)) is False
    net.train()
    assert rpc.rpc_sync("worker2", is_training, args=(net.mid.get_module_rref(),)) is True
    # a RemoteModule travels through RPC and works on the receiver
    y, where = rpc.rpc_sync("worker3", forward_there, args=(net.mid, torch.ones(1, 4)))
    assert where == "worker3" and y.shape == (1, 4)
    return True


def test_remote_module_inside_a_local_model_and_sent_over_rpc(world):
    assert world.run(0, _inside_local_module)


def _errors():
    m = RemoteModule("worker1", nn.Linear, args=(2, 2))
    for call in (lambda: m.parameters(), lambda: m.state_dict(), lambda: m.to("cpu"),
                 lambda: m.register_forward_hook(print), lambda: m.zero_grad()):
        with pytest.raises(ValueError, match="not supported for RemoteModule"):
            call()
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        pickle.dumps(m)
    bad = RemoteModule("worker1", NotAModule)
    with pytest.raises(ValueError, match="returns an instance of <class nn.Module>"):
        bad(torch.ones(1))
    with pytest.raises(ValueError, match="Unknown destination worker nobody"):
        RemoteModule("nobody/cpu", nn.ReLU)
    return True


def test_remote_module_errors_are_clear(world):
    assert world.run(0, _errors)


@pytest.mark.parametrize("text,expected", [
    ("ps/cpu", ("ps", "cpu")), ("ps", ("ps", "cpu")), ("rank:3/cpu", (3, "cpu")),
    ("trainer0/cuda:1", ("trainer0", "cuda:1")),
])
def test_remote_device_strings(text, expected):
    assert _parse_remote_device(text) == expected


@pytest.mark.parametrize("text", ["", "/cpu", "a/b/c", "ps/nodevice", "rank:x/cpu"])
def test_bad_remote_device_strings(text):
    with pytest.raises(ValueError, match="Could not parse remote_device"):
        _parse_remote_device(text)


def test_remote_module_needs_rpc():
    with pytest.raises(RuntimeError, match="RemoteModule only works in RPC"):
        RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))
