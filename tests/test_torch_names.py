"""torchwire.rpc has torch.distributed.rpc's public names, with torch's semantics, and says
so clearly where it deliberately has none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as torch_rpc

import torchwire.rpc as rpc
from _cluster import run_world
from torchwire.rpc import _unsupported, backend_registry

README = Path(__file__).parent.parent / "README.md"


def test_every_name_in_torchs_rpc_all_is_exported_by_torchwire():
    assert torch_rpc.is_available()
    missing = sorted(set(torch_rpc.__all__) - set(rpc.__all__))
    assert not missing, f"torch.distributed.rpc.__all__ names torchwire.rpc lacks: {missing}"
    for name in torch_rpc.__all__:
        assert getattr(rpc, name) is not None, name
    for sub in ("api", "backend_registry", "options", "functions", "constants"):
        torch_mod, ours = getattr(torch_rpc, sub), getattr(rpc, sub)
        lacking = sorted(set(getattr(torch_mod, "__all__", ())) - set(dir(ours)))
        assert not lacking, f"torchwire.rpc.{sub} lacks {lacking}"
    from torch.distributed.rpc import constants, internal
    assert rpc.constants.DEFAULT_PROCESS_GROUP_TIMEOUT == constants.DEFAULT_PROCESS_GROUP_TIMEOUT
    assert rpc.rref_proxy.RRefProxy.__doc__
    assert [m.value for m in rpc.internal.RPCExecMode] == [m.value for m in internal.RPCExecMode]
    assert rpc.internal._build_rpc_profiling_key(rpc.internal.RPCExecMode.SYNC, "f", "a", "b") \
        == internal._build_rpc_profiling_key(internal.RPCExecMode.SYNC, "f", "a", "b")
    payload, tensors = rpc.internal._internal_rpc_pickler.serialize({"t": torch.ones(2)})
    assert torch.equal(rpc.internal._internal_rpc_pickler.deserialize(payload, tensors)["t"],
                       torch.ones(2))


def test_backend_registry_has_torchs_semantics(monkeypatch):
    monkeypatch.setattr(backend_registry, "BackendType", backend_registry.BackendType)
    before = rpc.BackendType.TENSORPIPE
    assert repr(before) == "BackendType.TENSORPIPE" and list(rpc.BackendType) == [before]
    assert rpc.BackendType["TORCHWIRE"] is before and rpc.backend_registered("TENSORPIPE")
    opts = rpc.construct_rpc_backend_options(before, rpc_timeout=7, init_method="file:///x",
                                             num_worker_threads=2, auth_secret="s")
    assert isinstance(opts, rpc.TensorPipeRpcBackendOptions)
    assert (opts.rpc_timeout, opts.num_worker_threads, opts.auth_secret) == (7.0, 2, "s")
    with pytest.raises(TypeError):
        rpc.construct_rpc_backend_options(before, no_such_option=1)

    calls = []
    stub = backend_registry.register_backend(
        "STUB", lambda timeout, init, **kw: calls.append(("options", timeout, init, kw)),
        lambda *a, **kw: calls.append(("init", a, kw)) or "agent")
    assert backend_registry.BackendType["STUB"] is stub and repr(stub) == "BackendType.STUB"
    assert backend_registry.backend_registered("STUB")
    with pytest.raises(RuntimeError, match="^RPC backend .+: already registered$"):
        backend_registry.register_backend("STUB", None, None)
    backend_registry.construct_rpc_backend_options(stub, init_method="tcp://h:1", x=1)
    assert backend_registry.init_backend(stub, 1, name="n") == "agent"
    assert calls == [("options", 60.0, "tcp://h:1", {"x": 1}), ("init", (1,), {"name": "n"})]
    # a member taken before the registration still names the backend
    assert backend_registry.resolve(before) is backend_registry.BackendType.TENSORPIPE
    with pytest.raises(NotImplementedError, match="torchwire's own backend only"):
        rpc.init_rpc("w", backend=stub, rank=0, world_size=1)
    with pytest.raises(TypeError, match="must be a member of BackendType"):
        rpc.init_rpc("w", backend="TENSORPIPE", rank=0, world_size=1)


def test_torchs_own_backend_member_is_accepted():
    assert backend_registry.resolve(torch_rpc.BackendType.TENSORPIPE) is rpc.BackendType.TENSORPIPE


def _not_supported_section() -> str:
    text = README.read_text()
    found = re.search(r"^## Not supported\n(.*?)(?=^## )", text, re.S | re.M)
    assert found, "README.md has no '## Not supported' section"
    return found.group(1)


@pytest.mark.parametrize("name", sorted(_unsupported.NOT_SUPPORTED))
def test_deliberately_missing_names_say_so_and_are_listed(name):
    stand_in = _unsupported.NOT_SUPPORTED[name]
    owner = rpc.api if name == "_use_rpc_pickler" else rpc
    assert getattr(owner, name) is stand_in
    with pytest.raises(NotImplementedError, match=f"{name} is not supported by torchwire: "):
        stand_in(object())
    assert f"`{name}`" in _not_supported_section(), name


def _proxies(rank, world_size):
    if rank:
        return None
    rref = rpc.remote("worker1", torch.ones, args=(3,))
    from torchwire.rpc.rref_proxy import RRefProxy
    sync = RRefProxy(rref, rpc.rpc_sync, timeout=10).sum()
    fut = RRefProxy(rref, rpc.rpc_async).add(1)
    remote = RRefProxy(rref, rpc.remote).mul(2)
    with pytest.raises(ValueError, match="rpc_api must be"):
        RRefProxy(rref, print)
    info = rpc._get_debug_info()
    to_here = rpc.new_method(rref)  # torch's leftover of its method loop: RRef.to_here
    return (float(sync), fut.wait().tolist(), remote.to_here().tolist(), to_here.tolist(),
            sorted(k for k in info if k.startswith(("num_", "agent."))))


def test_rref_proxy_module_and_debug_info():
    got = run_world(_proxies, 2)[0]
    assert got[:4] == (3.0, [2.0] * 3, [2.0] * 3, [1.0] * 3)
    assert {"num_owner_rrefs", "num_forks", "agent.num_pending_requests",
            "num_autograd_contexts", "num_current_backward_passes"} <= set(got[4])
