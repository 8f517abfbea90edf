"""The janitor: one thread per process that sends the RRef protocol's control messages.

Finalizers and reader callbacks only put an :class:`~.records.Event` on a
:class:`queue.SimpleQueue` (safe from ``__del__``, never blocks); the janitor batches
what it finds per destination into one internal RPC, then sleeps ``_BATCH_DELAY`` so
that a burst of deletions costs one wake-up (no sleep while a fork waits: a request's
function may be gated on its confirmation).

Messages (:class:`~.records.ControlOp`, applied by ``handlers.rref_control``):

* FORK, to the owner, as a call: its reply confirms the fork; a timeout is retried
  (``_CONTROL_RETRIES`` times: the message is idempotent); a refusal (the value is
  gone) or a lost owner forgets the fork.  A fork the owner never confirms (every try
  timed out, or the message could not be sent or failed) is unusable: its RRef and
  the request gated on it fail with an error naming the owner and the cause
  (``RRefContext.fork_failed``).  Its parent is released (an ACCEPT), and it is
  undone at the owner (a FORGET).
* DEL and ACCEPT, as one-way requests: a lost one can only mean a lost peer.
* FORGET, one-way, instead of DEL for a fork whose FORK went more than once (retried,
  or given up on): copies of it may still be in flight, or run on the owner's pool
  after the deletion.  The owner keeps a tombstone of the fork either way, and every
  later copy meets it (a DEL leaves one only when it finds the fork unregistered).

Deletion and confirmation race (the creation reply of ``remote()`` arrives on a
reader while the RRef may die anywhere): DELETED sets ``deleted`` and then reads
``confirmed``; the creation callback sets ``confirmed`` and then reads ``deleted`` and
posts CONFIRMED.  Whichever event comes second sends the deletion, once (``gone``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from .._agent.future import add_done_callback
from .._base.errors import RpcTimeoutError, RRefError
from .handlers import rref_control
from .records import ControlOp, Event, fail_gate, gid, open_gate

log = logging.getLogger("torchwire")

_CONTROL_RETRIES = 5
_BATCH_DELAY = 0.002


class Janitor:
    """The control-message thread of one RRef context (see the module docstring)."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.put = self._events.put  # (event, ...) tuples; from anywhere, __del__ included
        self._urgent = threading.Event()  # a fork waits: do not linger before the next batch
        self._inflight = 0
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"torchwire-rref-{ctx.agent.name}")

    def __repr__(self) -> str:
        return (f"<Janitor queued={self._events.qsize()} inflight={self._inflight} "
                f"busy={self._busy} closed={self._closed}>")

    def start(self) -> None:
        self._thread.start()

    def pending(self) -> int:
        """Control messages queued or awaiting their reply (torch's
        ``num_pending_futures``)."""
        return self._events.qsize() + self._inflight

    def hurry(self) -> None:
        """A fork waits for its confirmation: send the next batch at once."""
        self._urgent.set()

    def idle(self) -> bool:
        return self._events.empty() and not self._busy and self._inflight == 0

    def settle(self, deadline: float) -> None:
        """Wait until nothing is queued or in flight (at most until ``deadline``)."""
        quiet = 0
        while quiet < 2:  # twice in a row: an event just taken off the queue shows as busy
            quiet = quiet + 1 if self.idle() else 0
            if time.monotonic() >= deadline:
                return  # the agent's own wait reports the timeout
            time.sleep(0.001)

    def close(self) -> None:
        self._closed = True
        self.put((Event.STOP,))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        events = self._events
        while True:
            try:
                first = events.get(timeout=0.5)
            except queue.Empty:
                if self._closed:
                    return
                continue
            self._busy = True
            self._urgent.clear()
            try:
                batch = [first]
                while True:
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                if self._closed:
                    return
                self._process(batch)
            except Exception:
                log.exception("torchwire: RRef control messages failed")
            finally:
                self._busy = False
            # Let the next events gather: one wake-up per batch, not per event.
            self._urgent.wait(_BATCH_DELAY)

    def _process(self, batch) -> None:
        ctx = self._ctx
        out: dict[int, list] = {}  # dest -> [(op, rref id, fork id, local state)]
        for ev in batch:
            kind = ev[0]
            if kind is Event.DELETED or kind is Event.CONFIRMED:
                state = ev[1]
                if kind is Event.DELETED:
                    state.deleted = True
                    ctx.forget_user(state)
                if state.deleted and state.confirmed and not state.gone:
                    state.gone = True
                    op = ControlOp.FORGET if state.retried else ControlOp.DEL
                    out.setdefault(state.owner, []).append(
                        (op, state.rref_id, state.fork_id, None))
            elif kind is Event.LOST:
                state = ev[1]
                state.gone = True
                ctx.forget_user(state)
            elif kind is Event.ABANDONED:
                state, parent = ev[1], ev[2]
                ctx.forget_user(state)
                if not state.gone:
                    state.gone = True
                    out.setdefault(state.owner, []).append(
                        (ControlOp.FORGET, state.rref_id, state.fork_id, None))
                if parent == ctx.rank:
                    ctx.drop_child(state.fork_id)
                else:
                    out.setdefault(parent, []).append(
                        (ControlOp.ACCEPT, None, state.fork_id, None))
            elif kind is Event.FORK:
                state, parent = ev[1], ev[2]
                out.setdefault(state.owner, []).append(
                    (ControlOp.FORK, state.rref_id, state.fork_id, (state, parent)))
            elif kind is Event.ACCEPT:
                out.setdefault(ev[1], []).append((ControlOp.ACCEPT, None, ev[2], None))
            elif kind is Event.RETRY:
                self._send_forks(ev[1], ev[2], ev[3])
        agent = ctx.agent
        for dest, ops in out.items():
            forks = [op for op in ops if op[0] is ControlOp.FORK]
            rest = [(int(op), rid, fid) for op, rid, fid, _ in ops if op is not ControlOp.FORK]
            if rest:  # deletions and accepts need no reply: a lost one means a lost peer
                try:
                    agent.notify(agent.get_worker_info(dest), rref_control, (ctx.rank, rest))
                except Exception as exc:
                    log.debug("torchwire: RRef control to rank %d not sent: %s", dest, exc)
            if forks:
                self._send_forks(dest, forks)

    def _send_forks(self, dest: int, ops: list, attempt: int = 0) -> None:
        ctx = self._ctx
        agent = ctx.agent
        wire = [(int(op), rid, fid) for op, rid, fid, _local in ops]
        timeout = agent.rpc_timeout if agent.rpc_timeout > 0 else 60.0
        with self._lock:
            self._inflight += 1
        try:
            fut = agent.call(agent.get_worker_info(dest), rref_control, (ctx.rank, wire),
                             None, timeout, bookkeeping=True)
        except Exception as exc:  # the owner left the group, or this agent shut down
            with self._lock:
                self._inflight -= 1
            log.debug("torchwire: RRef control to rank %d not sent: %s", dest, exc)
            self._failed(ops, exc)
            return
        add_done_callback(fut, lambda f: self._forks_done(f, dest, ops, attempt, timeout),
                          prompt=False)  # bookkeeping: a lent reading may keep it

    def _forks_done(self, fut, dest: int, ops: list, attempt: int, timeout: float) -> None:
        ctx = self._ctx
        try:
            fut.wait()
        except RpcTimeoutError as exc:
            for _op, _rid, _fid, (state, _parent) in ops:
                state.retried = True  # this copy may still run on the owner, late
            if attempt < _CONTROL_RETRIES and not self._closed:
                self.put((Event.RETRY, dest, ops, attempt + 1))
            else:
                log.warning("torchwire: RRef control messages to rank %d timed out %d times; "
                            "giving up", dest, attempt + 1)
                self._failed(ops, exc, tries=attempt + 1, timeout=timeout)
        except Exception as exc:
            log.debug("torchwire: RRef control messages to rank %d failed: %s", dest, exc)
            self._failed(ops, exc)
        else:
            refused = set(fut.value() or ())
            for _op, _rid, fid, (state, parent) in ops:
                if fid in refused:
                    self.put((Event.LOST, state))
                    fail_gate(state, RRefError(
                        f"RRef {gid(state.rref_id)} cannot be used: its owner, worker "
                        f"{ctx.agent.name_of(state.owner)} (rank {state.owner}), refused "
                        f"fork {gid(fid)}: the value was already deleted"))
                    continue
                state.confirmed = True
                open_gate(state)
                self.put((Event.CONFIRMED, state))
                if parent == ctx.rank:
                    ctx.drop_child(state.fork_id)
                else:
                    self.put((Event.ACCEPT, parent, state.fork_id))
        finally:
            with self._lock:
                self._inflight -= 1

    def _failed(self, ops: list, exc: BaseException, tries: int = 0,
                timeout: float = 0.0) -> None:
        """The owner will never confirm these forks: ``exc`` is why (the last of
        ``tries`` timeouts of ``timeout`` seconds each, or the failure)."""
        ctx = self._ctx
        for _op, _rid, fid, (state, parent) in ops:
            if tries:
                cause: BaseException = RpcTimeoutError(
                    f"it did not confirm fork {gid(fid)}: the FORK message timed out "
                    f"{tries} times ({timeout:g} s each; the last: {exc})")
            else:
                cause = exc
            ctx.fork_failed(state, cause)
            self.put((Event.ABANDONED, state, parent))
