"""Send/recv recording: how messages of a context carry it and stitch the graph.

Installed into the serialization layer as its autograd hook (``ser.hooks.set_autograd``):

* A request sent by a thread that has a context ``C`` travels as
  ``(_InContext(C, func), args, kwargs)``: the callee runs ``func`` with ``C`` as
  its thread's context (so nested calls carry it too) and replies with
  ``_Reply(C, result)``, whose pickling marks the reply as a message of ``C``.
* A tensor that requires grad in a message of ``C`` is recorded as a *send
  entry* ``(C, send id) -> tensor`` on the sender, and travels detached with the
  tag ``(C, sender rank, send id)``.
* The receiver passes it through :class:`RecvRpc`, a custom autograd Function that
  also takes a per-process scalar *anchor* leaf (so the node is always on a path
  to an input the local pass asks gradients for), and marks the received tensor
  dirty: the tensor itself gets the recv node as its ``grad_fn``, no view.  In the
  backward pass the node hands its gradient to the running local pass
  (:mod:`._backward`), which sends it to the sender's send entry.
"""

from __future__ import annotations

import marshal
import threading
import types

import torch

from .. import _serialization as ser
from .._agent.future import Deferred, Future
from .._base.asyncexec import ASYNC_ATTR, is_async
from .._base.errors import SerializationError
from .context import container
from .kinds import AutogradKind

# The anchor: a leaf that every recv node takes as an input.  Local passes ask for
# its gradient too, so the engine never prunes a recv node; it never gets one.
_anchor = torch.zeros((), requires_grad=True)

# The local pass running on this thread: (context id, {(src rank, send id): grad}).
class _PassLocal(threading.local):
    current = None  # the default, found without an AttributeError


_pass = _PassLocal()
# The pass over a graph with tensors off the CPU, by context id: the engine runs such a
# graph's device nodes on its device threads, where ``_pass`` is not the pass's (one
# such pass at a time, see engine.py).
device_passes: dict = {}


class RecvRpc(torch.autograd.Function):
    """A received tensor's node: ``RecvRpcBackward`` in the graph and in profiles,
    torch's name of it."""

    @staticmethod
    def forward(ctx, anchor, t, tag):
        ctx.mark_dirty(t)
        ctx.tag = tag
        return t

    @staticmethod
    def backward(ctx, grad):
        running = _pass.current
        tag = ctx.tag
        if running is None:
            running = device_passes.get(tag[0])  # a device thread of a device pass
        if running is not None and running[0] == tag[0]:
            out = running[1]
            key = (tag[1], tag[2])
            old = out.get(key)
            out[key] = grad if old is None else old + grad
        # else: a plain local backward() through a received tensor: stops here
        return None, None, None


def _rebuild_recv(context_id: int, src: int, send_id: int, t: torch.Tensor):
    ctx = container().get_or_create(context_id)
    with ctx.lock:
        ctx.recvs += 1
    if t._is_view():
        # received tensors are views of the receive buffer; marking a view dirty would
        # rebase its base's history instead.  detach(): same memory, not a view.
        t = t.detach()
    apply = RecvRpc.apply if _functorch_active() else _recv_apply
    if torch.is_grad_enabled():  # (a context manager costs microseconds, cold)
        return apply(_anchor, t, (context_id, src, send_id))
    with torch.enable_grad():
        return apply(_anchor, t, (context_id, src, send_id))


# RecvRpc's C++ apply, without autograd.Function.apply's Python wrapper (default-argument
# binding, the functorch checks), which costs microseconds per received tensor with
# the caches cold.  Under a functorch transform the wrapper is used.
_recv_apply = super(torch.autograd.Function, RecvRpc).apply
_functorch_active = torch._C._are_functorch_transforms_active


class _InContext:
    """A request's function, run inside the caller's autograd context."""

    def __init__(self, context_id: int, func) -> None:
        self.context_id = context_id
        self.func = func
        # what the agent looks at: async marker and the name in error messages
        if is_async(func):
            setattr(self, ASYNC_ATTR, func)
        self.__module__ = getattr(func, "__module__", None) or __name__
        self.__qualname__ = (getattr(func, "__qualname__", None)
                             or getattr(func, "__name__", None) or repr(func))

    def __reduce__(self):
        return _InContext, (self.context_id, self.func)

    def __repr__(self) -> str:
        return f"<{self.__qualname__} in autograd context {self.context_id}>"

    def __call__(self, *args, **kwargs):
        cid = self.context_id
        container().get_or_create(cid)
        prev = ser.set_grad_context(cid)
        try:
            result = self.func(*args, **kwargs)
        finally:
            ser.set_grad_context(prev)
        if type(result) is Deferred:  # torchwire-internal (RRef) functions reply later
            result = result.future
        elif type(result) is types.CoroutineType:  # async def: runs on the worker's loop
            return _in_context_coroutine(cid, result)
        elif not isinstance(result, torch._C.Future) or not is_async(self):
            return _Reply(cid, result)
        out = Future()

        def done(f) -> None:
            try:
                out.set_result(_Reply(cid, f.value()))
            except Exception as exc:
                out.set_exception(exc)
        torch._C.Future.add_done_callback(result, done)
        return out if is_async(self) else Deferred(out)


async def _in_context_coroutine(cid: int, coro):
    """``coro`` run with autograd context ``cid`` set while each of its steps runs (the
    loop's thread interleaves other tasks, with other contexts, between steps); its
    value replied in the context."""
    return await _StepsInContext(cid, coro)


class _StepsInContext:
    __slots__ = ("cid", "coro")

    def __init__(self, cid: int, coro) -> None:
        self.cid = cid
        self.coro = coro

    def __await__(self):
        coro, cid = self.coro, self.cid
        send, error = None, None
        while True:
            prev = ser.set_grad_context(cid)
            try:
                step = coro.send(send) if error is None else coro.throw(error)
            except StopIteration as stop:
                return _Reply(cid, stop.value)
            finally:
                ser.set_grad_context(prev)
            try:
                send, error = (yield step), None
            except BaseException as exc:  # cancellation included: into the coroutine
                send, error = None, exc


class _Reply:
    """A reply of a request made in a context: pickled as its value, in the context."""

    __slots__ = ("context_id", "value")

    def __init__(self, context_id: int, value) -> None:
        self.context_id = context_id
        self.value = value

    def __reduce__(self):
        send = ser.current_send()
        if send is not None:
            send.grad_ctx = self.context_id
        return _identity, (self.value,)


def _identity(value):
    return value


class _GradHook:
    """The serialization layer's view of distributed autograd (``ser.AutogradHook``)."""

    @staticmethod
    def outgoing(send, call):
        cid = ser.grad_context()
        send.grad_ctx = cid
        container().note_worker(cid, send.dest)
        func, args, kwargs = call
        return _InContext(cid, func), args, kwargs

    # plain calls (ser.plain_call / plain_call_decode)
    @staticmethod
    def record(context_id: int, t: torch.Tensor) -> tuple[int, int]:
        c = container()
        return c.rank, c.record_send(context_id, t)

    @staticmethod
    def note_worker(context_id: int, dest: int) -> None:
        container().note_worker(context_id, dest)

    recv = staticmethod(_rebuild_recv)
    in_context = _InContext

    @staticmethod
    def plain_reply(value):
        """``ser.plain_reply`` of a reply in a context: a tensor (one that requires grad
        is recorded as a send entry and arrives through a recv node), or None."""
        if type(value) is not _Reply:
            return None
        v = value.value
        if v is None or type(v) is not torch.Tensor or not v.requires_grad:
            return ser.plain_reply(v) if type(v) is not _Reply else None
        d = v.detach()
        meta = ser.plain_meta(d)
        if meta is None:
            return None
        c = container()
        sid = c.record_send(value.context_id, v)
        return _RECV_BYTE + marshal.dumps((value.context_id, c.rank, sid) + meta), [d]

    @staticmethod
    def reduce_tensor(send, t: torch.Tensor):
        if t.is_nested and t.layout is torch.strided:
            # autograd's recv node needs sizes, which such a tensor has not
            raise SerializationError(
                "a nested tensor of strided layout that requires grad cannot travel in a "
                "distributed autograd context; send a jagged one (layout=torch.jagged) or "
                "t.unbind()")
        c = container()
        sid = c.record_send(send.grad_ctx, t)
        return _rebuild_recv, (send.grad_ctx, c.rank, sid, t.detach())


_RECV_BYTE = bytes([AutogradKind.RECV])


def _plain_recv(payload, tensors) -> torch.Tensor:
    """A plain reply's tensor that requires grad: through a recv node, as pickled."""
    context_id, src, send_id, code, shape = ser.plain_body(payload, 5)
    t = ser.plain_tensor(ser.one_buffer(tensors), code, shape)
    return _rebuild_recv(context_id, src, send_id, t)


ser.hooks.set_autograd(_GradHook())
ser.hooks.register_plain(AutogradKind.RECV, decoder=_plain_recv)
