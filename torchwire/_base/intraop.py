"""Intra-op threads for the work torchwire's own threads run.

torchwire's threads (readers running requests in place, the pool) run requests and
local passes of the distributed backward.  Two rules, both per thread (a thread's
OpenMP and MKL counts are its own; the user's threads keep torch's setting):

* Each torchwire thread uses at most this worker's share of the host's CPUs: the
  CPUs it may use divided by the job's workers on this host (:func:`share_thread`).
  Every worker's threads would otherwise each take torch's count, which is sized
  for the whole machine; on a 2-core host running 2 workers a request's OpenMP team
  waited for CPUs the other process held.  torch's own launcher sets
  OMP_NUM_THREADS=1 when it starts several processes per host, for the same reason.
* A request that carries large tensors (:data:`FULL_MIN_BYTES`), and a large reply,
  run with torch's own count (:func:`full_for`): work on that much memory outlasts
  waking a team, and in a call the caller usually waits, its CPUs idle.
* A function whose last reply carried that much (a parameter server's ``get``, a
  function returning fresh activations) runs with torch's own count too
  (:class:`LargeReplies`): the request that asks for it is small, but the work that
  makes the reply is not, and its caller waits for it.
* A local pass of the distributed backward over few elements runs on one thread
  (:func:`serial_for`, :func:`restore`): each parallel region wakes the thread's
  OpenMP team, and on tensors this small the wake-up costs more than the split
  saves.

Measurements behind both: docs/architecture.md, "Intra-op threads".
"""

from __future__ import annotations

import ctypes
import os
import threading
import types

import torch

# Work over fewer elements than this (leaves and incoming gradients of a pass) runs on
# the calling thread alone.  Optimizer steps keep torch's setting (no gain measured).
SERIAL_MAX_ELEMENTS = 1 << 18
# A request or reply carrying this many bytes of tensors runs with torch's own count,
# not the share (:func:`full_for`).
FULL_MIN_BYTES = 4 << 20


def _find_omp():
    """The OpenMP runtime torch's intra-op parallelism runs on (Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
        # PyDLL: the calls keep the GIL (they only set a thread's count; a CDLL call
        # would release and take it back, a chance for another thread to take it)
        return ctypes.PyDLL(sorted(paths)[0]) if paths else None
    except (OSError, IndexError):
        return None


def _find_mkl_local():
    """MKL's per-thread thread count setter (C API, by value), or None.

    MKL keeps its own thread count beside OpenMP's: with only OpenMP at 1, a small
    ``mm`` with a long inner dimension still splits it over an OpenMP team, and
    waits for the team's other thread to be scheduled."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.PyDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                        "libtorch_cpu.so"))
        fn = lib.MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_omp = _find_omp() if "OpenMP" in torch.__config__.parallel_info() else None
_mkl_local = _find_mkl_local() if _omp is not None else None


# Threads for torchwire's larger pieces of work: this process's share of the CPUs it
# may use, among the workers of its job on this host (None: torch's setting).  Every
# worker's passes would otherwise each take torch's count, which is sized for the
# whole machine: on a 2-core host running 2 workers, a pass's OpenMP team waited for
# the other process's threads.
_pass_threads: int | None = None
_generation = 0  # bumped when the share changes: threads apply it again


class _Local(threading.local):
    generation = -1  # the share this thread applied (-1: none yet)
    torch_threads = 0  # torch's count when this thread first asked (its own setting)


_local = _Local()


def set_local_workers(n: int) -> None:
    """The agent: ``n`` workers of this job (this one included) run on this host."""
    global _pass_threads, _generation
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    share = max(1, cpus // max(1, n))
    if share != _pass_threads:
        _pass_threads = share
        _generation += 1


def share_thread() -> None:
    """Limit the calling torchwire thread's OpenMP and MKL threads to this worker's share
    of the host (:func:`set_local_workers`) where torch's count is larger; done again
    only when the share changes.  Called before a torchwire thread runs requests."""
    local = _local
    if local.generation == _generation or _omp is None or _pass_threads is None:
        return
    local.generation = _generation
    if not local.torch_threads:
        local.torch_threads = torch.get_num_threads()  # before any setting of ours
    want = min(local.torch_threads, _pass_threads)
    _omp.omp_set_num_threads(want)
    if _mkl_local is not None:
        # 0: MKL's global setting (torch's), else this thread's own
        _mkl_local(0 if want == local.torch_threads else want)


def full_for(nbytes: int) -> tuple | None:
    """Give the calling torchwire thread torch's own OpenMP and MKL counts for work on
    tensors of ``nbytes`` (a request's, a reply's) when that is at least
    :data:`FULL_MIN_BYTES` and the thread runs at a smaller share
    (:func:`share_thread`).  Returns what :func:`restore` needs, or None if nothing
    changed."""
    if nbytes < FULL_MIN_BYTES or _omp is None:
        return None
    full = _local.torch_threads
    if not full:
        return None  # no share applied on this thread: it has torch's count
    before = torch.get_num_threads()
    if before >= full:
        return None
    _omp.omp_set_num_threads(full)
    mkl = _mkl_local(0) if _mkl_local is not None else None  # 0: MKL's global (torch's)
    return before, mkl


def serial_for(numel: int) -> tuple | None:
    """Limit this thread's OpenMP and MKL threads for work over ``numel`` elements
    (only this thread's settings: other threads keep theirs): to 1 below
    :data:`SERIAL_MAX_ELEMENTS`, else to this worker's share of the host's CPUs
    (:func:`set_local_workers`) when torch's count is larger.  Returns what
    :func:`restore` needs, or None if nothing changed."""
    if _omp is None:
        return None
    want = 1 if numel < SERIAL_MAX_ELEMENTS else _pass_threads
    if want is None:
        return None
    # torch's own value first: its first call on a thread sets the thread's OpenMP
    # setting from torch's global one, which would undo ours if it came later
    before = torch.get_num_threads()
    if before <= want:
        return None
    _omp.omp_set_num_threads(want)
    mkl = _mkl_local(want) if _mkl_local is not None else None
    return before, mkl


def restore(saved: tuple) -> None:
    """Undo :func:`serial_for`."""
    omp, mkl = saved
    if mkl is not None:
        _mkl_local(mkl)  # 0: MKL's global setting again
    _omp.omp_set_num_threads(omp)


def init_thread() -> None:
    """torch's per-thread intra-op set-up, done when one of torchwire's threads starts.

    Each thread's first parallel op (or ``get_num_threads``) sets the thread's count
    from torch's; in a process forked after ``torch.set_num_threads``, that also
    replaces torch's pthreadpool, which torch marked at the fork as one to replace.
    Threads doing it at once race, and one can fail with "pool INTERNAL ASSERT
    FAILED ... Invalid thread pool!" (a forked child whose 6 threads ran their first
    softmax together: 171 failures in 200 children).  ``get_num_threads`` does the
    set-up holding the GIL, so torchwire's threads do theirs one at a time (0 in
    200), and it changes no setting.
    """
    torch.get_num_threads()


_KEYED_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType)


_named_by_arg: dict = {}  # code of a dispatching function -> the argument naming the work


def name_work_by_arg(func, index: int) -> None:
    """``func`` dispatches to the work its argument ``index`` names (an RRef proxy's
    method name): :func:`work_key` tells its calls apart by that argument."""
    _named_by_arg[func.__code__] = index


_FUNCTION_TYPES = (types.FunctionType, types.MethodType)


def work_key(func, args):
    """What identifies a served function across calls: its code object (equal for the
    copies a by-value closure arrives as each call; with the naming argument for a
    dispatcher, :func:`name_work_by_arg`; with the code of its first argument when that
    is a function, as a dispatcher's ``call_method(method, rref, *args)``), a builtin
    (``torch.randn``) itself, or None (a ``partial``, a callable object: not
    remembered, so that nothing it holds is kept alive)."""
    code = getattr(func, "__code__", None)
    if code is not None:
        index = _named_by_arg.get(code)
        if index is None:
            if args and type(args[0]) in _FUNCTION_TYPES:
                return code, args[0].__code__
            return code
        name = args[index] if args is not None and len(args) > index else None
        return (code, name) if isinstance(name, str) else None
    return func if isinstance(func, _KEYED_TYPES) else None


class LargeReplies:
    """The served functions whose last reply carried :data:`FULL_MIN_BYTES` or more:
    their next calls run with torch's own intra-op count (:meth:`full_for`).

    Learned from each plain reply (not ``@async_execution`` or ``async def`` ones);
    bounded, and cleared when full."""

    MAX = 256

    def __init__(self) -> None:
        self._keys: set = set()

    def full_for(self, key) -> tuple | None:
        """:func:`full_for` a large reply if ``key``'s last reply was one."""
        if key is None or key not in self._keys:
            return None
        return full_for(FULL_MIN_BYTES)

    def learn(self, key, nbytes: int) -> None:
        """``key``'s function just replied with ``nbytes`` of payload and tensors."""
        if key is None:
            return
        if nbytes >= FULL_MIN_BYTES:
            if len(self._keys) >= self.MAX:
                self._keys.clear()
            self._keys.add(key)
        else:
            self._keys.discard(key)
