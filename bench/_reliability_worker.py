"""Child-process side of ``bench/reliability.py``.

The same code runs for both libraries; only the module imported as ``rpc``
differs (``torch.distributed.rpc`` or ``torchwire.rpc``).  Every step that may
block runs in a daemon thread joined with a cap (:func:`timed`), so a step that
hangs is reported as ``{"status": "hang", "cap": N}`` and the script moves on.
Results go to the parent through a queue as ``(rank, key, value)``.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback

LIB_MODULES = {"torch": "torch.distributed.rpc", "torchwire": "torchwire.rpc"}


# ---------------------------------------------------------------- remote functions


def add(a, b):
    return a + b


def nap(seconds):
    time.sleep(seconds)
    return seconds


def ones(n):
    import torch
    return torch.ones(n)


# ---------------------------------------------------------------- helpers


def _describe(exc: BaseException) -> str:
    head = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__module__}.{type(exc).__name__}: {head[:90]}"


def timed(fn, cap: float) -> dict:
    """Run ``fn()`` in a daemon thread for at most ``cap`` seconds."""
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            value = fn()
            box["r"] = {"status": "ok",
                        "value": value if isinstance(value, dict) else repr(value)[:120]}
        except BaseException as exc:  # noqa: B036 - report everything
            box["r"] = {"status": "err", "error": _describe(exc)}
        box["r"]["s"] = time.monotonic() - t0
        box["r"]["end"] = time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(cap)
    return box.get("r") or {"status": "hang", "cap": cap}


def wait_pending(futs, t_ref: float) -> dict:
    """Wait for every future; count failures; time of the last one from ``t_ref``."""
    errors = []
    for f in futs:
        try:
            f.wait()
        except Exception as exc:
            errors.append(_describe(exc))
    return {"failed": len(errors), "total": len(futs), "after": time.monotonic() - t_ref,
            "error": errors[0] if errors else None}


def ten_thousand_outstanding(rpc) -> dict:
    import torch
    futs: list = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def issue(tid):
        mine = [rpc.rpc_async("worker1", add, args=(tid, i)) for i in range(2500)]
        with lock:
            futs.extend((tid, i, f) for i, f in zip(range(2500), mine))

    threads = [threading.Thread(target=issue, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.futures.wait_all([f for _, _, f in futs])
    ok = sum(f.value() == tid + i for tid, i, f in futs)
    return {"ok": ok, "total": len(futs), "s": time.monotonic() - t0}


# ---------------------------------------------------------------- scenarios


def scenario_sigkill(rpc, rank, put, events, shared, cap):
    """worker2 is SIGKILLed by the parent while worker0 and worker1 have calls to it in flight."""
    go = events[0]
    if rank == 2:  # the victim; never waits on an Event (set() would wait for it to wake)
        time.sleep(300)
        return
    owned = None
    if rank == 0:
        owned = rpc.remote("worker2", ones, args=(2,))
        owned.to_here()
    pending = [rpc.rpc_async("worker2", nap, args=(30,)) for _ in range(20 if rank == 0 else 5)]
    put("armed", True)
    go.wait(120)
    t_kill = shared.value
    put("pending", timed(lambda: wait_pending(pending, t_kill), cap["pending"]))
    put("new_call", timed(lambda: rpc.rpc_sync("worker2", add, args=(1, 1)), cap["call"]))
    if owned is not None:
        put("rref", timed(owned.to_here, cap["call"]))
    put("serve", timed(lambda: rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 3)),
                       cap["call"]))
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_sigstop(rpc, rank, put, events, shared, cap):
    """worker2 is SIGSTOPped by the parent; worker0 calls it with timeout=1."""
    go = events[0]
    if rank == 2:  # the victim; never waits on an Event (set() would wait for it to wake)
        time.sleep(300)
        return
    if rank == 0:
        rpc.rpc_sync("worker2", add, args=(1, 1))  # a connection to worker2 exists
    put("armed", True)
    go.wait(120)
    if rank == 0:
        put("timeout_call", timed(lambda: rpc.rpc_sync("worker2", add, args=(1, 1), timeout=1),
                                  cap["call"]))
    put("serve", timed(lambda: rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 3)),
                       cap["call"]))
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_attack(rpc, rank, put, events, shared, cap):
    """Load first (worker0 -> worker1); then the parent attacks worker1's listeners; then
    worker0 checks that worker1 still serves."""
    attacked, checked = events
    if rank == 0:
        put("load", timed(lambda: ten_thousand_outstanding(rpc), cap["load"]))
        put("armed", True)
        attacked.wait(120)
        put("serve", timed(lambda: rpc.rpc_sync("worker1", add, args=(2, 3)), cap["call"]))
        checked.set()
    elif rank == 2:  # first contact with worker1 only after the attacks
        put("armed", True)
        attacked.wait(120)
        put("first_contact", timed(lambda: rpc.rpc_sync("worker1", add, args=(2, 3)),
                                   cap["call"]))
    else:
        put("armed", True)
        checked.wait(180)
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


SCENARIOS = {"sigkill": scenario_sigkill, "sigstop": scenario_sigstop,
             "attack": scenario_attack}


def child_main(lib, rank, world_size, init_method, scenario, q, events, shared, cap):
    def put(key, value):
        q.put((rank, key, value))

    try:
        rpc = importlib.import_module(LIB_MODULES[lib])
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=16,
                                               rpc_timeout=60)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=opts)
        put("ready", True)
        SCENARIOS[scenario](rpc, rank, put, events, shared, cap)
    except BaseException as exc:  # noqa: B036 - report everything
        put("error", f"{_describe(exc)}\n{traceback.format_exc(limit=6)}")
    finally:
        put("end", True)
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
