"""The distributed backward pass (torch's FAST mode).

``backward(C, roots)`` on worker W::

    local pass:  torch.autograd.backward(roots, ones, inputs=leaves + [anchor])
                 leaves = every AccumulateGrad variable under the roots; a pre-hook
                 on each AccumulateGrad node takes the gradient into C's record
                 (none reaches .grad; the leaves' and nodes' hooks run).  Each recv node reached
                 hands its (engine-summed) gradient to the pass.
    fan out:     for each worker S that sent a tensor reached: one one-way request
                 _backward_hop(C, pass, weight, [(send id, grad), ...]) to S
    on S:        a local pass from those send entries with those gradients,
                 then the same fan-out
    W returns when every part of the pass has finished (weight-throwing
    termination, see :class:`_Pass`): each part reports to W how it split the
    weight it got among the workers it sent gradients to, or hands it back
    when it sent none; a report to W rides on the gradients when they go
    there.  A chain W -> S -> W -> S costs its three messages and one report
    back, not three replies that unwind the chain.

A failure anywhere travels to W in a report (the failing node's rank, name,
error type, message and traceback), so W raises one error naming the node
where it happened: ``Error on Node <rank>: <message>`` (torch's words) and the
worker's name.  W also fails the pass when a worker that holds part of it is
lost, and when the pass made no progress for the RPC timeout.

A send entry may be reached again by a later pass (another path through the
cycle, or ``retain_graph=True`` on the roots), so passes from send entries keep
their graph (``retain_graph=True``); it is freed when the context is released.
The root pass frees its graph unless asked to retain it, or this worker has send
entries in the context (a later pass from one of them may cross the same nodes).
"""

from __future__ import annotations

import logging
import marshal
import threading
import time
import traceback

import torch

from .. import _serialization as ser
from .._base import threads
from .._base.errors import (DistAutogradError, ProtocolError, RemoteError, RpcStateError,
                            RpcTimeoutError, WorkerUnavailableError)
from .._agent.profiling import scope
from .context import ContextContainer, DistAutogradContext, container
from .kinds import AutogradKind
from . import ddp as _ddp
from .engine import _local_pass

log = logging.getLogger(__name__)


def _failure(rank: int, exc: BaseException, tb: str | None = None, agent=None) -> tuple:
    agent = agent if agent is not None else container().agent
    name = agent.name_of(rank)
    return (rank, name, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc),
            tb if tb is not None else "".join(traceback.format_exception(exc)))


# The weight a pass starts with.  Splitting among k workers gives each w // k (the
# first ones one more, so nothing is lost); only fan-outs use it up, by log2(k)
# bits each: a pass would have to branch 1024 times in a row to run out.
_WHOLE = 1 << 1024


class _Done:
    """``threading.Event`` for the root's wait on a pass: a raw lock, released once by
    whoever ends the pass (under the pass's lock).  An Event's ``set`` and ``wait`` run
    a Condition's Python code, microseconds each with the caches cold, on the path
    from the last report to ``backward`` returning."""

    __slots__ = ("_lock", "flag")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.flag = False

    def set(self) -> None:
        if not self.flag:
            self.flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        if self.flag:
            return True
        if self._lock.acquire(True, -1 if timeout is None else timeout):
            self._lock.release()  # (another waiter, if any, goes on too)
        return self.flag


class _Pass:
    """The root's record of one distributed backward pass (weight-throwing termination).

    The pass starts with weight ``_WHOLE`` on the root.  A worker that runs part of
    it splits the weight it got among the workers it sends gradients to, and
    reports the move to the root: ``(its rank, its weight, [(child, weight), ...])``;
    a part that sends nothing hands its weight back that way.  ``held`` is the
    root's view of who holds weight; the pass is over when nobody does.  Reports
    may arrive in any order (a child's before its parent's): an entry may go
    negative meanwhile, and the pass is over only when every entry is zero.
    """

    __slots__ = ("held", "failure", "done", "lock", "progress")

    def __init__(self, root: int) -> None:
        self.held: dict[int, int] = {root: _WHOLE}
        self.failure: tuple | None = None
        self.done = _Done()
        self.lock = threading.Lock()
        self.progress = time.monotonic()

    def move(self, report, failure, agent) -> None:
        """Apply a report (None: a failure only)."""
        lost = None
        with self.lock:
            if report is not None:
                src, weight, children = report
                held = self.held
                w = held.get(src, 0) - weight
                if w:
                    held[src] = w
                else:
                    del held[src]
                for dest, weight in children:
                    w = held.get(dest, 0) + weight
                    if w:
                        held[dest] = w
                        if w > 0 and lost is None and agent.health.is_down(dest):
                            lost = dest  # reported after that worker was lost here
                    else:
                        del held[dest]
            self.progress = time.monotonic()
            if failure is not None and self.failure is None:
                self.failure = failure
            if self.failure is not None or not self.held:
                self.done.set()
        if lost is not None:
            self.lost(lost, lambda: _failure(lost, agent.unavailable(lost, "it is gone"), "",
                                             agent))

    def lost(self, rank: int, failure) -> None:
        """Worker ``rank`` is gone (``failure()`` builds the error): the pass fails if
        that worker holds weight."""
        with self.lock:
            if self.failure is None and self.held.get(rank, 0) > 0:
                self.failure = failure()
                self.done.set()

    def abort(self, failure: tuple) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = failure
            self.done.set()


def _split(weight: int, dests) -> list[tuple[int, int]]:
    k = len(dests)
    share, extra = divmod(weight, k)
    if share == 0:
        raise DistAutogradError("the distributed backward pass branched too often to track "
                           f"(its weight ran out at a fan-out to {k} workers)")
    return [(d, share + (i < extra)) for i, d in enumerate(dests)]


def _forward(c, ctx: DistAutogradContext, key: tuple, weight: int, outgoing: dict) -> None:
    """Send this part's gradients on, splitting ``weight`` among the workers they go
    to, and report the move to the root.  The report rides on the gradients when
    some go to the root; the root applies its own before sending (a thread that
    sends may wait for a CPU afterwards: its peer's thread, woken, can take it)."""
    root = key[0]
    by_dest: dict[int, list] = {}
    for (src, sid), g in outgoing.items():
        by_dest.setdefault(src, []).append((sid, g))
    try:
        shares = _split(weight, list(by_dest)) if by_dest else []
    except DistAutogradError as exc:
        _report(c, key, (c.rank, weight, []), _failure(c.rank, exc))
        return
    report = (c.rank, weight, shares)
    if root == c.rank or not by_dest:
        _report(c, key, report, None)
        if not by_dest:
            return
        report = None
    carried = root in by_dest and root != c.rank
    if root != c.rank:
        with ctx.lock:
            ctx.forwarded.setdefault(key, set()).update(by_dest)
    failure = None
    agent = c.agent
    for dest, share in shares:
        # counted before it goes: the pass may end before the write returns
        c.pass_messages += 1  # (racy by a count at worst, between threads)
        try:
            _send_grads(agent, dest, ctx.id, key, share, by_dest[dest],
                        report if carried and dest == root else None)
        except Exception as exc:  # the worker is gone or cut off
            c.pass_messages -= 1
            if failure is None:
                failure = _failure(dest, exc, "")
    if carried:
        report = None
    if report is not None or failure is not None:
        _report(c, key, report, failure)


def _report(c, key: tuple, report, failure) -> None:
    if key[0] == c.rank:
        _move(c, key, report, failure)
        return
    agent = c.agent
    c.pass_messages += 1
    try:
        try:
            payload = _REPORT_BYTE + marshal.dumps((key, report, failure))
        except ValueError:  # (not expected: ints and strings)
            agent.notify(agent.get_worker_info(key[0]), _apply_report, (key, report, failure))
        else:
            agent.notify_plain(key[0], payload)
    except Exception as exc:  # the root is gone: nobody waits for this pass
        c.pass_messages -= 1
        log.debug("torchwire: report of backward pass %s not sent: %s", key, exc)


# The pass's messages are plain (not pickled, ``RpcAgent.notify_plain``): a marshal of
# ints (and a failure's strings), and the gradients as the message's buffers.
_GRADS_BYTE = bytes([AutogradKind.GRADS])
_REPORT_BYTE = bytes([AutogradKind.REPORT])


def _send_grads(agent, dest: int, context_id: int, key: tuple, weight: int, items,
                report) -> None:
    """``_backward_hop(context_id, key, weight, items, report)`` on worker ``dest``:
    plain when every gradient can go as is, else pickled (sparse, on a device...)."""
    metas = []
    for sid, g in items:
        meta = ser.plain_meta(g)
        if meta is None:
            agent.notify(agent.get_worker_info(dest), _backward_hop,
                         (context_id, key, weight, items, report))
            return
        metas.append((sid, meta[0], meta[1]))
    agent.notify_plain(dest, _GRADS_BYTE + marshal.dumps((context_id, key, weight, metas,
                                                          report)),
                       [g for _, g in items])


def _on_grads(src: int, payload: bytes, tensors) -> None:
    context_id, key, weight, metas, report = ser.plain_body(payload, 5)
    if len(metas) != len(tensors):
        raise ProtocolError(f"gradients message with {len(metas)} entries and "
                                f"{len(tensors)} buffers")
    items = [(sid, ser.plain_tensor(raw, code, shape))
             for (sid, code, shape), raw in zip(metas, tensors)]
    _backward_hop(context_id, key, weight, items, report)


def _on_report(src: int, payload: bytes, tensors) -> None:
    key, report, failure = ser.plain_body(payload, 3)
    _apply_report(key, report, failure)


ser.hooks.register_plain(AutogradKind.GRADS, handler=_on_grads)
ser.hooks.register_plain(AutogradKind.REPORT, handler=_on_report)


def _apply_report(key: tuple, report, failure) -> None:
    """One-way request, on the root: a part of pass ``key`` moved its weight on,
    finished, or failed."""
    _move(container(), key, report, failure)


def _move(c, key: tuple, report, failure) -> None:
    """On the root: apply a report to pass ``key``; one for a finished pass is dropped."""
    rec = c.passes.get(key)
    if rec is not None:
        rec.move(report, failure, c.agent)


def _part(c, ctx: DistAutogradContext, key: tuple, weight: int, outputs, grads,
          retain: bool) -> None:
    """One worker's part of pass ``key``: a local pass, then the gradients go on."""
    with c._lock:
        c.backward_passes += 1
    try:
        try:
            with scope("torchwire::autograd::local_pass"):
                outgoing = _local_pass(ctx, outputs, grads, retain)
        except Exception as exc:
            _report(c, key, (c.rank, weight, []), _failure(c.rank, exc))
            return
        with scope("torchwire::autograd::send_gradients"):
            _forward(c, ctx, key, weight, outgoing)
    finally:
        with c._lock:
            c.backward_passes -= 1


def _backward_hop(context_id: int, key: tuple, weight: int, items, report) -> None:
    """One-way request: continue pass ``key`` from this worker's send entries,
    holding ``weight`` of it; ``report``: the sender's report, when this is the root."""
    c = container()
    if report is not None:
        _move(c, key, report, None)
    try:
        ctx = c.get(context_id)
        with ctx.lock:
            outputs = [ctx.sends[sid] for sid, _ in items]
    except Exception as exc:
        if isinstance(exc, KeyError):
            exc = DistAutogradError(f"autograd context {context_id} has no send entry {exc} "
                                    "here")
        _report(c, key, (c.rank, weight, []), _failure(c.rank, exc))
        return
    _part(c, ctx, key, weight, outputs, [_matching(o, g) for o, (_, g) in zip(outputs, items)],
          True)


def _matching(output: torch.Tensor, grad):
    """``grad`` as autograd takes it for ``output``.  A jagged nested gradient arrives
    with offsets of its own, whose ragged size (a symbolic ``j<n>``) autograd would
    take for another than its output's: it is rebuilt over the output's offsets."""
    if type(grad) is torch.Tensor or not isinstance(grad, torch.Tensor) \
            or grad.layout is not torch.jagged or output.layout is not torch.jagged \
            or not torch.equal(grad.offsets(), output.offsets()):
        return grad
    return torch.nested.nested_tensor_from_jagged(
        grad.values(), output.offsets(), output.lengths(), jagged_dim=output._ragged_idx)


def _check_roots(roots) -> list[torch.Tensor]:
    if not isinstance(roots, (list, tuple)) or \
            not all(isinstance(t, torch.Tensor) for t in roots):
        raise TypeError("backward(): incompatible function arguments: roots must be a list "
                        f"of tensors, got {type(roots).__name__}")
    if not roots:
        raise DistAutogradError("No tensors provided for gradient computation.")
    for i, t in enumerate(roots):
        if not t.requires_grad:
            raise DistAutogradError(f"requires_grad not set on root tensor {i}")
        if t.numel() != 1:
            raise DistAutogradError(f"Tensor {i} of shape {tuple(t.shape)} is not a scalar, "
                                    "all roots need to be scalar")
        if t.grad_fn is None:
            raise DistAutogradError(f"Tensor {i} does not have a valid gradient function "
                                    "(it is a leaf)")
    return list(roots)


_SECOND_TIME = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward.")


def _spend(ctx: DistAutogradContext, roots: list, record: bool) -> None:
    """A pass from ``roots`` without ``retain_graph`` keeps their graph only for this
    worker's send entries: a later pass from the same roots raises torch's error, as
    it would had the graph been freed, instead of adding the gradients again.
    ``record``: this pass is one of those."""
    with ctx.lock:
        spent = ctx.spent
        if spent is not None and any(r.grad_fn in spent for r in roots):
            raise DistAutogradError(f"Error on Node {container().rank}: {_SECOND_TIME}")
        if record:
            if spent is None:
                spent = ctx.spent = set()
            spent.update(r.grad_fn for r in roots)


def backward(context_id: int, roots, retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` in context ``context_id``.

    The pass reaches every worker that sent or received, in this context, a
    tensor the roots depend on; gradients of leaves accumulate in the context on
    the worker where each leaf lives (read them with :func:`get_gradients`),
    never in ``.grad``.  Returns when every worker reached has finished.

    Args:
        context_id: the id ``with torchwire.autograd.context()`` gave.
        roots: scalar tensors to differentiate (a gradient of 1 each).
        retain_graph: keep the local graph of the roots for another backward.

    Raises:
        TypeError: ``context_id`` is not an int or ``roots`` not a list of tensors.
        DistAutogradError: no such context here ("Could not find autograd context
            with id"), a root is not a scalar, does not require grad or is a leaf; or
            the pass failed on this worker: "Error on Node <rank>: <error>", with
            the worker's name.
        RemoteError: the pass failed on another worker (the same message).
        WorkerUnavailableError: the pass had to reach a worker that is gone or cut
            off; the error names it.

    Example::

        >>> with torchwire.autograd.context() as ctx:
        ...     t1 = torch.rand(3, requires_grad=True)
        ...     loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, 2)).sum()
        ...     torchwire.autograd.backward(ctx, [loss])
        ...     torchwire.autograd.get_gradients(ctx)[t1]
        tensor([2., 2., 2.])
    """
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError("backward(): incompatible function arguments: context_id must be an "
                        f"int, got {type(context_id).__name__}")
    c = container()
    roots = _check_roots(roots)
    ctx = c.get(context_id)
    if ctx.failed is not None:
        raise type(ctx.failed)(str(ctx.failed), worker_name=ctx.failed.worker_name,
                               reason=ctx.failed.reason)
    retain = bool(retain_graph) or bool(ctx.sends)
    if ctx.spent is not None or (retain and not retain_graph):
        _spend(ctx, roots, record=not retain_graph)
    key = (c.rank, next(c.pass_ids))
    rec = c.passes[key] = _Pass(c.rank)
    try:
        with scope("torch::distributed::autograd::backward"):  # torch's name of it
            _part(c, ctx, key, _WHOLE, roots, [torch.ones_like(r) for r in roots], retain)
            with scope("torchwire::autograd::wait"):
                _wait(c, rec)
    finally:
        c.passes.pop(key, None)
    if rec.failure is not None:
        raise _error(c.rank, rec.failure)


def _wait(c, rec: _Pass) -> None:
    """Until the pass is over, or it made no progress for ``rpc_timeout``.

    As a torchwire future's ``wait``: a reader running this in place (``backward``
    inside an RPC) first hands its reading off, as the pass's reports may come on its
    own connection; a pool thread lets the pool start another meanwhile."""
    with c._lock:
        c.backward_passes += 1
    try:
        if not rec.done.is_set():
            threads.wait_blocking(_wait_loop, c, rec, c.agent.rpc_timeout)
    finally:
        with c._lock:
            c.backward_passes -= 1


def _wait_loop(c, rec: _Pass, timeout: float) -> None:
    if timeout <= 0:
        rec.done.wait()
        return
    while not rec.done.is_set():
        left = rec.progress + timeout - time.monotonic()
        if left > 0:
            rec.done.wait(left)
            continue
        with rec.lock:
            if rec.done.is_set() or rec.progress + timeout > time.monotonic():
                continue
            held = sorted(r for r, w in rec.held.items() if w > 0)
        names = ", ".join(c.agent.name_of(r) for r in held) or "?"
        raise RpcTimeoutError(
            f"the distributed backward pass made no progress for {int(timeout * 1000)} ms "
            f"(the RPC timeout); waiting on {names}")


def _error(here: int, failure: tuple) -> DistAutogradError | RemoteError | \
        WorkerUnavailableError:
    rank, name, type_name, message, tb = failure
    text = (f"Error on Node {rank}: {message}\n(in the distributed backward pass on worker "
            f"{name}, {type_name})")
    if tb:
        text += f"\n{tb}"
    if rank == here:
        return DistAutogradError(text)
    if type_name.startswith("torchwire.") and type_name.endswith(".WorkerUnavailableError"):
        # the pass could not reach worker `name` (it is gone or cut off): the agent's
        # error, whichever worker found out
        return WorkerUnavailableError(text, worker_name=name)
    return RemoteError(text, remote_type=type_name, worker_name=name, remote_traceback=tb)



def get_gradients(context_id: int) -> dict:
    """The gradients accumulated on this worker in context ``context_id``.

    Returns:
        ``{tensor: gradient}`` for the leaves that live on this worker.

    Raises:
        DistAutogradError: no such context here ("Could not find autograd context with
            id").
    """
    return dict(container().get(context_id).grad_table().values())


def _owner_backward(value, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise DistAutogradError(f"RRef should contain a tensor for .backward(), it holds a "
                                f"{type(value).__name__}")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        backward(context_id, [value], retain_graph)


def _rref_backward_remote(rref, context_id: int, retain_graph: bool) -> None:
    _owner_backward(rref.local_value(), context_id, retain_graph)


class AutogradContainer(ContextContainer):
    """This runtime's distributed autograd: the context records, and the agent plug-in
    (``torchwire._agent.runtime.AgentPlugin``) that fails the passes a lost worker
    held part of."""

    def __init__(self, agent) -> None:
        super().__init__(agent)
        _ddp.install()  # DDP modules' forwards in a context lend it their gradients

    def settle(self, deadline: float) -> None:
        pass  # nothing queued: a pass's messages are sent as it runs

    def idle(self) -> bool:
        return not self.passes

    def all_arrived(self) -> None:
        pass

    def peer_lost(self, rank: int, error: BaseException) -> None:
        """A backward pass rooted here fails if the lost worker holds part of it; the
        root of one that this worker sent gradients on to it hears of the loss."""
        for rec in list(self.passes.values()):
            rec.lost(rank, lambda: _failure(rank, error, "", self.agent))
        for key in self.forwarded_to(rank):
            _report(self, key, None, _failure(rank, error, "", self.agent))
        self.lost(rank, error)

    def close(self) -> None:
        """The agent is shut down: every pass still waiting here fails."""
        err = RpcStateError("RPC agent is shut down before the backward pass completed")
        for rec in list(self.passes.values()):
            rec.abort(_failure(self.rank, err, "", self.agent))
        _ddp.release_groups()

    def rref_backward(self, rref, context_id: int, retain_graph: bool) -> None:
        """``RRef.backward``: from the owner, locally (``context_id == -1``) or distributed.

        Raises:
            DistAutogradError: -1 on a user RRef; the value is not a tensor; the pass
                failed.
        """
        if rref.is_owner():
            _owner_backward(rref.local_value(), context_id, retain_graph)
            return
        if context_id == -1:
            raise DistAutogradError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        agent = self.agent
        # the owner's backward call belongs to no context (it runs in context_id there)
        ser.outside_grad_context(lambda: agent.call(
            rref.owner(), _rref_backward_remote, (rref, context_id, retain_graph), None,
            agent.rpc_timeout).wait())
