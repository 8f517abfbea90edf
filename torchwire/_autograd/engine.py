"""One local pass of the distributed backward pass, on torch's local engine.

As torch's distributed engine, every AccumulateGrad node a pass reaches runs its
hooks (the leaf's tensor hooks, then the node's pre and post hooks), and the
gradient goes into the context instead of ``.grad``: a pre-hook of ours takes it.
Each recv node reached hands its (engine-summed) gradient to the running pass
(``recording.RecvRpc``), which returns them to be sent to their senders.
"""

from __future__ import annotations

import threading

import torch

from .._base import intraop as _intraop
from .._base.errors import DistAutogradError
from . import ddp as _ddp
from .context import DistAutogradContext
from .recording import _anchor, _pass, device_passes


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
        if type(node) is _ACCUMULATE:  # (getattr(node, "variable") raises elsewhere: slow)
            var = node.variable
            if var is not _anchor:
                leaves.append((var, node))
            continue
        for f, _ in node.next_functions:  # (a plain loop: no generator frames)
            stack.append(f)
    return leaves


_ACCUMULATE = torch._C._functions.AccumulateGrad


_hooked = threading.Lock()
_device_lock = threading.Lock()  # passes over graphs with device tensors take turns


def _capture(state, leaf, captured: list):
    """A pre-hook for ``leaf``'s AccumulateGrad node in the pass ``state``: takes the
    gradient (after the leaf's own hooks) for the context and leaves ``.grad`` alone."""
    def hook(grad_inputs):
        if _pass.current is not state:
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
    checks cost far more with the caches cold, as between messages, than hot.  The
    engine still validates each gradient against its output.
    Tensor subclasses (``__torch_function__``) take the public function."""
    plain = _run_backward is not None
    if plain:
        for t in outputs:
            if type(t) not in _PLAIN:
                plain = False
        for t in inputs:
            if type(t) not in _PLAIN:
                plain = False
    if plain:
        _run_backward(tuple(outputs), tuple(grads), retain, False, tuple(inputs),
                      allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(outputs, grads, retain_graph=retain, inputs=inputs)



def _cpu_pass(state, leaves, captured, inner, inner_grads, retain, inputs, numel,
              lent) -> None:
    """The engine's run of a CPU pass: a capture pre-hook on each leaf's AccumulateGrad
    node but those whose ``.grad`` is lent to DDP's reducer (``lent``: their ids)."""
    if lent is None:
        handles = [node.register_prehook(_capture(state, leaf, captured))
                   for leaf, node in leaves]
    else:
        handles = [node.register_prehook(_capture(state, leaf, captured))
                   for leaf, node in leaves if id(leaf) not in lent]
    serial = _intraop.serial_for(numel)
    try:
        inputs.append(_anchor)
        _engine_backward(inner, inner_grads, retain, inputs)
    finally:
        if serial is not None:
            _intraop.restore(serial)
        for h in handles:
            h.remove()


def _local_pass(ctx: DistAutogradContext, outputs, grads, retain: bool) -> dict:
    """One run of the local engine; returns ``{(src, send id): grad}`` to send on.

    As torch's distributed engine, every AccumulateGrad node reached runs its hooks
    (the leaf's tensor hooks, then the node's pre and post hooks), and the gradient
    goes into the context instead of ``.grad``: a pre-hook of ours takes it.  Graphs
    with tensors off the CPU use ``torch.autograd.grad`` instead (their nodes run on
    the engine's device threads, where the running pass is not known): the same
    gradients, without the nodes' pre and post hooks.
    """
    # Plain loops, not generator expressions: each element of one costs a frame
    # resumption, microseconds with the caches cold (as between messages).
    inner, inner_grads = [], []
    cpu, numel = True, 0
    for t, g in zip(outputs, grads):
        if t.grad_fn is None:
            if not t.requires_grad:
                continue
            with torch.enable_grad():  # a leaf sent as is
                t = _Through.apply(t)
        inner.append(t)
        inner_grads.append(g)
        cpu = cpu and t.is_cpu
        numel += g.numel()
    if not inner:
        return {}
    leaves = _leaves(inner)
    inputs = []
    for leaf, _ in leaves:
        inputs.append(leaf)
        cpu = cpu and leaf.is_cpu
        numel += leaf.numel()
    out: dict = {}
    captured: list = []
    prev = _pass.current
    state = _pass.current = (ctx.id, out)
    try:
        if cpu:
            # One such pass at a time (torch's engine runs them all on one thread too):
            # hooks added or removed while another pass runs the same node's hooks
            # could make it skip ours.
            with _hooked:
                if _ddp.by_param:  # a DDP module ran: its parameters' .grad may be lent
                    with _ddp.lock:
                        lent = _ddp.lent_leaves(ctx, leaves)
                        _cpu_pass(state, leaves, captured, inner, inner_grads, retain,
                                  inputs, numel, lent)
                else:
                    _cpu_pass(state, leaves, captured, inner, inner_grads, retain, inputs,
                              numel, None)
        else:
            if _ddp.by_param and _ddp.lent_leaves_any(leaves):
                raise DistAutogradError(
                    "a graph with tensors off the CPU that reaches the parameters of a "
                    "DistributedDataParallel module is not supported by torchwire's "
                    "distributed autograd (DDP under it: CPU graphs only)")
            # Device nodes (recv nodes included) run on the engine's device threads: they
            # find the pass by context id, one device pass at a time.
            with _device_lock:
                device_passes[ctx.id] = state
                try:
                    got = torch.autograd.grad(inner, inputs + [_anchor], inner_grads,
                                              retain_graph=retain, allow_unused=True)
                finally:
                    device_passes.pop(ctx.id, None)
            captured = [(leaf, g) for (leaf, _), g in zip(leaves, got) if g is not None]
            del got
    finally:
        _pass.current = prev
    ctx.accumulate(captured)
    return out
