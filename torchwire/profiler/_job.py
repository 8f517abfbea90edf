"""A job-wide profile, driven from one worker: start torch.profiler on every worker,
stop it, gather the traces, measure the clock offsets and write one stitched trace.

Each worker runs torch.profiler on all its threads (Kineto's ``profile_all_threads``)
and marks itself traced (``profiling.trace_all_threads``): every call it makes is a
``rpc_<mode>#...`` range and every request it runs a ``rpc_serve#...`` range, which
``_stitch.py`` joins with arrows.

States of one worker's profile::

    idle --_start--> running --_stop (trace returned)--> idle
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any

import torch

from .. import rpc
from .._agent import profiling
from . import _stitch

_lock = threading.Lock()
_running: dict[str, Any] = {}  # this worker's profile while it runs: {"profile": ...}
_CLOCK_SAMPLES = 7


def _start(record_shapes: bool) -> None:
    """Worker: start profiling every thread of this process.

    Raises:
        RuntimeError: a job profile runs here already.
    """
    with _lock:
        if _running:
            raise RuntimeError(f"{rpc.get_worker_info().name} is already being profiled")
        try:
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # a torch without it: the ranges of this thread only
            config = torch._C._profiler._ExperimentalConfig()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      record_shapes=record_shapes, experimental_config=config)
        prof.start()
        profiling.trace_all_threads(True)
        _running["profile"] = prof


def _stop() -> dict[str, Any]:
    """Worker: stop profiling; return ``{"name", "rank", "trace", "calls"}`` (the
    Chrome trace; the calls' keys and sizes, ``profiling.take_job_calls``)."""
    with _lock:
        prof = _running.pop("profile", None)
        profiling.trace_all_threads(False)
    me = rpc.get_worker_info()
    calls = profiling.take_job_calls()
    if prof is None:
        return {"name": me.name, "rank": me.id, "trace": {}, "calls": calls}
    prof.stop()
    fd, path = tempfile.mkstemp(prefix="torchwire-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return {"name": me.name, "rank": me.id, "trace": trace, "calls": calls}


def _clock() -> int:
    return time.time_ns()


for _f in (_start, _stop, _clock):  # named so that the stitching leaves them out
    setattr(_f, profiling.PROFILE_AS, (None, _stitch.CONTROL))
del _f


class JobProfile:
    """A profile of every worker of the job, written as one Chrome/Perfetto trace.

    Use it as a context manager on one worker (the driver), or call :meth:`start`
    and :meth:`stop`.  Open the file in https://ui.perfetto.dev or chrome://tracing:
    one process row per worker, its threads below, RPC calls as ``rpc_sync#...``
    ranges with an arrow to their ``rpc_serve#...`` run on the callee.

    Args:
        path: the trace file (``.json`` or ``.json.gz``).
        workers: names or ranks of the workers to profile (default: every worker).
        record_shapes: record the input shapes of ops.

    Example::

        >>> with torchwire.profiler.JobProfile("step.json.gz"):
        ...     train_step()
    """

    def __init__(self, path: str, workers: list[str | int] | None = None,
                 record_shapes: bool = False) -> None:
        self.path = path
        self._workers = workers
        self._record_shapes = record_shapes
        self.offsets_us: dict[str, float] = {}  # per worker: its clock minus the driver's
        self.workers: list[str] = []
        self._started = False

    def __repr__(self) -> str:
        state = "running" if self._started else "idle"
        return f"<JobProfile {self.path} {state} workers={self.workers}>"

    def start(self) -> JobProfile:
        """Start profiling on every worker (this one included).

        Raises:
            RpcStateError: RPC is not initialized.
            RuntimeError: a job profile runs on one of them already.
        """
        infos = [rpc.get_worker_info(w) for w in self._workers] if self._workers \
            else rpc.api._get_current_rpc_agent().get_worker_infos()
        self.workers = [w.name for w in infos]
        for w in self.workers:
            self.offsets_us[w] = self._offset(w)
        for fut in [rpc.rpc_async(w, _start, args=(self._record_shapes,))
                    for w in self.workers]:
            fut.wait()
        self._started = True
        return self

    def stop(self) -> str:
        """Stop profiling everywhere, stitch the traces and write the file.

        Returns:
            the path written.
        """
        if not self._started:
            raise RuntimeError("JobProfile.stop() before start()")
        self._started = False
        traces = [f.wait() for f in [rpc.rpc_async(w, _stop) for w in self.workers]]
        _stitch.write(_stitch.stitch(traces, self.offsets_us), self.path)
        return self.path

    def _offset(self, worker: str) -> float:
        samples = []
        for _ in range(_CLOCK_SAMPLES):
            t0 = time.time_ns()
            remote = rpc.rpc_sync(worker, _clock)
            samples.append((t0, remote, time.time_ns()))
        return _stitch.clock_offset(samples)[0]

    def __enter__(self) -> JobProfile:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
