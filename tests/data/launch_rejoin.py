"""A worker for tests/test_launch.py, started by ``python -m torchwire.launch``.

Rank 1's first process kills itself with SIGKILL once rank 0 has its pid (rank 0
acknowledges each pid it gets with ``ack``); the launcher starts it again, it
rejoins, and rank 0 (which keeps running) reaches the new process.  With
``--kill-rank-0``, rank 0's first process dies too, once rank 1's new process has
its pid: the store lives in the launcher, so rank 0 rejoins as well.
"""

import os
import signal
import sys
import time

import torchwire.rpc as rpc


_acked = []


def pid():
    return os.getpid()


def ack():
    _acked.append(1)


def _wait_acked(rank: int) -> None:
    deadline = time.monotonic() + 30
    while not _acked and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _acked:
        print(f"rank {rank}: the other rank never acknowledged this process", flush=True)
        sys.exit(1)


def main() -> int:
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHWIRE_RESTART_COUNT"])
    kill_0 = "--kill-rank-0" in sys.argv
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=20))
    other = f"worker{1 - rank}"
    if rank == 1 and restart == 0:  # crash once rank 0 has this process's pid
        _wait_acked(rank)
        os.kill(os.getpid(), signal.SIGKILL)
    seen = set()
    deadline = time.monotonic() + 30
    # the processes of the other rank this one must reach: its first and, if it is to
    # die while this one runs, its successor
    want = 2 if (rank == 0 and restart == 0) or (rank == 1 and kill_0) else 1
    while len(seen) < want:
        try:
            seen.add(rpc.rpc_sync(other, pid, timeout=5))
            rpc.rpc_sync(other, ack, timeout=5)
        except rpc.WorkerUnavailableError:
            pass  # the other's process is gone (it may die once acknowledged) or not back
        if time.monotonic() > deadline:
            print(f"rank {rank}: {other} did not come back", flush=True)
            return 1
        time.sleep(0.05)
    print(f"rank {rank} (restart {restart}) reached {other} in processes {sorted(seen)}",
          flush=True)
    if rank == 0 and restart == 0 and kill_0:  # once rank 1's new process has its pid
        _wait_acked(rank)
        os.kill(os.getpid(), signal.SIGKILL)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
