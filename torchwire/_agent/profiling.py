"""RPC calls in torch's profiler, named as torch's RPC profiling names them.

The agent checks ``torch.autograd._profiler_enabled()`` once per call; only when a
profiler runs on the calling thread does anything here run:

* under **torch.profiler** (Kineto), the call is a ``record_function`` range
  ``rpc_<mode>#<function>(<caller> -> <callee>)`` from the send until the reply has
  arrived (the future the caller gets completes after the range ends);
* under either profiler (Kineto or the **legacy profiler**,
  ``torch.autograd.profiler_legacy.profile``, the one torch's RPC profiling works
  with), the callee runs the function under the legacy profiler of its own thread
  and returns its events with the reply; the caller adds them to its profile,
  renamed ``<rpc key>#remote_op: <event>``, with the callee's rank as ``node_id``
  and ``is_remote`` set, as torch does; under the legacy profiler the call's own
  event has the caller's rank as ``node_id``.

Adding events to a profile: a legacy profile builds its events in
``profiler_legacy._parse_legacy_records`` when it exits, torch.profiler in
``profile._parse_kineto_results`` when they are first asked for, if ever (a trace
exported with ``export_chrome_trace``, as ``tensorboard_trace_handler`` does, is
never parsed).  So each profile owns the events its thread's calls gather
(:class:`Gathered`): :func:`install` wraps (once, when RPC starts) how either
profile starts, to give it a list of its own and make it this thread's, how it
stops, to make it this thread's no more, and how it parses, to add the list's
events.  The events live as long as the profile object, and no longer; calls on a
thread where no profile of ours runs (one the profiler state was carried to) ship
no events under torch.profiler, since nothing would take them.  Event times travel
as wall-clock microseconds, the legacy profiler's own clock; workers on one host
share it (across hosts they are as aligned as the hosts' clocks).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch
from torch.autograd import profiler_legacy as _legacy
from torch.autograd.profiler import profile as _kineto_profile
from torch.autograd.profiler_util import FunctionEvent

from .future import Deferred, Future

REMOTE_OP = "#remote_op: "  # torch's separator of an RPC key and a remote event's name
# On internal functions: (mode, what names the call): the index of the user's function
# among their arguments (rpc.remote's owner-side function), or a name (torch's name of
# the same internal call)
PROFILE_AS = "_torchwire_profile_as"

enabled = torch._C._autograd._profiler_enabled
# The one check per call, on each side: a profiler on this thread; always while this
# process is traced for a job-wide trace (torchwire.profiler: the profiler then runs
# on every thread, which ``enabled`` does not see).
active = enabled
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY
_ids = itertools.count(1 << 40)  # event ids of ours: clear of the profiler's handles
_local = threading.local()
_installed = False
_install_lock = threading.Lock()


_NO_SCOPE = contextlib.nullcontext()


def scope(name: str):
    """A ``record_function`` range named ``name`` while a profiler runs (a shared
    no-op context otherwise): for the passes of distributed autograd and the optimizer."""
    if enabled():
        return torch.autograd.profiler.record_function(name)
    return _NO_SCOPE


def _always() -> bool:
    return True


# Requests served are ranges of the profile only while the process is traced: a
# module flag, cheaper than ``active()`` on every request.
traced = False


def trace_all_threads(on: bool) -> None:
    """While a profiler runs on every thread of this process (torchwire.profiler):
    profile every call made and served here (``active``, ``traced``), and note the
    calls' sizes."""
    global active, traced
    active = _always if on else enabled
    traced = on
    if on:
        _job_calls.clear()


class Probe:
    """A profiled call's sizes in bytes: the request's (payload and tensors, set by
    the agent) and the reply's (set by the pending calls when it arrives)."""

    __slots__ = ("key", "bytes_out", "bytes_in")

    def __init__(self, key: str) -> None:
        self.key = key
        self.bytes_out = 0
        self.bytes_in = None

    def __repr__(self) -> str:
        return f"<Probe {self.key} out={self.bytes_out} in={self.bytes_in}>"

    def replied(self, payload, tensors) -> None:
        n = len(payload)
        for t in tensors:
            n += t.nbytes if hasattr(t, "nbytes") else len(t)
        self.bytes_in = n


_job_calls: list[Probe] = []  # while traced for a job trace: every call made, in order


def take_job_calls() -> list[tuple[str, int, int | None]]:
    """The calls made while traced: ``(key, bytes sent, bytes received)`` in the order
    they started (``torchwire.profiler`` puts them on the calls' ranges)."""
    calls = [(p.key, p.bytes_out, p.bytes_in) for p in _job_calls]
    _job_calls.clear()
    return calls


def _wall_us() -> float:
    return time.time_ns() / 1000.0


def func_name(func) -> str:
    """The function's name in an RPC key: torch's qualified name of a builtin
    (``aten::add``) or a script function, else its ``__qualname__``."""
    if isinstance(func, str):
        return func  # a method's name (RRef proxies)
    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return str(builtin)
    if isinstance(func, torch.jit.ScriptFunction):
        return str(torch._jit_internal._qualified_name(func))
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def call_name(func, args) -> tuple[str | None, str]:
    """``(mode or None, name)`` a call of ``func`` is profiled under (``PROFILE_AS``)."""
    spec = getattr(func, PROFILE_AS, None)
    if spec is None:
        return None, func_name(func)
    mode, which = spec
    return mode, func_name(args[which]) if isinstance(which, int) else which


def serve_begin(func, args, caller: str, callee: str):
    """Callee: open the range of a request it runs while the process is traced
    (``traced``); returns its handle for :func:`serve_end`."""
    key = rpc_key("serve", call_name(func, args)[1], caller, callee)
    return torch.ops.profiler._record_function_enter_new(key, None)


def serve_end(handle) -> None:
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


def rpc_key(mode: str, name: str, caller: str, callee: str) -> str:
    """torch's RPC profiling key (``rpc.internal._build_rpc_profiling_key``)."""
    return f"rpc_{mode}#{name}({caller} -> {callee})"


class Gathered:
    """Events that a thread's profiled calls brought back (absolute wall-clock
    times), waiting for the profile they belong to to parse them.

    Owned by that profile (``_torchwire_gathered``, set by :func:`_own`) and, while
    it runs, this thread's (``_local.gathered``); or by a request run under
    :func:`run_profiled`, for the calls it makes.  A call keeps the list it started
    with, so a reply that arrives after the profile stopped lands in the profile's
    own list, never in a later one's.
    """

    __slots__ = ("events", "lock")

    def __init__(self) -> None:
        self.events: list[FunctionEvent] = []
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Gathered {len(self.events)} events>"

    def add(self, events) -> None:
        with self.lock:
            self.events.extend(events)

    def take(self) -> list[FunctionEvent]:
        with self.lock:
            events, self.events = self.events, []
        return events


def _gathered() -> Gathered:
    """This thread's list; one of its own when no profile of ours runs here (a legacy
    profiler enabled by hand, parsed by ``_parse_legacy_records`` on this thread)."""
    g = getattr(_local, "gathered", None)
    if g is None:
        g = _local.gathered = Gathered()
    return g


class Profiled:
    """A profiled call's reply: the function's value and the callee's events."""

    __slots__ = ("value", "events")

    def __init__(self, value, events) -> None:
        self.value = value
        self.events = events

    def __reduce__(self):
        return Profiled, (self.value, self.events)


# ---------------------------------------------------------------------- the caller


def call(agent, to, func, args, kwargs, timeout: float, pin, sync: bool):
    """``agent.call`` with a profiler on: the call as a profiled event; returns the
    future the caller gets (complete once the call's events are recorded)."""
    mode, name = call_name(func, args)
    key = rpc_key(mode or ("sync" if sync else "async"), name, agent.name, to.name)
    out = Future()
    if torch._C._autograd._profiler_type() != _LEGACY:
        # torch.profiler: a range from send to reply, ended on whichever thread
        # completes the call (Kineto takes the end from any thread); unless this is a
        # job trace (which profiles the callee itself), the callee's events come back
        # as under the legacy profiler
        gathered = getattr(_local, "gathered", None)  # None: no profile here takes events
        ship = gathered is not None and active is enabled and enabled()
        probe = Probe(key)
        if active is _always:
            _job_calls.append(probe)
        handle = torch.ops.profiler._record_function_enter_new(key, None)
        try:
            if ship:
                raw = agent.call(to, run_profiled, (name, False, False, func, args, kwargs),
                                 None, timeout, pin, False, probe)
            else:
                raw = agent.call(to, func, args, kwargs, timeout, pin, False, probe)
        except BaseException:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
            raise

        def ended(f) -> None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
            if ship:
                try:
                    reply = torch._C.Future.value(f)
                except Exception:
                    reply = None
                if type(reply) is Profiled:
                    gathered.add(_as_remote(reply.events, key, to.id))
            _settle(f, out, ship)
        raw._add_inline_callback(ended)
        return out
    gathered = _gathered()
    start = _wall_us()
    shapes, memory = getattr(_local, "config", (False, False))
    wrapped = (name, shapes, memory, func, args, kwargs)
    raw = agent.call(to, run_profiled, wrapped, None, timeout, pin, False, Probe(key))

    def replied(f) -> None:
        end = _wall_us()
        events = [FunctionEvent(id=next(_ids), name=key, trace_name=key, thread=0,
                                start_us=start, end_us=end, node_id=agent.rank,
                                input_shapes=[], stack=[], is_legacy=True)]
        try:
            reply = torch._C.Future.value(f)
        except Exception:
            reply = None  # the call failed: its own event only
        if type(reply) is Profiled:
            events.extend(_as_remote(reply.events, key, to.id))
        gathered.add(events)
        _settle(f, out, True)
    raw._add_inline_callback(replied)
    return out


def _settle(raw, out, unwrap: bool = False) -> None:
    try:
        value = raw.wait()
    except BaseException as exc:
        out.set_exception(exc)
        return
    if unwrap and type(value) is Profiled:
        value = value.value
    out.set_result(value)


def _as_remote(events, key: str, callee: int) -> list[FunctionEvent]:
    """The callee's events as the caller's profile shows them (torch's naming)."""
    for e in events:
        e.name = f"{key}{REMOTE_OP}{e.name}"
        e.trace_name = e.name
        if e.node_id < 0:  # the callee's own; nested calls' keep their node
            e.node_id = callee
        e.is_remote = True
    return events


# ---------------------------------------------------------------------- the callee


def run_profiled(name: str, record_shapes: bool, profile_memory: bool, func, args, kwargs):
    """Callee: run ``func`` under the legacy profiler of this thread (as the caller's
    profile is set: shapes, memory); reply with its value and the events (those of
    the calls it made included), as :class:`Profiled`.

    An ``@async_execution`` function, or an internal one that replies later, replies
    once its future completes: the events of the calls it made then are in too.
    """
    outer = getattr(_local, "gathered", None), getattr(_local, "config", None)
    gathered = _local.gathered = Gathered()  # the calls made from here collect here
    _local.config = (record_shapes, profile_memory)
    profiling = _start_legacy(record_shapes, profile_memory)
    try:
        if "::" in name:  # a builtin op: its own event is the function's
            value = func(*(args or ()), **(kwargs or {}))
        else:  # a range of the function: a function without ops shows too
            with torch.autograd.profiler.record_function(name):
                value = func(*(args or ()), **(kwargs or {}))
    finally:
        _local.gathered, _local.config = outer
        events = _stop_legacy() if profiling else []
    later = value.future if type(value) is Deferred else value \
        if getattr(func, "_wrapped_async_rpc_function", None) is not None else None
    if later is None:
        return Profiled(value, events + gathered.take())
    if not isinstance(later, torch._C.Future):
        return value  # not a future after all: the serving layer reports it
    reply = Future()

    def done(f) -> None:
        try:
            result = f.wait()
        except BaseException as exc:
            reply.set_exception(exc)
            return
        reply.set_result(Profiled(result, events + gathered.take()))
    torch._C.Future.add_done_callback(later, done)
    return Deferred(reply)


def _start_legacy(record_shapes: bool, profile_memory: bool) -> bool:
    """Start the legacy profiler on this thread (False: one runs here already)."""
    if enabled():
        return False
    config = torch.autograd.ProfilerConfig(
        torch.autograd.ProfilerState.CPU, record_shapes, profile_memory, False, False, False,
        torch._C._profiler._ExperimentalConfig())
    torch.autograd._enable_profiler_legacy(config)
    return True


def _stop_legacy() -> list[FunctionEvent]:
    """Stop this thread's legacy profiler; its events, at absolute wall-clock times."""
    records = torch.autograd._disable_profiler_legacy()
    base = _profile_start_us(records)
    events = _parse(records)
    for e in events:
        e.time_range.start += base
        e.time_range.end += base
    return events


def _profile_start_us(records) -> float:
    for thread in records:
        for r in thread:
            if r.name() == "__start_profile":
                return float(r.start_us())
    return 0.0


# ---------------------------------------------------------------------- the profile


_parse = _legacy._parse_legacy_records  # torch's own, before install()


def _with_gathered(functions: list, start_us: float, g: Gathered | None) -> list:
    """``functions`` and the events ``g`` gathered since ``start_us`` (the profile's
    start, wall clock), at times relative to it as the rest."""
    if g is None:
        return functions
    added = False
    for e in g.take():
        if e.time_range.start < start_us:
            continue  # from a profile of this thread that ended before
        e.time_range.start -= start_us
        e.time_range.end -= start_us
        functions.append(e)
        added = True
    if added:
        functions.sort(key=lambda evt: [evt.time_range.start, -evt.time_range.end])
    return functions


def _parse_with_remote(thread_records):
    """``_parse_legacy_records``, and the events gathered by this thread's calls (a
    legacy profile parses as it exits, on its thread: the list is still its own)."""
    return _with_gathered(_parse(thread_records), _profile_start_us(thread_records),
                          getattr(_local, "gathered", None))


_parse_kineto = _kineto_profile._parse_kineto_results


def _parse_kineto_with_remote(self, result, *args, **kwargs):
    """torch.profiler's parse, and the events gathered by the calls of this profile
    (parsed lazily, perhaps on another thread, perhaps never: its own list)."""
    return _with_gathered(_parse_kineto(self, result, *args, **kwargs),
                          result.trace_start_ns() / 1000.0,
                          getattr(self, "_torchwire_gathered", None))


def _own(profile) -> None:
    """``profile`` has started on this thread: the calls made here until it stops
    gather into a new list of its own (a profile started again, as a scheduled one
    with ``acc_events`` is, has parsed its last list when it stopped)."""
    profile._torchwire_gathered = _local.gathered = Gathered()


def _disown(profile) -> None:
    """``profile`` has stopped: its list is no longer this thread's (it stays the
    profile's, for a parse later, and goes with it)."""
    g = getattr(profile, "_torchwire_gathered", None)
    if g is not None and getattr(_local, "gathered", None) is g:
        _local.gathered = None


_start_trace = _legacy.profile._start_trace
_exit = _legacy.profile.__exit__
_start_kineto = _kineto_profile._start_trace
_exit_kineto = _kineto_profile.__exit__


def _start_trace_noting_config(self) -> None:
    # what the callees of this thread's calls record too: shapes, memory
    _local.config = (bool(self.record_shapes), bool(self.profile_memory))
    _start_trace(self)
    _own(self)  # once started: a profile that fails to start takes nothing over


def _exit_disowning(self, *exc):
    try:
        return _exit(self, *exc)
    finally:
        _disown(self)


def _start_kineto_owning(self) -> None:
    _start_kineto(self)
    _own(self)


def _exit_kineto_disowning(self, *exc):
    try:
        return _exit_kineto(self, *exc)
    finally:
        _disown(self)


def install() -> None:
    """Let profiles take the events of calls (once per process, when RPC starts):
    wrap how a legacy profile and a torch.profiler one start (to give the profile a
    list of its own, and note a legacy one's settings), stop and parse."""
    global _installed
    with _install_lock:
        if not _installed:
            _legacy._parse_legacy_records = _parse_with_remote
            _kineto_profile._parse_kineto_results = _parse_kineto_with_remote
            _legacy.profile._start_trace = _start_trace_noting_config
            _legacy.profile.__exit__ = _exit_disowning
            _kineto_profile._start_trace = _start_kineto_owning
            _kineto_profile.__exit__ = _exit_kineto_disowning
            _installed = True
