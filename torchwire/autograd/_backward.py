"""The distributed backward pass (torch's FAST mode).

``backward(C, roots)`` on worker W::

    local pass:  torch.autograd.backward(roots, ones, inputs=leaves + [anchor])
                 leaves = every AccumulateGrad variable under the roots; a pre-hook
                 on each AccumulateGrad node takes the gradient into C's record
                 (none reaches .grad; the leaves' and nodes' hooks run).  Each recv node reached
                 hands its (engine-summed) gradient to the pass.
    fan out:     for each worker S that sent a tensor reached: one request
                 _backward_remote(C, [(send id, grad), ...]) to S
    on S:        a local pass from those send entries with those gradients,
                 then the same fan-out; S replies once all of its requests
                 replied (async_execution: no thread waits meanwhile)
    W returns when every request it sent has replied: every worker reached
    has finished.

A failure anywhere travels back as a reply *value* (the failing node's rank,
name, error type, message and traceback), so the caller raises one error
naming the node where it happened: ``Error on Node <rank>: <message>`` (torch's
words) and the worker's name.

A send entry may be reached again by a later pass (another path through the
cycle, or ``retain_graph=True`` on the roots), so passes from send entries keep
their graph (``retain_graph=True``); it is freed when the context is released.
The root pass frees its graph unless asked to retain it, or this worker has send
entries in the context (a later pass from one of them may cross the same nodes).
"""

from __future__ import annotations

import threading
import traceback

import torch

from .. import _serialization as ser
from .. import _intraop
from .._errors import RemoteError, WorkerUnavailableError
from .._future import Future
from ._context import DistAutogradContext, container
from ._recording import _anchor, _pass


class _Through(torch.autograd.Function):
    """Identity: a leaf sent as is enters a local pass through its AccumulateGrad node,
    as any other leaf does (its hooks run)."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()  # an alias: same memory, no view (sparse tensors have none)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _leaves(outputs) -> list[tuple[torch.Tensor, object]]:
    """``(leaf, its AccumulateGrad node)`` for every leaf of the graph under ``outputs``."""
    seen: set = set()
    stack = [o.grad_fn for o in outputs]
    leaves = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            if var is not _anchor:
                leaves.append((var, node))
            continue
        stack.extend(f for f, _ in node.next_functions)
    return leaves


_hooked = threading.Lock()


def _capture(state, leaf, captured: list):
    """A pre-hook for ``leaf``'s AccumulateGrad node in the pass ``state``: takes the
    gradient (after the leaf's own hooks) for the context and leaves ``.grad`` alone."""
    def hook(grad_inputs):
        if getattr(_pass, "current", None) is not state:
            return None  # another pass, or a plain backward(), through the same leaf
        if grad_inputs[0] is not None:
            captured.append((leaf, grad_inputs[0]))
        return (None,)  # AccumulateGrad skips an undefined gradient; its post hooks run
    return hook


_engine = getattr(getattr(torch.autograd, "variable", None), "Variable", None)
_run_backward = getattr(getattr(_engine, "_execution_engine", None), "run_backward", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _engine_backward(outputs: list, grads: list, retain: bool, inputs: list) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=retain, inputs=inputs)``.

    Plain tensors go straight to the engine (what that function ends in): its Python
    checks cost ~70 µs a pass with the caches cold, as between messages, against
    ~10 µs hot.  The engine still validates each gradient against its output.
    Tensor subclasses (``__torch_function__``) take the public function."""
    if _run_backward is not None and all(type(t) in _PLAIN for t in outputs) and \
            all(type(t) in _PLAIN for t in inputs):
        _run_backward(tuple(outputs), tuple(grads), retain, False, tuple(inputs),
                      allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(outputs, grads, retain_graph=retain, inputs=inputs)



def _local_pass(ctx: DistAutogradContext, outputs, grads, retain: bool) -> dict:
    """One run of the local engine; returns ``{(src, send id): grad}`` to send on.

    As torch's distributed engine, every AccumulateGrad node reached runs its hooks
    (the leaf's tensor hooks, then the node's pre and post hooks), and the gradient
    goes into the context instead of ``.grad``: a pre-hook of ours takes it.  Graphs
    with tensors off the CPU use ``torch.autograd.grad`` instead (their nodes run on
    the engine's device threads, where the running pass is not known): the same
    gradients, without the nodes' pre and post hooks.
    """
    inner, inner_grads = [], []
    with torch.enable_grad():
        for t, g in zip(outputs, grads):
            if t.grad_fn is not None:
                inner.append(t)
                inner_grads.append(g)
            elif t.requires_grad:  # a leaf sent as is
                inner.append(_Through.apply(t))
                inner_grads.append(g)
    if not inner:
        return {}
    leaves = _leaves(inner)
    out: dict = {}
    captured: list = []
    prev = getattr(_pass, "current", None)
    state = _pass.current = (ctx.id, out)
    try:
        if all(t.device.type == "cpu" for t in inner) and \
                all(leaf.device.type == "cpu" for leaf, _ in leaves):
            # One such pass at a time (torch's engine runs them all on one thread too):
            # hooks added or removed while another pass runs the same node's hooks
            # could make it skip ours.
            with _hooked:
                handles = [node.register_prehook(_capture(state, leaf, captured))
                           for leaf, node in leaves]
                serial = _intraop.serial_for(
                    sum(leaf.numel() for leaf, _ in leaves) + sum(g.numel() for g in inner_grads))
                try:
                    inputs = [leaf for leaf, _ in leaves]
                    inputs.append(_anchor)
                    _engine_backward(inner, inner_grads, retain, inputs)
                finally:
                    if serial is not None:
                        _intraop.restore(serial)
                    for h in handles:
                        h.remove()
        else:
            got = torch.autograd.grad(inner, [leaf for leaf, _ in leaves] + [_anchor],
                                      inner_grads, retain_graph=retain, allow_unused=True)
            captured = [(leaf, g) for (leaf, _), g in zip(leaves, got) if g is not None]
            del got
    finally:
        _pass.current = prev
    ctx.accumulate(captured)
    return out


def _failure(rank: int, exc: BaseException, tb: str | None = None) -> tuple:
    agent = container().agent
    name = agent.get_worker_info(rank).name
    return (rank, name, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc),
            tb if tb is not None else "".join(traceback.format_exception(exc)))


def _done(value) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


def _run(ctx: DistAutogradContext, outputs, grads, retain: bool) -> Future:
    """A local pass and its fan-out; the future's value is None or a failure tuple."""
    c = container()
    with c._lock:
        c.backward_passes += 1
    fut = _pass_and_fan_out(c, ctx, outputs, grads, retain)

    def finished(_f) -> None:
        with c._lock:
            c.backward_passes -= 1
    fut._add_inline_callback(finished)
    return fut


def _pass_and_fan_out(c, ctx: DistAutogradContext, outputs, grads, retain: bool) -> Future:
    try:
        outgoing = _local_pass(ctx, outputs, grads, retain)
    except Exception as exc:
        return _done(_failure(c.rank, exc))
    by_dest: dict[int, list] = {}
    for (src, sid), g in outgoing.items():
        by_dest.setdefault(src, []).append((sid, g))
    if not by_dest:
        return _done(None)
    agent = c.agent
    prev = ser.set_grad_context(None)  # control traffic of the pass, in no context
    try:
        calls = []
        for dest, items in by_dest.items():
            try:
                fut = agent.call(agent.get_worker_info(dest), _backward_remote,
                                 (ctx.id, items), None, agent.rpc_timeout)
            except Exception as exc:
                fut = Future()
                fut.set_exception(exc)
            calls.append((dest, fut))
    finally:
        ser.set_grad_context(prev)
    return _join(calls)


def _join(calls) -> Future:
    """A future done when every call is: None, or the first failure reported."""
    out = Future()
    left = [len(calls)]
    first: list = [None]
    lock = threading.Lock()

    def one(dest: int, f) -> None:
        try:
            failure = f.value()
        except Exception as exc:  # transport: the worker is gone, timed out...
            failure = _failure(dest, exc, "")
        with lock:
            if failure is not None and first[0] is None:
                first[0] = failure
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(first[0])

    for dest, fut in calls:
        fut._add_inline_callback(lambda f, d=dest: one(d, f))
    return out


def _backward_remote(context_id: int, items) -> Future:
    """Request: continue the backward pass from this worker's send entries."""
    c = container()
    try:
        ctx = c.get(context_id)
        with ctx.lock:
            outputs = [ctx.sends[sid] for sid, _ in items]
    except Exception as exc:
        if isinstance(exc, KeyError):
            exc = RuntimeError(f"autograd context {context_id} has no send entry {exc} here")
        return _done(_failure(c.rank, exc))
    return _run(ctx, outputs, [g for _, g in items], True)


_backward_remote._wrapped_async_rpc_function = _backward_remote  # type: ignore[attr-defined]
_backward_remote._tw_reply_inline = True  # type: ignore[attr-defined]


def _check_roots(roots) -> list[torch.Tensor]:
    if not isinstance(roots, (list, tuple)) or \
            not all(isinstance(t, torch.Tensor) for t in roots):
        raise TypeError("backward(): incompatible function arguments: roots must be a list "
                        f"of tensors, got {type(roots).__name__}")
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, t in enumerate(roots):
        if not t.requires_grad:
            raise RuntimeError(f"requires_grad not set on root tensor {i}")
        if t.numel() != 1:
            raise RuntimeError(f"Tensor {i} of shape {tuple(t.shape)} is not a scalar, all "
                               "roots need to be scalar")
        if t.grad_fn is None:
            raise RuntimeError(f"Tensor {i} does not have a valid gradient function (it is "
                               "a leaf)")
    return list(roots)


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
        RuntimeError: no such context here ("Could not find autograd context with
            id"), a root is not a scalar, does not require grad or is a leaf; or
            the pass failed on some worker: "Error on Node <rank>: <error>", with
            the worker's name (a :class:`RemoteError` when it was another worker).
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
    retain = bool(retain_graph) or bool(ctx.sends)
    failure = _run(ctx, roots, [torch.ones_like(r) for r in roots], retain).wait()
    if failure is not None:
        raise _error(c.rank, failure)


def _error(here: int, failure: tuple) -> RuntimeError:
    rank, name, type_name, message, tb = failure
    text = (f"Error on Node {rank}: {message}\n(in the distributed backward pass on worker "
            f"{name}, {type_name})")
    if tb:
        text += f"\n{tb}"
    if rank == here:
        return RuntimeError(text)
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
        RuntimeError: no such context here ("Could not find autograd context with id").
    """
    ctx = container().get(context_id)
    with ctx.lock:
        return dict(ctx.grads)


def rref_backward(rref, context_id: int, retain_graph: bool) -> None:
    """``RRef.backward``: from the owner, locally (``context_id == -1``) or distributed."""
    if rref.is_owner():
        _owner_backward(rref.local_value(), context_id, retain_graph)
        return
    if context_id == -1:
        raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
    c = container()
    prev = ser.set_grad_context(None)
    try:
        c.agent.call(rref.owner(), _rref_backward_remote, (rref, context_id, retain_graph),
                     None, c.agent.rpc_timeout).wait()
    finally:
        ser.set_grad_context(prev)


def _owner_backward(value, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"RRef should contain a tensor for .backward(), it holds a "
                           f"{type(value).__name__}")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        backward(context_id, [value], retain_graph)


def _rref_backward_remote(rref, context_id: int, retain_graph: bool) -> None:
    _owner_backward(rref.local_value(), context_id, retain_graph)
