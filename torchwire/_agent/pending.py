"""Calls sent and waiting for their replies: request id -> :class:`PendingCall`.

**Whoever pops an entry owns it.**  A call ends exactly once, by whichever of these
pops its entry from the table first: the reader with its reply, the timer at its
deadline, the loss of its peer or connection, shutdown.  Only the popper completes
the call's future; everyone else finds nothing and does nothing (a reply that comes
after the deadline is dropped quietly).

One call::

    (not in the table) --add: stored, then its deadline armed--> PENDING
    PENDING --reply popped it-->        DONE (value, or the remote error)
    PENDING --timer popped it-->        DONE (RpcTimeoutError)
    PENDING --fail popped it-->         DONE (WorkerUnavailableError, RpcStateError)

A caller may complete an ``rpc_async`` future itself (torch's futures allow
``set_result``); the popper then finds it done and drops what it had, logged at
debug level: neither the reader nor the timer's other expiries are disturbed.

The entry is stored before its deadline is armed, so a deadline that passes at once
finds it (armed first, the timer could fire in between and lose the call).  A reply
is decoded while its call still counts as pending, so what unpickling starts (RRef
fork messages) is visible to shutdown's termination detection before the count
drops; it is popped only then.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from .. import _serialization as ser
from .._base.errors import ProtocolError, RpcTimeoutError, SerializationError
from .._wire import frame as F
from .metrics import CallMetrics
from .timer import DeadlineTimer

_perf = time.perf_counter_ns
_IDLE_SCAN_MAX = 8  # idle_on() looks through at most this many pending calls
log = logging.getLogger("torchwire")


class PendingCall:
    """One call waiting for its reply."""

    __slots__ = ("future", "tick", "peer", "conn", "timeout", "func", "pin", "t0", "probe")

    def __init__(self, future, peer: int, conn, timeout: float, func, pin) -> None:
        self.future = future  # a Future, or a SyncReply for a caller that waits at once
        self.tick = None  # the timer bucket of its deadline (None: no deadline)
        self.peer = peer  # the rank it went to
        self.conn = conn  # the connection it went on
        self.timeout = timeout  # seconds, for the timeout's message
        self.func = func  # what it calls, for the timeout's message
        self.pin = pin  # kept alive until the call ends (what pickling pinned, RRefs)
        self.t0 = _perf()  # when it was sent, for its latency (metrics.py)
        self.probe = None  # a profiled call's Probe: told the reply's size

    def __repr__(self) -> str:
        return f"<PendingCall to rank {self.peer}: {func_name(self.func)}>"


class PendingCalls:
    """The table of calls waiting for replies, and the timer of their deadlines.

    Args:
        name_of: ``name_of(rank)``, a worker's name for error messages.
        metrics: the per-peer :class:`~.metrics.CallMetrics` every ended call is
            counted in (latency of replies, errors, timeouts).
    """

    def __init__(self, name_of, metrics: CallMetrics | None = None) -> None:
        self._name_of = name_of
        self.metrics = metrics if metrics is not None else CallMetrics()
        self._table: dict[int, PendingCall] = {}
        self._rids = itertools.count(1)
        self._timer = DeadlineTimer(self._expire)
        self._idle = threading.Condition(threading.Lock())
        self._draining = False  # someone waits for the table to empty (wait_idle)

    def __repr__(self) -> str:
        return f"<PendingCalls {len(self._table)} pending>"

    def __len__(self) -> int:
        return len(self._table)

    def add(self, future, peer: int, conn, timeout: float, func, pin,
            deadline: float | None = None, probe=None) -> int:
        """Store a call (before it is sent); returns its request id.  Its deadline is
        ``deadline`` if given (the call's start + ``timeout``: connecting counted), else
        ``timeout`` from now (``timeout`` <= 0: none)."""
        rid = next(self._rids)
        # PendingCall(...) without its __init__: a Python call less on every call's path
        call = _new(PendingCall)
        call.future, call.tick, call.peer, call.conn = future, None, peer, conn
        call.timeout, call.func, call.pin, call.t0 = timeout, func, pin, _perf()
        call.probe = probe
        self._table[rid] = call
        try:
            if deadline is not None:
                call.tick = self._timer.add(rid, deadline)
            elif timeout > 0:
                call.tick = self._timer.add(rid, time.monotonic() + timeout)
        except BaseException:  # no call may stay pending without its deadline
            del self._table[rid]
            raise
        return rid

    def fail(self, rid: int, exc: BaseException) -> None:
        """End call ``rid`` with ``exc``, if it is still pending."""
        call = self._table.pop(rid, None)
        if call is None:
            return
        if call.tick is not None:
            self._timer.cancel(rid, call.tick)
        self.metrics.failed(call.peer, exc)
        _settle(call.future, None, exc)
        self._note_idle()

    def fail_where(self, exc: BaseException, peer: int | None = None, conn=None) -> None:
        """End with ``exc`` every pending call to ``peer``, or sent on ``conn``, or (both
        None) every pending call."""
        for rid, call in list(self._table.items()):
            if (peer is None or call.peer == peer) and (conn is None or call.conn is conn):
                self.fail(rid, exc)

    def to_peer(self, peer: int) -> bool:
        """Whether some call to ``peer`` is pending."""
        return any(call.peer == peer for call in list(self._table.values()))

    def idle_on(self, conn) -> bool:
        """Whether no call sent on ``conn`` is pending (False when many calls are:
        not worth the look)."""
        table = self._table
        if len(table) > _IDLE_SCAN_MAX:
            return False
        for call in list(table.values()):
            if call.conn is conn:
                return False
        return True

    def complete(self, rid: int, flags: int, payload, tensors) -> bool:
        """Reader thread: the reply of call ``rid`` (dropped if the call is over).

        Returns:
            whether it completed a reply whose waiter may read its next reply itself
            (``lends``: the connection may lend its reading, ``lending.py``).
        """
        call = self._table.get(rid)
        if call is None:
            return False  # reply to a call that already timed out: dropped quietly
        if call.probe is not None:
            call.probe.replied(payload, tensors)
        if flags & F.F_ERROR:
            value, error = None, ser.loads_exception(payload)
        elif flags & F.F_PLAIN:
            try:
                value, error = ser.plain_value(payload, tensors), None
            except ProtocolError as exc:
                value, error = None, SerializationError(
                    f"cannot decode the reply from {self._name_of(call.peer)}: {exc}")
        else:
            try:
                value, error = ser.loads(payload, tensors), None
            except SerializationError as exc:
                value, error = None, SerializationError(
                    f"cannot decode the reply from {self._name_of(call.peer)}: {exc}")
        if self._table.pop(rid, None) is None:
            return False  # timed out while decoding
        if call.tick is not None:
            self._timer.cancel(rid, call.tick)
        self.metrics.replied(id(call.conn), call.peer, _perf() - call.t0, error)
        if error is not None:
            _settle(call.future, None, error)
        else:
            try:
                call.future.set_result(value)
            except Exception:  # (_settle, inlined: every reply's path)
                _settled_elsewhere(call.future)
        if self._draining:
            self._note_idle()
        return call.future.lends

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no call is pending; False if ``deadline`` passed first."""
        with self._idle:
            self._draining = True
            while self._table:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def stop(self) -> None:
        """Stop the timer (the agent is closed; fail what is left with ``fail_where``)."""
        self._timer.stop()

    def _note_idle(self) -> None:
        if self._draining and not self._table:
            with self._idle:
                self._idle.notify_all()

    def _expire(self, rids) -> None:
        """Timer thread: these calls' deadlines passed."""
        for rid in rids:
            call = self._table.pop(rid, None)
            if call is None:
                continue
            err = self.timeout_error(call.peer, call.timeout, call.func)
            self.metrics.failed(call.peer, err, timeout=True)
            _settle(call.future, None, err)
        self._note_idle()

    def timeout_error(self, peer: int, timeout: float, func, detail: str = "",
                      ) -> RpcTimeoutError:
        """The error of a call to ``peer`` whose ``timeout`` passed (torch's words)."""
        more = f"; {detail}" if detail else ""
        return RpcTimeoutError(
            f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be "
            f"marked with an error (call to {self._name_of(peer)}: {func_name(func)}{more})")


_new = object.__new__


def _settle(fut, value, error: BaseException | None) -> None:
    """Complete a call's future; one that is already done stays as it is.

    torch's futures may be completed by anyone holding them (``fut.set_result``), so
    the user may have ended an ``rpc_async`` future before its reply or deadline:
    that must neither break the reader nor stop the timer's other expiries."""
    try:
        if error is None:
            fut.set_result(value)
        elif not fut.done():  # torch's set_exception would change how a done one unwraps
            fut.set_exception(error)
        else:
            _settled_elsewhere(fut)
    except Exception:
        _settled_elsewhere(fut)


def _settled_elsewhere(fut) -> None:
    """Completing ``fut`` failed: fine if it was done already, else log it."""
    if fut.done():
        log.debug("torchwire: the result of a call whose future was already completed "
                  "was dropped")
    else:
        log.exception("torchwire: completing a call's future failed")


def func_name(func) -> str:
    """``module.qualname`` of a called function, for messages."""
    mod = getattr(func, "__module__", None)
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{mod}.{qual}" if mod else str(qual)
