"""``python -m torchwire.launch``: start N local workers, restart any that crashes.

    python -m torchwire.launch --nproc-per-node 4 --max-restarts 3 train.py --epochs 5
    python -m torchwire.launch --nproc-per-node 4 -m torchwire.examples.parameter_server

Each worker gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``init_rpc`` with
``init_method="env://"`` (the default) finds the job, plus
``TORCHWIRE_RESTART_COUNT``: how many times this rank was restarted.  As torchrun,
with several workers and no ``OMP_NUM_THREADS`` in the environment, it sets
``OMP_NUM_THREADS=1`` for them (and says so): each process's torch would otherwise
size its intra-op threads for the whole host.  A worker
that exits with a non-zero status or is killed by a signal is started again with
the same rank (up to ``--max-restarts`` times per rank) while the others keep
running; it calls ``init_rpc`` with its name and rank and rejoins the job.

The launcher hosts the rendezvous store itself (as torchrun's agent does:
``TORCHELASTIC_USE_AGENT_STORE=True``), so that rank 0 can be restarted too:
the store does not die with it.  One host only: for jobs over several hosts,
use torchrun (``docs/guide-launching.md``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import timedelta

from ._supervisor import Supervisor, WorkerHandle, describe_exit

__all__ = ["Supervisor", "WorkerHandle", "describe_exit", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchwire.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", "--nprocs", type=int, required=True, dest="nprocs",
                   help="workers to start on this host (ranks 0..N-1)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times each rank may be restarted after an abnormal exit "
                        "(default 3)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of the rendezvous store the launcher hosts "
                        "(default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0,
                   help="its port (default: a free one)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL when giving up (default 30)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the program as a module (python -m PROGRAM)")
    p.add_argument("program", help="the script (or module, with -m) each worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist  # only now: --help needs no torch

    # The store lives here, not in rank 0: a restarted rank 0 finds the job again.
    store = dist.TCPStore(args.master_addr, args.master_port, None, True,  # type: ignore[attr-defined]
                          timedelta(seconds=60), wait_for_workers=False)
    base = dict(os.environ, MASTER_ADDR=args.master_addr, MASTER_PORT=str(store.port),
                WORLD_SIZE=str(args.nprocs), LOCAL_WORLD_SIZE=str(args.nprocs),
                TORCHELASTIC_USE_AGENT_STORE="True",
                # one key space for every incarnation: a restarted rank rejoins the job
                TORCHELASTIC_RESTART_COUNT="0")
    if "OMP_NUM_THREADS" not in os.environ and args.nprocs > 1:
        print("torchwire.launch: setting OMP_NUM_THREADS=1 for each worker, as torchrun "
              "does, so that they do not overload this host; set it yourself to tune "
              "it for your program", file=sys.stderr, flush=True)
        base["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.program] + args.args

    def start(rank: int, restart: int) -> subprocess.Popen[bytes]:
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank),
                   TORCHWIRE_RESTART_COUNT=str(restart))
        return subprocess.Popen(cmd, env=env)

    sup = Supervisor(start, args.nprocs, args.max_restarts, grace=args.grace)

    def interrupted(signum: int, _frame: object) -> None:
        sup.stop(f"the launcher got {signal.Signals(signum).name}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    try:
        return sup.run()
    finally:
        del store
