"""Distributed autograd contexts: one record per (worker, context id).

A context id is ``rank << 48 | counter`` (torch's layout), so ids made on
different workers never collide.  The worker that opens ``context()`` owns the
id; every other worker creates its record of the id when a request carrying it
arrives.  A record holds:

* ``sends``: send id -> the tensor this worker sent (requiring grad) in a message
  of the context; the distributed backward pass restarts the local engine there
  when the receiver sends back the tensor's gradient.  Holding the tensor keeps
  its graph alive until the context is released.
* ``grads``: leaf tensor -> its gradient accumulated in this context (``.grad``
  is never touched).
* ``known``: ranks this worker sent requests of the context to: the release
  follows these edges.

Release (torch's protocol): leaving ``with context()`` drops the owner's record
and sends a one-way "release" to every known worker, which drops its record and
forwards the release to *its* known workers.  A released foreign id leaves a
tombstone, so a message of the context that arrives late (an ``rpc_async`` never
waited for) does not recreate the record; an id of this worker that is not live
is finished for good (ids are never reused).
"""

from __future__ import annotations

import itertools
import logging
import marshal
import sys
import threading

import torch
import torch._prims_common as _prims

from .. import _serialization as ser
from .._agent.agent import AgentState
from .._agent.runtime import current
from .._base.errors import (DistAutogradError, ProtocolError, WorkerUnavailableError,
                            not_initialized)
from .kinds import AutogradKind

log = logging.getLogger("torchwire")

_ID_BITS = 48
_MAX_LOCAL_ID = (1 << _ID_BITS) - 1
_TOMBSTONES_MAX = 100_000
_INCARNATION_SHIFT = 40  # incarnation N's local ids start at N << 40 (as RRef ids)


class DistAutogradContext:
    """One worker's record of a distributed autograd context."""

    __slots__ = ("id", "lock", "sends", "grads", "known", "recvs", "forwarded", "ddp",
                 "failed", "spent",
                 "__weakref__")

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, torch.Tensor] = {}
        # id(leaf) -> (leaf, gradient): keyed by id, as Tensor.__hash__ is a Python call
        # (two with its helper; microseconds with the caches cold)
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.known: set[int] = set()
        self.recvs = 0
        # backward passes of other roots this worker sent gradients on in:
        # pass key -> ranks (if one is lost, the root must hear of it from here)
        self.forwarded: dict[tuple, set[int]] = {}
        # DDP parameters whose .grad this context holds (``ddp.Lent``), or None
        self.ddp = None
        # a worker it reached was lost (WorkerUnavailableError): a backward pass in
        # it raises that at once (the worker's part of the graph is gone)
        self.failed: BaseException | None = None
        # grad_fn of roots whose pass ran without retain_graph while send entries kept
        # the graph anyway (backward.py): another pass from them is torch's error
        self.spent: set | None = None

    # torch's DistAutogradContext methods
    def _context_id(self) -> int:
        return self.id

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known)

    def _send_functions(self) -> dict[int, torch.Tensor]:
        with self.lock:
            return dict(self.sends)

    def _num_recv_functions(self) -> int:
        return self.recvs

    def grad_table(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of ``grads`` (``id(leaf) -> (leaf, gradient)``), with the gradients
        DDP's reducer holds in ``.grad`` moved in first (``ddp.Lent.settle``)."""
        if self.ddp is not None:
            self.ddp.settle(self)
        with self.lock:
            return dict(self.grads)

    def accumulate(self, pairs: list) -> None:
        """Add one local pass's ``(leaf, grad)`` pairs into the context's gradients.

        ``pairs`` is a list the caller gives away (its tuples hold the only references
        the caller has).  As torch's AccumulateGrad, a first gradient is kept as is
        only when nothing else can reach it (no other reference to the tensor, which
        also catches one tensor handed to two leaves) and it is laid out as the leaf;
        otherwise it is copied.  Later ones are added out of place (the caller may
        hold the tensor ``get_gradients`` returned).
        """
        with self.lock:
            grads = self.grads
            for leaf, g in pairs:
                key = id(leaf)  # the entry holds the leaf: the id stays its own
                old = grads.get(key)
                if old is not None:
                    grads[key] = (leaf, old[1] + g)
                # 3 references: the pair, ``g`` and getrefcount's argument
                elif sys.getrefcount(g) <= 3 and g._use_count() <= 1 and \
                        _keeps_layout(g, leaf):
                    grads[key] = (leaf, g)
                else:
                    grads[key] = (leaf, _copy_for(g, leaf))

    def __repr__(self) -> str:
        return (f"<DistAutogradContext id={self.id} (worker {self.id >> _ID_BITS}) "
                f"sends={len(self.sends)} recvs={self.recvs} grads={len(self.grads)} "
                f"known_workers={sorted(self.known)}>")


def _keeps_layout(g: torch.Tensor, leaf: torch.Tensor) -> bool:
    """torch's layout contract for a stored gradient: dense ones strided as the leaf
    (when the leaf is dense and non-overlapping) or contiguous; sparse ones with
    contiguous indices and values."""
    if g.is_sparse:
        return g._indices().is_contiguous() and g._values().is_contiguous()
    if g.layout is not torch.strided:
        return False
    if g.is_contiguous() and leaf.is_contiguous():  # the common case, at once
        return True
    if leaf.layout is torch.strided and _dense(leaf):
        return all(gs == ls if n != 1 else gs != 0
                   for n, gs, ls in zip(g.shape, g.stride(), leaf.stride()))
    return g.is_contiguous()


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or \
        _prims.is_non_overlapping_and_dense(t)


def _copy_for(g: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    if g.is_sparse or g.layout is not torch.strided:
        return g.clone()
    if leaf.layout is torch.strided and _dense(leaf) and g.shape == leaf.shape:
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=g.dtype,
                                   device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


def not_found(context_id) -> DistAutogradError:
    # torch's phrase: its tests and ported error handling match on it
    return DistAutogradError(f"Could not find autograd context with id: {context_id} (it was "
                        "never opened here, or its `with dist_autograd.context()` block has "
                        "exited)")


class ContextContainer:
    """Every context record of this worker (one container per RPC agent)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.rank = agent.rank
        self._lock = threading.Lock()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._tombstones: dict[int, None] = {}
        # a restarted worker's ids must not meet its predecessors' (tombstones elsewhere)
        self._next = itertools.count(agent.incarnation << _INCARNATION_SHIFT)
        self._send_ids = itertools.count(1)
        self.backward_passes = 0
        # backward passes rooted here: (rank, serial) -> _backward._Pass
        self.passes: dict = {}
        self.pass_ids = itertools.count(1)
        self.pass_messages = 0  # backward messages sent: gradients and separate reports

    def __repr__(self) -> str:
        return (f"<ContextContainer rank={self.rank} contexts={len(self._contexts)} "
                f"backward_passes={self.backward_passes}>")

    def max_id(self) -> int:
        return (self.rank << _ID_BITS) + _MAX_LOCAL_ID

    # ------------------------------------------------------------------ lookup

    def new_context(self) -> DistAutogradContext:
        local = next(self._next)
        if local > _MAX_LOCAL_ID:
            raise DistAutogradError("distributed autograd context ids are exhausted on this "
                                    "worker")
        ctx = DistAutogradContext((self.rank << _ID_BITS) | local)
        with self._lock:
            self._contexts[ctx.id] = ctx
        return ctx

    def get(self, context_id: int) -> DistAutogradContext:
        """The live record of ``context_id``.

        Raises:
            DistAutogradError: torch's "Could not find autograd context with id".
        """
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise not_found(context_id)
        return ctx

    def find(self, context_id: int) -> DistAutogradContext | None:
        return self._contexts.get(context_id)

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        """The record of a context this worker takes part in, created on first use.

        A context already released here (or a finished id of this worker) gets a
        record that is not kept: whatever is recorded in it dies with it.
        """
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            return ctx
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                ctx = DistAutogradContext(context_id)
                if context_id >> _ID_BITS != self.rank and context_id not in self._tombstones:
                    self._contexts[context_id] = ctx
            return ctx

    def record_send(self, context_id: int, t: torch.Tensor) -> int:
        sid = next(self._send_ids)
        ctx = self.get_or_create(context_id)
        with ctx.lock:
            ctx.sends[sid] = t
        return sid

    def note_worker(self, context_id: int, rank: int) -> None:
        if rank == self.rank:
            return
        ctx = self.get_or_create(context_id)
        if rank not in ctx.known:
            with ctx.lock:
                ctx.known.add(rank)

    # ------------------------------------------------------------------ release

    def release(self, context_id: int, forward: bool = True,
                source: int | None = None) -> DistAutogradContext | None:
        """Drop the record of ``context_id`` here; tell the workers it reached, but
        ``source``, the worker whose release this is (it has dropped its record)."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            if context_id >> _ID_BITS != self.rank:
                self._tombstones[context_id] = None
                while len(self._tombstones) > _TOMBSTONES_MAX:
                    self._tombstones.pop(next(iter(self._tombstones)))
        if ctx is not None and ctx.ddp is not None:
            ctx.ddp.settle(ctx)  # the user's .grad of DDP's parameters comes back
        if ctx is not None and forward:
            with ctx.lock:
                known = sorted(ctx.known - {source})
            payload = _RELEASE_BYTE + marshal.dumps(context_id)
            for rank in known:
                try:
                    self.agent.notify_plain(rank, payload)
                except Exception as exc:  # the worker is gone: nothing left to free
                    log.debug("torchwire: release of autograd context %d on rank %d not "
                              "sent: %s", context_id, rank, exc)
        return ctx

    def lost(self, rank: int, error: BaseException) -> tuple[int, int]:
        """Worker ``rank`` was lost (died, restarted, left): contexts it opened are
        released here (it will never release them; the release goes on to the workers
        this one reached), and contexts this worker sent requests of to it fail every
        backward pass from now on (its part of their graph is gone).

        Returns:
            ``(released, failed)`` counts.
        """
        with self._lock:
            contexts = list(self._contexts.values())
        released = failed = 0
        for ctx in contexts:
            if ctx.id >> _ID_BITS == rank:
                self.release(ctx.id, source=rank)
                released += 1
            elif rank in ctx.known and ctx.failed is None:
                name = getattr(error, "worker_name", None) or f"<rank {rank}>"
                why = getattr(error, "reason", None) or str(error)
                ctx.failed = WorkerUnavailableError(
                    f"distributed autograd context {ctx.id} reached worker {name} (rank "
                    f"{rank}), which is unavailable: {why}; its part of the graph is gone, "
                    "so no backward pass can run in this context (open a new one)",
                    worker_name=name, reason=why)
                with ctx.lock:
                    ctx.sends.clear()  # their graphs ended on that worker
                failed += 1
        return released, failed

    def forwarded_to(self, rank: int) -> list[tuple]:
        """Keys of the passes of other roots this worker sent gradients on in, to ``rank``."""
        with self._lock:
            contexts = list(self._contexts.values())
        keys = []
        for ctx in contexts:
            with ctx.lock:
                keys += [k for k, dests in ctx.forwarded.items() if rank in dests]
        return keys

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            contexts = list(self._contexts.values())
            tombstones = len(self._tombstones)
        return {
            "num_autograd_contexts": len(contexts),
            "num_current_backward_passes": self.backward_passes,
            "num_send_entries": sum(len(c.sends) for c in contexts),
            "num_recv_functions": sum(c.recvs for c in contexts),
            "num_tombstones": tombstones,
            "num_backward_messages_sent": self.pass_messages,
        }


def container() -> ContextContainer:
    """This runtime's container.

    Raises:
        RpcStateError: RPC is not initialized.
    """
    rt = current.runtime  # (inlined require_runtime: this is on every message's path)
    if rt is None or rt.agent.state is _CLOSED:
        raise not_initialized()
    return rt.autograd


_CLOSED = AgentState.CLOSED


_RELEASE_BYTE = bytes([AutogradKind.RELEASE])


def _on_release(src: int, payload: bytes, tensors) -> None:
    """Plain message: the context ended on the worker that sent it here."""
    context_id = ser.plain_body(payload)
    if type(context_id) is not int:
        raise ProtocolError(f"malformed context release from rank {src}")
    container().release(context_id, source=src)


ser.hooks.register_plain(AutogradKind.RELEASE, handler=_on_release)
