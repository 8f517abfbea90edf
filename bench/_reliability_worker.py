"""Child-process side of ``bench/reliability.py``: one worker of one scenario run.

The same code runs for both libraries; only the module imported as ``rpc``
differs (``torch.distributed.rpc`` or ``torchwire.rpc``), and both get their
default options (only ``init_method``; torch in separate network namespaces gets
its TCP transport, ``_transports=["uv"]``, and the interface in ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME``).
Every step that may block runs in a daemon thread joined with a cap
(:func:`timed`): a step that hangs is reported as ``{"status": "hang"}`` and the
worker moves on.  Results go to the parent through this worker's own queue as
``(key, value)``; the parent moves the run along by raising ``board[0]`` (a
lock-free shared array: a frozen worker never holds a lock anybody waits on).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading
import time
import traceback

LIB_MODULES = {"torch": "torch.distributed.rpc", "torchwire": "torchwire.rpc"}
_CLONE_NEWNET = 0x40000000


# ---------------------------------------------------------------- remote functions


def add(a, b):
    return a + b


def nap(seconds):
    time.sleep(seconds)
    return seconds


def ones(n):
    import torch
    return torch.ones(n)


def numel(t):
    return t.numel()


# ---------------------------------------------------------------- helpers


def describe(exc: BaseException) -> str:
    head = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {head[:90]}".replace("|", "/")


def timed(fn, cap: float) -> dict:
    """Run ``fn()`` in a daemon thread for at most ``cap`` seconds:
    ``{"status": "ok"|"err"|"hang", "s": seconds, "value"|"error": ...}``."""
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            value = fn()
            box["r"] = {"status": "ok",
                        "value": value if isinstance(value, dict) else repr(value)[:100]}
        except BaseException as exc:  # noqa: B036 - report everything
            box["r"] = {"status": "err", "error": describe(exc)}
        box["r"]["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(cap)
    return box.get("r") or {"status": "hang", "cap": cap}


def wait_phase(board, n: int, timeout: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout
    while board[0] < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def issue_tracked(rpc, to, fn, args, timeout):
    """``rpc_async`` whose completion time (or error) is recorded by a callback."""
    rec = {"t0": time.monotonic()}
    fut = rpc.rpc_async(to, fn, args=args, timeout=timeout)
    rec["issue_s"] = time.monotonic() - rec["t0"]

    def done(f):
        t1 = time.monotonic()
        try:
            f.value()
            error = None
        except BaseException as exc:  # noqa: B036
            error = describe(exc)
        rec["error"] = error
        rec["t1"] = t1  # last: settle() takes a record with "t1" as complete

    fut.add_done_callback(done)
    rec["fut"] = fut
    return rec


def settle(recs, cap: float) -> list[dict]:
    """Wait (bounded) until every tracked call completed; the plain records."""
    deadline = time.monotonic() + cap
    while any("t1" not in r for r in recs) and time.monotonic() < deadline:
        time.sleep(0.02)
    out = [dict(r) for r in recs]  # (one step each: callbacks may still add keys)
    for r in out:
        r.pop("fut", None)
    return out


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


def _victim_idle(board, resume_phase: int) -> None:
    """A victim polls the board (no lock, no Event): it may be frozen at any moment."""
    while board[0] < resume_phase:
        time.sleep(0.02)


# ---------------------------------------------------------------- scenarios
# Each gets (rpc, rank, put, board, cfg); cfg carries the caps and parameters.


def scenario_kill9(rpc, rank, put, board, cfg):
    """worker2 is SIGKILLed while worker0 (20 calls, an RRef) and worker1 (5 calls) wait."""
    cap = cfg["cap"]
    if rank == 2:
        put("armed", True)
        time.sleep(600)
        return
    owned = None
    if rank == 0:
        owned = rpc.remote("worker2", ones, args=(2,))
        owned.to_here()
    recs = [issue_tracked(rpc, "worker2", nap, (30,), cfg["pending_timeout"])
            for _ in range(20 if rank == 0 else 5)]
    put("armed", True)
    wait_phase(board, 1)
    put("pending", settle(recs, cfg["pending_timeout"] + cap["call"]))
    put("new_call", timed(lambda: rpc.rpc_sync("worker2", add, args=(1, 1)), cap["call"]))
    if owned is not None:
        put("rref", timed(owned.to_here, cap["call"]))
    put("bystander", timed(lambda: rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 3)),
                           cap["call"]))
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_sigstop(rpc, rank, put, board, cfg):
    """worker2 is frozen; worker0 (connected before) and worker1 (never connected) call it
    with timeout=2; after SIGCONT both call it again."""
    cap = cfg["cap"]
    if rank == 2:
        put("armed", True)
        _victim_idle(board, 2)
        put("shutdown", timed(rpc.shutdown, cap["shutdown"]))
        return
    if rank == 0:
        rpc.rpc_sync("worker2", add, args=(1, 1))  # a connection to worker2 exists
    put("armed", True)
    wait_phase(board, 1)
    key = "existing_call" if rank == 0 else "first_call"
    put(key, timed(lambda: rpc.rpc_sync("worker2", add, args=(1, 1), timeout=2), cap["slow"]))
    put("bystander", timed(lambda: rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 3)),
                           cap["call"]))
    put("stalled_done", True)
    wait_phase(board, 2)
    put("after", timed(lambda: rpc.rpc_sync("worker2", add, args=(3, 3), timeout=5),
                       cap["call"]))
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_netcut(rpc, rank, put, board, cfg):
    """Three hosts (namespaces); worker2's link is cut, then restored."""
    cap = cfg["cap"]
    for r in range(3):
        if r != rank:
            rpc.rpc_sync(f"worker{r}", add, args=(1, 1))  # every link is up and used
    put("armed", True)
    wait_phase(board, 1)
    target = "worker2" if rank != 2 else "worker0"
    put("cut_call", timed(lambda: rpc.rpc_sync(target, add, args=(1, 1), timeout=3),
                          cap["slow"]))
    if rank != 2:
        put("bystander", timed(lambda: rpc.rpc_sync(f"worker{1 - rank}", add, args=(2, 3)),
                               cap["call"]))
    put("cut_done", True)
    wait_phase(board, 2)
    put("after", timed(lambda: rpc.rpc_sync(target, add, args=(3, 3), timeout=5),
                       cap["call"]))
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_strangers(rpc, rank, put, board, cfg):
    """Load first (worker0 -> worker1); the parent attacks worker1's listeners; then
    worker0 (connected) and worker2 (first contact) call worker1."""
    cap = cfg["cap"]
    if rank == 0:
        put("load", timed(lambda: ten_thousand_outstanding(rpc), cap["load"]))
    put("armed", True)
    wait_phase(board, 1)
    if rank == 0:
        put("existing_call", timed(lambda: rpc.rpc_sync("worker1", add, args=(2, 3)),
                                   cap["call"]))
    elif rank == 2:
        put("new_peer", timed(lambda: rpc.rpc_sync("worker1", add, args=(2, 3)), cap["call"]))
    put("checked", True)
    wait_phase(board, 2)
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


def scenario_slowreader(rpc, rank, put, board, cfg):
    """worker1 is frozen while worker0 sends it large tensors (rpc_async, timeout=3) and
    probes worker2 with small calls."""
    import torch

    cap = cfg["cap"]
    if rank == 1:
        put("armed", True)
        _victim_idle(board, 2)
        put("shutdown", timed(rpc.shutdown, cap["shutdown"]))
        return
    if rank == 2:
        put("armed", True)
        wait_phase(board, 2)
        put("shutdown", timed(rpc.shutdown, cap["shutdown"]))
        return
    rpc.rpc_sync("worker1", add, args=(1, 1))  # both links exist before the stall
    rpc.rpc_sync("worker2", add, args=(1, 1))
    put("armed", True)
    wait_phase(board, 1)
    n, every, tmo = cfg["big_calls"], cfg["big_every"], cfg["big_timeout"]
    elems = cfg["big_mib"] << 18  # float32
    recs: list = []
    probes: list = []
    sending = threading.Event()

    def send():
        t0 = time.monotonic()
        for i in range(n):
            x = torch.full((elems,), float(i))
            recs.append(issue_tracked(rpc, "worker1", numel, (x,), tmo))
            del x  # only the library may keep it now
            time.sleep(max(0.0, t0 + (i + 1) * every - time.monotonic()))
        sending.set()

    def probe():
        while not sending.wait(1.0):
            probes.append(timed(lambda: rpc.rpc_sync("worker2", add, args=(2, 3), timeout=5),
                                cap["call"]))

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    # each rpc_async may wait for room until its own deadline (backpressure)
    sent = timed(lambda: send() or {"calls": len(recs)}, n * (every + tmo) + cap["call"])
    sending.set()
    prober.join(cap["call"])
    calls = settle(recs, tmo + cap["call"])
    put("stall", {"send": sent, "calls": calls, "probes": probes})
    wait_phase(board, 2)
    put("shutdown", timed(rpc.shutdown, cap["shutdown"]))


SCENARIOS = {"kill9": scenario_kill9, "sigstop": scenario_sigstop, "netcut": scenario_netcut,
             "strangers": scenario_strangers, "slowreader": scenario_slowreader}


def _enter_netns(path: str) -> None:
    """Move this (so far single-threaded) process into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")
    finally:
        os.close(fd)


def child_main(lib, rank, world_size, init_method, scenario, q, board, cfg):
    def put(key, value):
        q.put((key, value))

    try:
        netns = cfg.get("netns")
        if netns:
            _enter_netns(netns[rank])
            os.environ["TP_SOCKET_IFNAME"] = f"e{rank}"  # torch's agent and its gloo group
            os.environ["GLOO_SOCKET_IFNAME"] = f"e{rank}"
        rpc = importlib.import_module(LIB_MODULES[lib])
        kw = {}
        if lib == "torch" and netns:
            kw["_transports"] = ["uv"]  # shm cannot cross namespaces; TCP as torchwire
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, **kw)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=opts)
        put("ready", True)
        SCENARIOS[scenario](rpc, rank, put, board, cfg)
    except BaseException as exc:  # noqa: B036 - report everything
        put("error", f"{describe(exc)}\n{traceback.format_exc(limit=6)}")
    finally:
        put("end", True)
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
