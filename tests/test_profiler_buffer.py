"""The callee events that torch.profiler (Kineto) windows gather belong to their
profile: a trace only exported (``export_chrome_trace``, as
``tensorboard_trace_handler`` does), never parsed, leaves none of them behind."""

from __future__ import annotations

import gc
import os
import warnings

import torch

from _cluster import run_world, wait_until

CALLS = 40  # RPCs per profile window (each brings back several callee events)


def _work(t):
    return (t * 2).sum()


def _alive() -> int:
    from torch.autograd.profiler_util import FunctionEvent
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is FunctionEvent)


def _held(bound: int = 0) -> tuple[int, int]:
    """(events in this thread's buffer, FunctionEvents alive in this process), once
    no more than ``bound`` are alive or 5 s have passed: the thread that completed
    the last call may still hold it (and through it the profile's list) for a moment
    after the caller resumes."""
    from torchwire._agent import profiling
    wait_until(lambda: _alive() <= bound)
    g = getattr(profiling._local, "gathered", None)
    return (len(g.events) if g is not None else 0), _alive()


def _calls(n: int) -> None:
    import torchwire.rpc as rpc
    t = torch.ones(8)
    for _ in range(n):
        rpc.rpc_sync("worker1", _work, args=(t,))


def _exported_windows(rank, world_size, path):
    if rank != 0:
        return None
    held = []
    for r in range(4):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _calls(CALLS)
        prof.export_chrome_trace(os.path.join(path, f"window{r}.json"))
        del prof
        held.append(_held())
    # and a window whose events are asked for still shows the callee's
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _calls(2)
    prof.export_chrome_trace(os.path.join(path, "last.json"))
    remote = [(e.name, e.node_id) for e in prof.events() if e.is_remote]
    return held, remote


def test_exported_windows_leave_no_callee_events_behind(tmp_path):
    held, remote = run_world(lambda r, w: _exported_windows(r, w, str(tmp_path)), 2)[0]
    # before: each window's events stayed in the thread's buffer (9 a call, 4 windows)
    assert held == [(0, 0)] * 4, held
    key = "rpc_sync#_work(worker0 -> worker1)#remote_op: "
    assert (f"{key}aten::mul", 1) in remote and (f"{key}aten::sum", 1) in remote
    assert len([n for n, _ in remote if n == f"{key}aten::mul"]) == 2


def _scheduled(rank, world_size, path):
    if rank != 0:
        return None
    import torchwire.rpc as rpc
    # the callee's events of one call, as a parsed profile shows them
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rpc.rpc_sync("worker1", _work, args=(torch.ones(8),))
    per_call = len([e for e in prof.events() if e.is_remote])
    del prof
    per_cycle = 2 * (CALLS // 4) * per_call  # two active steps
    handler = torch.profiler.tensorboard_trace_handler(path)
    at_trace = []

    def ready(prof) -> None:
        handler(prof)
        at_trace.append(_held(per_cycle))

    schedule = torch.profiler.schedule(wait=2, warmup=1, active=2, repeat=0)
    with warnings.catch_warnings():
        # torch's note that each cycle starts afresh (acc_events=False)
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=schedule, on_trace_ready=ready) as prof:
            for _ in range(20):  # four cycles of five steps
                _calls(CALLS // 4)
                prof.step()
    return per_cycle, at_trace, len(os.listdir(path))


def test_scheduled_traces_with_tensorboard_handler_stay_bounded(tmp_path):
    per_cycle, at_trace, traces = run_world(lambda r, w: _scheduled(r, w, str(tmp_path)), 2)[0]
    assert traces == 4 and len(at_trace) == 4
    # the cycle that just ended holds its own events (its profile is alive), and no
    # earlier cycle's: before, they piled up in the thread's buffer (x2, x3, x4)
    assert per_cycle > 0
    assert all(buffered == 0 and 0 < alive <= per_cycle for buffered, alive in at_trace), \
        (per_cycle, at_trace)
