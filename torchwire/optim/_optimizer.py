"""``DistributedOptimizer``: one local optimizer per worker that owns parameters.

The constructor groups the parameter RRefs by owner and creates, with
``rpc.remote``, one :class:`_LocalOptimizer` on each owner, holding the given
``torch.optim`` class over that owner's parameters.  ``step(context_id)`` asks
every owner at once to load the context's gradients into ``.grad`` of its
parameters and step, and returns when all have.  Steps on one worker are
serialized by one lock per worker (as torch does: concurrent trainers sharing
parameters update them one at a time).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _serialization as ser
from .._agent.profiling import scope
from .._agent.runtime import require_agent
from .._autograd import context as _context
from .._rref import RRef, remote
from .._base.errors import WorkerUnavailableError


class _LocalOptimizer:
    """An optimizer over the parameters this worker owns (lives on the owner)."""

    # one lock for every local optimizer of the worker: torch's simplification (two
    # optimizers on one worker are assumed to share parameters: trainers' replicas)
    global_lock = threading.Lock()

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._params = [r.local_value() for r in params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)
        self._bare_step = _bare_step(self.optim)

    def step(self, context_id: int) -> None:
        with scope("torchwire::optim::local_step"):
            self._step(context_id)

    def _step(self, context_id: int) -> None:
        ctx = _context.container().find(context_id)
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with _LocalOptimizer.global_lock:
            if ctx is not None:
                grads = ctx.grad_table()  # id(leaf) -> (leaf, gradient)
            for p in self._params:
                entry = grads.get(id(p))
                p.grad = None if entry is None else entry[1]
            optim = self.optim
            if self._bare_step is None or _hooks_registered(optim):
                optim.step()
            elif not _plain_sgd_step(optim):
                self._bare_step(optim)

    def __repr__(self) -> str:
        return f"<_LocalOptimizer {type(self.optim).__name__} params={len(self._params)}>"


_optimizer_module: types.ModuleType | None
try:
    import torch.optim.optimizer as _optimizer_module
except ImportError:
    _optimizer_module = None
_GLOBAL_PRE = getattr(_optimizer_module, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(_optimizer_module, "_global_optimizer_post_hooks", None)


def _bare_step(optim: torch.optim.Optimizer) -> Callable[..., Any] | None:
    """``type(optim).step`` without the wrapper every torch optimizer's step gets
    (``Optimizer.profile_hook_step``: a profiler range, and the step pre and post
    hooks), or None where that wrapper is not found.  With the caches cold, as on a
    worker between messages, the wrapper costs nearly half an SGD step (figures in
    docs/architecture.md); a DistributedOptimizer's local optimizers are its own, so
    only hooks registered for all optimizers can be there, and with some the full
    step runs."""
    step = type(optim).step
    inner = getattr(step, "__wrapped__", None)
    if not getattr(step, "hooked", False) or inner is None or _GLOBAL_PRE is None or \
            _GLOBAL_POST is None:
        return None
    bare: Callable[..., Any] = inner
    return bare


_SGD = torch.optim.SGD
_set_grad_enabled = torch._C._set_grad_enabled


def _plain_sgd_step(optim: torch.optim.Optimizer) -> bool:
    """``SGD.step`` for plain SGD (no momentum, weight decay, maximize; a number as the
    learning rate; CPU parameters): ``param.add_(grad, alpha=-lr)`` for each parameter
    with a gradient, what ``torch.optim.SGD`` computes then (its ``_single_tensor_sgd``),
    without its Python around it (costly with the caches cold, as on a worker between
    messages; torch's own DistributedOptimizer runs such optimizers as TorchScript
    functional ones).  False (nothing done) for any other optimizer or setting."""
    if type(optim) is not _SGD or getattr(optim, "grad_scale", None) is not None or \
            getattr(optim, "found_inf", None) is not None:
        return False
    groups = optim.param_groups
    for group in groups:
        if group.get("momentum") != 0 or group.get("weight_decay") != 0 or \
                group.get("maximize") or group.get("differentiable") or group.get("fused") or \
                group.get("foreach") or type(group.get("lr")) not in (float, int):
            return False
        for p in group["params"]:
            if not p.is_cpu:
                return False
    prev = torch.is_grad_enabled()
    _set_grad_enabled(False)
    try:
        for group in groups:
            alpha = -group["lr"]
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    p.add_(g, alpha=alpha)
    finally:
        _set_grad_enabled(prev)
    return True


def _hooks_registered(optim: torch.optim.Optimizer) -> bool:
    return bool(_GLOBAL_PRE or _GLOBAL_POST or optim._optimizer_step_pre_hooks or
                optim._optimizer_step_post_hooks)


def _local_step(opt_rref: RRef, context_id: int) -> None:
    opt_rref.local_value().step(context_id)


def _create(optimizer_class: type[torch.optim.Optimizer], by_owner: dict[int, list[RRef]],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[RRef]:
    """One ``_LocalOptimizer`` on each owner, made by ``remote()``.

    Raises:
        Exception: an owner could not make its optimizer (its error).
    """
    rrefs = [remote(owner, _LocalOptimizer, (optimizer_class, params, args, kwargs), None, -1)
             for owner, params in by_owner.items()]
    for rref in rrefs:
        rref._get_future().wait()  # raises the owner's error
    return rrefs


def _start_steps(optimizers: list[RRef], context_id: int) -> list[Any]:
    """Ask every remote owner to step; the replies to wait for."""
    agent = require_agent()
    return [agent.call(r.owner(), _local_step, (r, context_id), None, agent.rpc_timeout,
                       None, True)
            for r in optimizers if not r.is_owner()]


class DistributedOptimizer:
    """Update parameters spread over workers with any ``torch.optim`` optimizer.

    Args:
        optimizer_class: a :class:`torch.optim.Optimizer` subclass, made on each
            owner over its parameters.
        params_rref: RRefs of the parameters to optimize (local or remote).
        *args, **kwargs: passed to ``optimizer_class`` (``lr=...``).

    Raises:
        TypeError: ``params_rref`` is not a list of RRefs.
        Exception: creating an optimizer on an owner failed (its error).

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     loss = model(inputs).sum()           # forward across workers
        ...     dist_autograd.backward(context_id, [loss])
        ...     opt.step(context_id)                 # opt = DistributedOptimizer(
        ...                                          #   torch.optim.SGD, model_rrefs, lr=0.05)
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer],
                 params_rref: Iterable[RRef], *args: Any, **kwargs: Any) -> None:
        params = list(params_rref)
        if not all(isinstance(r, RRef) for r in params):
            raise TypeError("DistributedOptimizer takes a list of parameter RRefs "
                            "(torchwire.rpc.RRef(param) for local ones)")
        by_owner: dict[int, list[RRef]] = {}
        for r in params:
            by_owner.setdefault(r.owner().id, []).append(r)
        # set-up traffic belongs to no autograd context
        self.remote_optimizers = ser.outside_grad_context(_create, optimizer_class, by_owner,
                                                          args, kwargs)
        self.optimizer_class = optimizer_class

    def __repr__(self) -> str:
        owners = ", ".join(r.owner_name() for r in self.remote_optimizers)
        return f"<DistributedOptimizer {self.optimizer_class.__name__} on {owners}>"

    def step(self, context_id: int) -> None:
        """One optimizer step on every owner, with the gradients of ``context_id``.

        Steps run on all owners in parallel; returns when all have finished.

        Raises:
            DistAutogradError: ``context_id`` is not a context of this worker ("Could
                not find autograd context with id").
            WorkerUnavailableError: an owner of parameters is gone (or restarted: the
                parameters died with its process); build a new optimizer.
            Exception: a step failed (the first error).
        """
        _context.container().get(context_id)
        with scope("torchwire::optim::DistributedOptimizer.step"):
            # waited for below, after this worker's own step: replies, not futures
            try:
                futs = ser.outside_grad_context(_start_steps, self.remote_optimizers,
                                                context_id)
            except WorkerUnavailableError as exc:
                raise _owner_gone(exc) from exc
            error = None
            for r in self.remote_optimizers:
                if r.is_owner():  # this worker's own step: here, while the others run
                    try:
                        r.local_value().step(context_id)
                    except Exception as exc:
                        error = error or exc
            with scope("torchwire::optim::wait"):
                for fut in futs:
                    try:
                        fut.wait()
                    except Exception as exc:
                        error = error or exc
        if isinstance(error, WorkerUnavailableError):
            raise _owner_gone(error) from error
        if error is not None:
            raise error


def _owner_gone(exc: WorkerUnavailableError) -> WorkerUnavailableError:
    """A step could not reach an owner of parameters: say what to do about it."""
    return WorkerUnavailableError(
        f"DistributedOptimizer.step: {exc} (the local optimizer and the parameters it "
        "stepped there are gone with that process; once the worker is back, build a new "
        "DistributedOptimizer from RRefs to its parameters as they are now)",
        worker_name=exc.worker_name, reason=exc.reason)


for _cls in (DistributedOptimizer,):
    _cls.__module__ = "torchwire.optim"
del _cls
