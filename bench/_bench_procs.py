"""Process plumbing shared by the bench's runners: ports, killing, thread settings."""

from __future__ import annotations

import contextlib
import os
import socket
import time

# Every round runs under each of these (alternating), for both libraries: torch's default
# intra-op threads, and OMP_NUM_THREADS=1, what torchrun sets when it starts several
# processes per host (how RPC jobs run).  Targets are judged on the worse of the two.
THREAD_SETTINGS = ("default", "omp1")
SETTING_TITLES = {"default": "default threads", "omp1": "OMP_NUM_THREADS=1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_all(procs) -> None:
    """Terminate, then kill, every started process of ``procs``; bounded."""
    procs = [p for p in procs if p.pid is not None]  # skip never-started ones
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


@contextlib.contextmanager
def thread_env(setting: str):
    """The environment processes started inside see: ``OMP_NUM_THREADS`` unset
    (``default``) or 1 (``omp1``).  Spawned processes take the environment at start."""
    old = os.environ.get("OMP_NUM_THREADS")
    if setting == "omp1":
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
