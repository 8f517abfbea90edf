"""``torchwire.patch``: programs written for torch.distributed.rpc run on torchwire unchanged.

Each test runs a real program in a fresh interpreter (the patch rebinds modules for
the whole process); the pytest process never installs it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).parent.parent
PS_SCRIPT = ROOT / "tests" / "data" / "rpc_parameter_server.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, cwd, timeout=120, env=None):
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def test_parameter_server_script_for_torch_runs_on_torchwire(tmp_path):
    # The store is this test's (as torchrun's agent hosts it): every rank is a client,
    # and after the run it holds what the workers published at rendezvous: torchwire's
    # worker records (torch's TensorPipe agent writes none of these).  One trainer: with
    # two, the original races (one trainer's optimizer step modifies in place the weights
    # another's backward pass still needs), on torch as on torchwire.
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=90),
                          wait_for_workers=False)
    stdout = _run(["-m", "torchwire.patch", str(PS_SCRIPT), "--world_size", "2",
                   "--batches", "3", "--batch_size", "8", "--master_addr", "127.0.0.1",
                   "--master_port", str(port)], tmp_path, timeout=180,
                  env={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "Training complete!" in stdout and "Accuracy " in stdout, stdout
    assert "RPC shutdown on parameter server." in stdout, stdout
    records = [json.loads(store.get(f"torchwire/attempt_0/worker/{rank}")) for rank in range(2)]
    assert [r["name"] for r in records] == ["parameter_server", "trainer_1"]
    assert len({r["pid"] for r in records} | {os.getpid()}) == 3  # two spawned children


CHILDREN = """
import sys
import torch.distributed.rpc as rpc
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc.api as api
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.nn import RemoteModule
from torch.distributed.nn.api.remote_module import RemoteModule as RM2
import torch.multiprocessing as mp


def child(q):
    import torch.distributed.rpc as r
    q.put(r.__name__)


def spawned(rank, q):
    child(q)


if __name__ == "__main__":
    print("argv", sys.argv[1:])
    print("modules", rpc.__name__, dist_autograd.__name__, api.__name__)
    print("classes", DistributedOptimizer.__module__, RemoteModule.__module__, RM2 is RemoteModule)
    for method in ("forkserver", "fork"):  # spawn: mp.spawn below
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(method, q.get(timeout=60))
        p.join()
    q = mp.get_context("spawn").Queue()
    mp.spawn(spawned, args=(q,), nprocs=1)
    print("mp.spawn", q.get(timeout=60))
    try:
        import torch.distributed.rpc._utils  # noqa: F401
    except ImportError as exc:
        print("refused", exc)
"""


def test_patch_rebinds_torchs_names_here_and_in_every_child(tmp_path):
    (tmp_path / "prog.py").write_text(CHILDREN)
    lines = _run(["-m", "torchwire.patch", "prog.py", "a", "--b"], tmp_path).splitlines()
    assert lines[:3] == ["argv ['a', '--b']",
                         "modules torchwire.rpc torchwire.autograd torchwire.rpc.api",
                         "classes torchwire.optim torchwire.nn._remote_module True"]
    assert lines[3:6] == ["forkserver torchwire.rpc", "fork torchwire.rpc",
                          "mp.spawn torchwire.rpc"]
    assert lines[6].startswith("refused No module named 'torch.distributed.rpc._utils': "
                               "torchwire.patch is installed"), lines


INSTALL_THEN_TORCH_OBJECTS = """
import torch
import torch.distributed.rpc as torch_rpc

# made before the patch, as a library that imported torch's RPC first would hold them
torch_opts = torch_rpc.TensorPipeRpcBackendOptions(init_method="{init}", rpc_timeout=17,
                                                  num_worker_threads=3)
torch_backend = torch_rpc.BackendType.TENSORPIPE

import torchwire.patch
print(sorted(torchwire.patch.install().items())[0])
import torch.distributed.rpc as rpc

rpc.init_rpc("solo", backend=torch_backend, rank=0, world_size=1,
             rpc_backend_options=torch_opts)
print(rpc.get_rpc_timeout(), rpc.rpc_sync("solo", torch.add, args=(torch.ones(1), 1)))
print(rpc.stats()["name"], rpc.__name__)
rpc.shutdown()
"""


def test_install_in_process_accepts_torchs_own_backend_and_options(tmp_path):
    code = INSTALL_THEN_TORCH_OBJECTS.format(init=f"file://{tmp_path}/store")
    (tmp_path / "prog.py").write_text(code)
    lines = _run(["prog.py"], tmp_path).splitlines()
    assert lines == ["('torch.distributed.autograd', 'torchwire.autograd')",
                     "17.0 tensor([2.])", "solo torchwire.rpc"]


def test_patch_runs_a_module_and_explains_its_usage(tmp_path):
    (tmp_path / "pkgmod.py").write_text(
        "import sys, torch.distributed.rpc as rpc\n"
        "print(__name__, rpc.__name__, sys.argv[0].endswith('pkgmod.py'), sys.argv[1:])\n")
    out = _run(["-m", "torchwire.patch", "-m", "pkgmod", "x"], tmp_path)
    assert out.splitlines() == ["__main__ torchwire.rpc True ['x']"]  # argv as python -m
    bad = subprocess.run([sys.executable, "-m", "torchwire.patch"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage: python -m torchwire.patch SCRIPT" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "torchwire.patch", "nope.py"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.returncode == 2 and "can't open file 'nope.py'" in missing.stderr
