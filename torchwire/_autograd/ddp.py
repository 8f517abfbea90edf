"""DistributedDataParallel under distributed autograd: the reducer's gradients live in the context.

How torch does it: DDP's reducer (C++) hooks each parameter's AccumulateGrad node
(a post hook).  torch's distributed engine runs those hooks with the context as the
thread's ``ThreadLocalDistAutogradContext``; the reducer remembers it, reads each
parameter's gradient from the context instead of ``.grad``
(``DistAutogradContext::runGradCallbackForVariable``), copies it (divided by the
group's size) into its bucket, all-reduces the bucket, and at the end of the local
graph task (a final callback of the engine) writes the average back into the
context.  ``.grad`` is never touched.

torchwire runs torch's local engine, and the reducer's context pointer stays null
here, so the reducer reads and writes ``.grad``.  So, for the parameters of a DDP
module, context ``C`` lends the reducer their ``.grad``:

    lend:    the DDP module's forward in C (or the first local pass of C that reaches
             one of its parameters) sets each parameter's ``.grad`` to C's gradient of
             it (None at first), keeping the user's ``.grad`` aside
    passes:  these parameters get no capture pre-hook: AccumulateGrad adds into
             ``.grad`` (by torch's AccumulateGrad rules, as C would), the reducer's
             hooks, buckets, all-reduce and final callback run as torch's
    settle:  when C's gradients are read (get_gradients, an optimizer step) or C is
             released: each ``.grad`` goes into C, the user's ``.grad`` comes back

A parameter is lent to one context at a time (a reducer runs one iteration at a time):
another context reaching it before the first settles is an error.  The module's
forward is where the lending starts so that what the reducer reads before any pass
(with ``find_unused_parameters``, the unused parameters are marked ready during the
forward) is C's gradient too.  Passes lend under :data:`lock`, which also keeps a
settle from running in the middle of a pass.

Unlike torch, a plain ``loss.backward()`` on torch's local engine of a forward made in
C, before C settles, adds into the lent ``.grad``, so into C.

DDP modules are found at their forward: :func:`install` wraps
``DistributedDataParallel._pre_forward`` (torch's reducer has no Python hook of its
own, and a global module hook would tax every module call).

A registered module's process group is kept alive past the module, until the next
module registers or the agent closes (:func:`release_groups`).  torch frees a DDP
module's reducer holding the GIL; when the reducer holds the group's last reference,
the gloo group's destructor joins its worker threads, and a worker still freeing a
finished all-reduce whose tensor has a Python object (DDP's ``join()`` all-reduces
tensors made in Python) waits for that GIL: a deadlock, seen under torch's own RPC
too (docs/compat.md).  Later, the workers are idle and the join returns.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .. import _serialization as ser
from .._base.errors import DistAutogradError
from .context import container

# Held by a local pass that reaches lent parameters, by lending and by settling.
lock = threading.RLock()

# id(parameter) -> (weakref to it, the _Module it belongs to): every parameter of a DDP
# module that ran forward since install().  Empty: no pass looks further.
by_param: dict[int, tuple[weakref.ref, _Module]] = {}
# id(parameter) -> the context id it is lent to
_lent_to: dict[int, int] = {}


class _Module:
    """A DDP module's parameters that require grad (weakly: the module owns them)."""

    __slots__ = ("name", "params", "keys", "__weakref__")

    def __init__(self, ddp) -> None:
        self.name = type(ddp.module).__name__
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.params = [weakref.ref(p) for p in params]
        self.keys = [id(p) for p in params]

    def alive(self) -> list[torch.Tensor]:
        out = []
        for r in self.params:
            p = r()
            if p is not None:
                out.append(p)
        return out


_modules: dict[int, _Module] = {}  # id(DDP module) -> its record
_groups: dict[int, object] = {}  # id(DDP module) -> its process group (see the top)
_retired: list = []  # the groups of modules that are gone, until release_groups()


def _forget(key: int) -> None:
    with lock:  # (an RLock: the collector may run this on a thread that holds it)
        group = _groups.pop(key, None)
        if group is not None:
            _retired.append(group)  # not freed here: this may be the reducer's dealloc
        mod = _modules.pop(key, None)
        if mod is None:
            return
        for k in mod.keys:
            entry = by_param.get(k)
            if entry is not None and entry[1] is mod:
                del by_param[k]


def release_groups() -> None:
    """Free the process groups of DDP modules that are gone (at a point where no
    collective of theirs can still be finishing: a new module's forward, the agent's
    close)."""
    with lock:
        retired = _retired[:]
        _retired.clear()
    del retired  # outside the lock: a group's destructor joins its threads


def _register(ddp) -> _Module:
    release_groups()
    with lock:
        key = id(ddp)
        mod = _modules.get(key)
        if mod is None:
            mod = _modules[key] = _Module(ddp)
            _groups[key] = getattr(ddp, "process_group", None)
            weakref.finalize(ddp, _forget, key)
            for r, k in zip(mod.params, mod.keys):
                by_param[k] = (r, mod)
        return mod


class Lent:
    """Context C's lent parameters: ``id(p) -> (p, the user's .grad)`` (``ctx.ddp``)."""

    __slots__ = ("params",)

    def __init__(self) -> None:
        self.params: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def settle(self, ctx) -> None:
        """Each lent ``.grad`` into the context, the user's ``.grad`` back."""
        with lock:
            params, self.params = self.params, {}
            moved = []
            for key, (p, kept) in params.items():
                g = p.grad
                p.grad = kept
                if _lent_to.get(key) == ctx.id:
                    del _lent_to[key]
                if g is not None:
                    moved.append((key, p, g))
            with ctx.lock:
                for key, p, g in moved:
                    ctx.grads[key] = (p, g)


def lend(ctx, mod: _Module) -> None:
    """Lend ``mod``'s parameters' ``.grad`` to context ``ctx`` (no-op if lent already).

    Raises:
        DistAutogradError: a parameter is lent to another context.
    """
    with lock:
        lent = ctx.ddp
        if lent is None:
            lent = ctx.ddp = Lent()
        params = mod.alive()
        for p in params:
            other = _lent_to.get(id(p))
            if other is not None and other != ctx.id:
                raise DistAutogradError(
                    f"a parameter of DistributedDataParallel({mod.name}) is in use by "
                    f"distributed autograd context {other}, not yet settled (read its "
                    f"gradients or leave it first): DDP runs one iteration at a time, "
                    f"so context {ctx.id} cannot use it meanwhile")
        for p in params:
            key = id(p)
            if key in lent.params:
                continue
            with ctx.lock:
                own = ctx.grads.pop(key, None)
            lent.params[key] = (p, p.grad)
            p.grad = None if own is None else own[1]
            _lent_to[key] = ctx.id


def lent_leaves(ctx, leaves) -> set[int] | None:
    """For a local pass of ``ctx`` (under :data:`lock`): the ids of ``leaves`` whose
    ``.grad`` is lent to it, lending those of DDP modules not lent yet; None if none."""
    found = None
    for leaf, _ in leaves:
        entry = by_param.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            if found is None:
                found = []
            found.append(entry[1])
    if found is None:
        return None
    for mod in found:
        lend(ctx, mod)
    return set(ctx.ddp.params)


def lent_leaves_any(leaves) -> bool:
    """Whether any of ``leaves`` is a parameter of a DDP module."""
    for leaf, _ in leaves:
        entry = by_param.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            return True
    return False


_installed = False


def install() -> None:
    """Wrap ``DistributedDataParallel._pre_forward`` (once): a DDP forward in a context
    lends its parameters to it."""
    global _installed
    with lock:
        if not _installed:
            _wrap_pre_forward()
            _installed = True


def _wrap_pre_forward() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch_pre_forward = DDP._pre_forward

    def _pre_forward(self, *inputs, **kwargs):
        mod = _modules.get(id(self))
        if mod is None:
            mod = _register(self)
        if ser.grad_context() is not None and torch.is_grad_enabled():
            lend(container().get_or_create(ser.grad_context()), mod)
        return torch_pre_forward(self, *inputs, **kwargs)

    _pre_forward.__wrapped__ = torch_pre_forward  # type: ignore[attr-defined]
    DDP._pre_forward = _pre_forward
