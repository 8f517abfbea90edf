"""``torchwire.autograd``: distributed autograd, a drop-in for ``torch.distributed.autograd``.

A forward pass that spans workers through RPC records, inside a
:class:`context`, every tensor requiring grad that crosses a message; the
distributed :func:`backward` then reaches every worker involved, and each
worker's leaf gradients accumulate in the context (:func:`get_gradients`),
never in ``.grad``.  Port a program by changing
``import torch.distributed.autograd as dist_autograd`` to
``import torchwire.autograd as dist_autograd``.

Example::

    >>> import torchwire.autograd as dist_autograd
    >>> with dist_autograd.context() as context_id:
    ...     t1 = torch.rand((3, 3), requires_grad=True)
    ...     t2 = torch.rand((3, 3), requires_grad=True)
    ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
    ...     dist_autograd.backward(context_id, [loss])
    ...     grads = dist_autograd.get_gradients(context_id)   # {t1: ones, t2: ones}
"""

from __future__ import annotations

from .. import _serialization as ser
from .._autograd.backward import backward, get_gradients
from .._autograd.context import DistAutogradContext, container, not_found
from .._base.errors import DistAutogradError

__all__ = ["context", "backward", "get_gradients", "is_available"]


def is_available() -> bool:
    """Distributed autograd is always available in torchwire."""
    return True


class context:
    """A distributed autograd context for one forward and backward pass.

    ``with context() as context_id:`` gives an id unique across the job (this
    worker's rank in the high 16 bits).  RPCs sent from this thread inside the
    block carry it; leaving the block releases the context on every worker it
    reached.  One context per thread at a time.

    Raises:
        DistAutogradError: this thread already has a context ("Already have an
            autograd context id for this thread").
        RpcStateError: RPC is not initialized.
    """

    def __enter__(self) -> int:
        self.autograd_context = _new_context()
        return self.autograd_context.id

    def __exit__(self, exc_type: object, exc_value: object, tb: object) -> None:
        _release_context(self.autograd_context.id)

    def __repr__(self) -> str:
        ctx = getattr(self, "autograd_context", None)
        return f"<torchwire.autograd.context {ctx!r}>"


def _new_context() -> DistAutogradContext:
    """Open a context and make it this thread's (torch's ``_new_context``)."""
    if ser.grad_context() is not None:
        raise DistAutogradError(f"Already have an autograd context id for this thread "
                           f"({ser.grad_context()}); contexts do not nest")
    ctx = container().new_context()
    ser.set_grad_context(ctx.id)
    return ctx


def _release_context(context_id: int) -> None:
    """Release ``context_id`` here and on every worker it reached.

    Raises:
        DistAutogradError: no such context ("Could not find autograd context with id").
    """
    if ser.grad_context() == context_id:
        ser.set_grad_context(None)
    c = container()
    if c.release(context_id) is None:
        raise not_found(context_id)


def _current_context() -> DistAutogradContext:
    """This thread's context.

    Raises:
        DistAutogradError: the thread has none.
    """
    cid = ser.grad_context()
    if cid is None:
        raise DistAutogradError("Current thread doesn't have a valid autograd context. Please wrap "
                           "your code using: `with torchwire.autograd.context() as "
                           "context_id` to generate a valid context")
    return container().get_or_create(cid)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return container().get(context_id)


def _is_valid_context(context_id: int) -> bool:
    return container().find(context_id) is not None


def _get_max_id() -> int:
    return container().max_id()


def _get_debug_info() -> dict[str, int]:
    """torch's two counters: ``num_autograd_contexts``, ``num_current_backward_passes``."""
    info = container().debug_info()
    return {k: info[k] for k in ("num_autograd_contexts", "num_current_backward_passes")}


def _debug_info() -> dict[str, int]:
    """All of this worker's counters: contexts, backward passes, send entries, recv
    nodes, tombstones of released contexts."""
    return container().debug_info()


for _name in ("context", "backward", "get_gradients", "is_available", "DistAutogradContext"):
    try:
        globals()[_name].__module__ = __name__
    except (AttributeError, TypeError):
        pass
del _name
