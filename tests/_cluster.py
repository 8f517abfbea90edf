"""Real worker processes for tests.

Two ways to get them:

* :class:`World` - a group of forked processes that each ``init_rpc`` once and
  then run test bodies sent to them, so many tests share one job (fork after
  import is cheap; ``init_rpc`` and ``shutdown`` are not free).
* :func:`run_world` - a fresh job for one test (init errors, shutdown, failures).

The pytest process itself never joins a job: it only forks and collects.  Bodies
are module-level functions (pickled by reference) or closures (inherited by fork).
Every wait is bounded; a child that hangs is killed and the test fails with
what it printed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import traceback

_ctx = mp.get_context("fork")


class ChildError(AssertionError):
    """A test body failed in a worker process; the message carries its traceback."""


def _child_result(conn, fn, *args):
    try:
        value = fn(*args)
        conn.send(("ok", value))
    except BaseException as exc:  # report everything, including SystemExit
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _recv(conn, proc, timeout: float, what: str):
    if not conn.poll(timeout):
        _kill(proc)
        raise ChildError(f"{what}: no answer within {timeout}s (process killed)")
    try:
        status, value = conn.recv()
    except EOFError:
        proc.join(5)
        raise ChildError(f"{what}: process died (exit code {proc.exitcode})") from None
    if status == "err":
        raise ChildError(f"{what} failed:\n{value}")
    return value


# -------------------------------------------------------- gates: calls held in flight
# A callee that must still be running when a test acts waits at a gate the test
# opens afterwards (keys are per test: the shared job's workers keep them).

_gates: dict[str, threading.Event] = {}
_gates_lock = threading.Lock()


def _gate(key: str) -> threading.Event:
    with _gates_lock:
        return _gates.setdefault(key, threading.Event())


def after_gate(key, value):
    """``value`` once ``open_gate(key)`` has run here (30 s at most)."""
    if not _gate(key).wait(30):
        raise TimeoutError(f"gate {key!r} was never opened")
    return value


def open_gate(key):
    _gate(key).set()


def _kill(proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)


def _stopped(pid: int) -> bool:
    """Is every thread of ``pid`` stopped (or gone)?"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in "tTZX":
            return False
    return True


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    ``kill`` returns before the process stops: the kernel wakes one thread, which
    stops the others once it runs, so on a loaded machine another thread may still
    read a request and answer it meanwhile.
    """
    os.kill(pid, signal.SIGSTOP)
    if not wait_until(lambda: _stopped(pid), timeout):
        raise AssertionError(f"process {pid} did not stop within {timeout} s of SIGSTOP")


def wait_until(cond, timeout: float = 5.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def new_init_method() -> str:
    fd, path = tempfile.mkstemp(prefix="torchwire-test-")
    os.close(fd)
    os.unlink(path)
    return f"file://{path}"


def options(init_method: str, **kw):
    import torchwire.rpc as rpc
    kw.setdefault("rpc_timeout", 30)
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, **kw)


# --------------------------------------------------------------------- fresh jobs


_child_conn = None


def die(value=None, sig: int | None = None) -> None:
    """In a :func:`run_world` body: report ``value`` as this rank's result and exit at
    once, without shutdown (a crashed worker, as far as its peers can tell); with
    ``sig`` (``signal.SIGKILL``), by that signal instead of ``os._exit``."""
    _child_conn.send(("ok", value))
    if sig is not None:
        os.kill(os.getpid(), sig)
    os._exit(0)


def _world_child(conn, fn, rank, world_size, init_method, init, opts):
    global _child_conn
    import torchwire.rpc as rpc
    _child_conn = conn
    try:
        if init:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                         rpc_backend_options=options(init_method, **opts))
            value = fn(rank, world_size)
            rpc.shutdown()
        else:
            value = fn(rank, world_size, init_method)
        conn.send(("ok", value))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        os._exit(0)


def run_world(fn, world_size: int = 2, *, timeout: float = 60, init: bool = True,
              init_method: str | None = None, spawn: bool = False, **opts) -> list:
    """Run ``fn`` on every rank of a fresh job; return the per-rank results.

    With ``init=True`` each rank runs ``init_rpc("worker<r>")``, ``fn(rank, world_size)``,
    ``shutdown()``.  With ``init=False`` it runs ``fn(rank, world_size, init_method)``.
    ``spawn``: start fresh interpreters instead of forking (``fn`` must then be a
    module-level function): CUDA cannot be used in a child forked from a process that
    asked CUDA anything (``torch.cuda.is_available()`` included).

    Raises:
        ChildError: a rank raised, died or did not finish within ``timeout``.
    """
    init_method = init_method or new_init_method()
    ctx = mp.get_context("spawn") if spawn else _ctx
    procs = []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_world_child,
                         args=(child, fn, rank, world_size, init_method, init, opts))
        p.start()
        child.close()
        procs.append((p, parent))
    results, errors = [], []
    try:
        for rank, (p, conn) in enumerate(procs):
            try:
                results.append(_recv(conn, p, timeout, f"rank {rank}"))
            except ChildError as exc:
                errors.append(str(exc))
                results.append(None)
    finally:
        for p, _ in procs:
            p.join(10)
            _kill(p)
    if errors:
        raise ChildError("\n".join(errors))
    return results



def start_child(fn, rank, world_size, init_method: str):
    """One forked process running ``fn(rank, world_size, init_method)`` (it makes its
    own ``init_rpc``); :func:`child_result` collects what it returns."""
    parent, child = _ctx.Pipe(duplex=False)
    p = _ctx.Process(target=_world_child,
                     args=(child, fn, rank, world_size, init_method, False, {}))
    p.start()
    child.close()
    return p, parent


def child_result(proc, timeout: float = 60):
    """What the process of :func:`start_child` returned (``timeout``: seconds to wait)."""
    p, conn = proc
    if not conn.poll(timeout):
        raise AssertionError(f"pid {p.pid}: no answer within {timeout}s")
    status, value = conn.recv()
    assert status == "ok", value
    return value


# --------------------------------------------------------------------- shared job


def _serve_child(conn, rank, world_size, init_method, opts):
    import torchwire.rpc as rpc
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, **opts))
        conn.send(("ok", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args = msg
            _child_result(conn, fn, *args)
        rpc.shutdown()
        conn.send(("ok", None))
    except BaseException as exc:
        try:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        os._exit(0)


class World:
    """A long-lived job of ``world_size`` forked workers named ``worker<r>``."""

    def __init__(self, world_size: int = 4, **opts) -> None:
        self.world_size = world_size
        self.init_method = new_init_method()
        self._procs = []
        for rank in range(world_size):
            parent, child = _ctx.Pipe()
            p = _ctx.Process(target=_serve_child,
                             args=(child, rank, world_size, self.init_method, opts))
            p.start()
            child.close()
            self._procs.append((p, parent))
        for rank, (p, conn) in enumerate(self._procs):
            _recv(conn, p, 60, f"init of worker{rank}")

    def run(self, rank: int, fn, *args, timeout: float = 60):
        """Run ``fn(*args)`` on worker ``rank`` and return its result."""
        p, conn = self._procs[rank]
        if not p.is_alive():
            raise ChildError(f"worker{rank} is dead")
        conn.send((fn, args))
        return _recv(conn, p, timeout, f"{getattr(fn, '__name__', fn)} on worker{rank}")

    def run_all(self, fn, *args, timeout: float = 60) -> list:
        """Run ``fn(*args)`` on every worker at the same time."""
        for _p, conn in self._procs:
            conn.send((fn, args))
        return [_recv(conn, p, timeout, f"{getattr(fn, '__name__', fn)} on worker{r}")
                for r, (p, conn) in enumerate(self._procs)]

    def close(self, timeout: float = 30) -> None:
        for p, conn in self._procs:
            if p.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        errors = []
        for rank, (p, conn) in enumerate(self._procs):
            try:
                _recv(conn, p, timeout, f"shutdown of worker{rank}")
            except ChildError as exc:  # reported once every worker is gone
                errors.append(str(exc))
            p.join(5)
            _kill(p)
        if errors:
            raise ChildError("the shared job did not shut down cleanly:\n" + "\n".join(errors))
