"""The RPC pickler: a message to (payload bytes, tensor table) and back.

A pickler lifts every tensor out of the pickle stream (TensorPipe's payload +
tensor-table split): the stream keeps only each tensor's metadata and its index
in the table; the table's raw bytes travel as separate buffers.  A view sends
only the memory it spans, never its whole storage; views of one storage in one
message arrive sharing one (``sharing.py``).  Quantized and nested tensors travel
as the plain tensors they are made of (``layouts.py``).
On the receiving side the transport reads each buffer straight into a freshly
allocated ``uint8`` tensor (or a ``bytearray`` for a small one) and the unpickler
re-types it in place (``view(dtype).view(shape)``): no copy after the bytes leave
the socket.

Types of the layers above (RRefs, ``RemoteModule``) are reduced by what they
registered in :data:`.hooks.hooks`; tensors that require grad in a message of a
distributed autograd context go to the autograd hook registered there.

Functions and classes travel by reference.  A message holding one that cannot (a
lambda, a closure, an interactive ``__main__``'s; see ``closures.py``) is pickled
again by a cloudpickle-based pickler that sends it by value, tensors still lifted
out as above.
"""

from __future__ import annotations

import importlib
import io
import math
import pickle
import types
from typing import Any

import cloudpickle
import torch

from .._base.errors import SerializationError, WorkerUnavailableError
from . import closures, cuda_host, cuda_ipc, layouts, sharing
from .hooks import hooks
from .state import grad as _grad
from .state import tls as _tls

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# A non-contiguous tensor travels with its strides when the memory it spans is at
# most this many times its elements; a sparser view is compacted first.
_MAX_SPAN_RATIO = 4

# How the pickler treats each exact type (filled lazily): None = as pickle does.
_TENSOR, _SCRIPT, _FUTURE, _CODE = object(), object(), object(), object()
_dispatch: dict[type, Any] = {}
hooks.watch_reducers(_dispatch.clear)


def _resolve(t: type):
    if issubclass(t, torch.Tensor):
        return _TENSOR
    reducer = hooks.reducer_for(t)
    if reducer is not None:
        return reducer
    if issubclass(t, torch.jit.ScriptFunction):
        return _SCRIPT
    if issubclass(t, torch._C.Future):
        return _FUTURE
    if t is types.FunctionType or issubclass(t, type):
        return _CODE
    return None


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- rebuilding


def _typed(index: int, dtype: torch.dtype) -> torch.Tensor:
    """Entry ``index`` of the received tensor table as a 1-D tensor of ``dtype`` (one
    torch call).  A reader hands small buffers on as bytearrays (see
    the wire's reader), others as ``uint8`` tensors."""
    raw = _tls.tensors[index]
    if type(raw) is bytearray:
        return torch.frombuffer(raw, dtype=dtype)
    return raw.view(dtype) if dtype is not torch.uint8 else raw


def _rebuild_tensor(index: int, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                    cls: type | None, state: dict | None = None):
    t = _typed(index, dtype)
    t = t.view(shape)
    return _finish_tensor(t, requires_grad, cls, state)


def _rebuild_plain(index: int, dtype: torch.dtype, shape: tuple):
    """Rebuild for the fast path of ``_reduce_tensor``: one or two torch calls (each
    costs microseconds with cold caches, as between messages)."""
    return _shaped(_tls.tensors[index], dtype, shape)


def _shaped(raw, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A received buffer (bytearray or ``uint8`` tensor) as a tensor of ``dtype`` and
    ``shape``."""
    if type(raw) is bytearray:
        t = torch.frombuffer(raw, dtype=dtype)
        if len(shape) != 1:  # a 1-D tensor already has its shape
            # shaped in place (same elements: the storage stays), not a view: a view
            # costs autograd's view tracking, and a received tensor that is a view
            # needs a detach() more (autograd's recv node marks it dirty)
            t.resize_(shape)
    else:
        t = raw.view(dtype) if dtype is not torch.uint8 else raw
        if len(shape) != 1:
            t = t.view(shape)
    return t


def _span(t: torch.Tensor) -> int | None:
    """Elements from a strided tensor's first to its last (a dimension of stride 0, as
    ``expand`` makes, adds none), or None if it has none."""
    if t.numel() == 0:
        return None
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            if stride < 0:
                return None
            span += (size - 1) * stride
    return span


def _rebuild_strided(index: int, dtype: torch.dtype, shape: tuple, stride: tuple,
                     requires_grad: bool, cls: type | None, state: dict | None = None):
    t = _typed(index, dtype).as_strided(shape, stride)
    return _finish_tensor(t, requires_grad, cls, state)


def _rebuild_compacted(index: int, dtype: torch.dtype, shape: tuple, stride: tuple,
                       requires_grad: bool, cls: type | None, state: dict | None = None):
    """A sparse view: its elements (compacted), or the memory it spans (it shared its
    storage with another tensor of the message), which is more than its elements."""
    t = _typed(index, dtype)
    t = t.view(shape) if t.numel() == math.prod(shape) else t.as_strided(shape, stride)
    return _finish_tensor(t, requires_grad, cls, state)


def _rebuild_on_device(index: int, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                       device: str):
    t = _typed(index, dtype).view(shape)
    if t.device.type == "cpu" and device.startswith("cuda"):
        t = cuda_host.to_device(t, device)
    else:
        t = t.to(device)
    return _finish_tensor(t, requires_grad, None)


def _finish_tensor(t: torch.Tensor, requires_grad: bool, cls: type | None,
                   state: dict | None = None):
    if cls is torch.nn.Parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    else:
        if requires_grad:
            t.requires_grad_(True)
        if cls is not None:
            t = t.as_subclass(cls)
    if state:  # a Parameter's or subclass's own attributes, as torch's pickling keeps
        t.__dict__.update(state)
    return t


def _rebuild_sparse_coo(indices, values, size, coalesced: bool, requires_grad: bool):
    # check_invariants: indices from a peer must be validated before any kernel uses them
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                check_invariants=True)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _load_script_function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


class _RpcPickler(pickle.Pickler):
    """Pickler that moves tensors to a side table and knows torchwire's special types."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.spans: dict[int, torch.Tensor] | None = None  # see _reduce_tensor

    def reducer_override(self, obj):
        # Called for nearly every object pickled: one dict lookup by exact type decides.
        t = type(obj)
        try:
            how = _dispatch[t]
        except KeyError:
            how = _dispatch[t] = _resolve(t)
        if how is None:
            return NotImplemented
        if how is _CODE:  # a function or class: by reference, unless it must not
            if obj.__module__ == "__main__" and closures.interactive_main():
                raise closures.ByValue
            return NotImplemented
        return self._reduce_special(how, obj)

    def _reduce_special(self, how, obj):
        if how is _TENSOR:
            return self._reduce_tensor(obj)
        if how is _SCRIPT:
            return self._reduce_script_function(obj)
        if how is _FUTURE:
            raise SerializationError("Can not pickle torch.futures.Future")
        return how(obj)

    def _reduce_tensor(self, t: torch.Tensor):
        # Fast path for the common case (a small, plain, dense, contiguous CPU tensor):
        # every torch call costs microseconds when caches are cold between messages,
        # so it makes as few as it can.
        if hooks.cpu_routed and t.device.type == "cpu":
            routed = self._reduce_routed_cpu_tensor(t)
            if routed is not None:
                return routed
        if (type(t) is torch.Tensor and t.layout is torch.strided and t.is_cpu
                and not t.requires_grad and t.is_contiguous() and not t.is_quantized
                and not (t.is_conj() or t.is_neg())):
            try:
                shape = tuple(t.shape)
            except RuntimeError:  # a nested tensor of strided layout has no shape
                return layouts.reduce_nested(t)
            index = len(self.tensors)
            self.tensors.append(t)
            return _rebuild_plain, (index, t.dtype, shape)
        if t.requires_grad:
            send = _tls.send
            if send is not None and send.grad_ctx is not None and hooks.autograd is not None:
                return hooks.autograd.reduce_tensor(send, t)
        if t.is_nested:
            return layouts.reduce_nested(t)
        if t.is_sparse:
            if t.requires_grad:
                rg, t = True, t.detach()
            else:
                rg = False
            return _rebuild_sparse_coo, (t._indices(), t._values(), tuple(t.shape),
                                         t.is_coalesced(), rg)
        if t.is_quantized:
            return layouts.reduce_quantized(t)
        if t.layout is not torch.strided:
            raise SerializationError(
                f"tensors with layout {t.layout} are not supported; send t.to_dense()")
        if t.device.type != "cpu":
            return self._reduce_device_tensor(t)
        data = t.detach()
        if data.is_conj() or data.is_neg():
            # lazy conjugate / negative views: the bytes in memory are not the values
            data = data.resolve_conj().resolve_neg()
        cls = type(t)
        cls = None if cls is torch.Tensor else cls
        extra = () if cls is None or not t.__dict__ else (dict(t.__dict__),)
        if not data.is_contiguous():
            # torch keeps a non-contiguous tensor's strides.  Send the region of memory the
            # view spans (its own elements and the gaps between them) when that is at most
            # _MAX_SPAN_RATIO x its elements; a sparser view is compacted instead.  Never
            # the whole storage.
            span = _span(data)
            if span is not None:
                region = data.as_strided((span,), (1,), data.storage_offset())
                index = len(self.tensors)
                rebuild = _rebuild_strided
                if span <= _MAX_SPAN_RATIO * data.numel():
                    self.tensors.append(region)
                else:
                    # compacted, unless another tensor of the message shares its storage:
                    # then it goes as its span of the shared region (sharing.share)
                    self.tensors.append(data.contiguous())
                    if self.spans is None:
                        self.spans = {}
                    self.spans[index] = region
                    rebuild = _rebuild_compacted
                return rebuild, (index, t.dtype, tuple(t.shape), tuple(data.stride()),
                                 t.requires_grad, cls, *extra)
            data = data.contiguous()
        index = len(self.tensors)
        self.tensors.append(data)
        return _rebuild_tensor, (index, t.dtype, tuple(t.shape), t.requires_grad, cls, *extra)

    @staticmethod
    def _route(device: torch.device) -> torch.device | None:
        """Where a tensor on ``device`` lands at this message's destination: a call
        through this worker's map, a reply through the inverse of the caller's, a
        one-way message (a backward pass's gradients, which go back along a tensor's
        forward path, either way) through whichever covers it.  None: no map does."""
        send = _tls.send
        router = hooks.device_router
        if send is None or router is None:
            return None
        return router(send.dest, True if send.request else False if send.reply else None,
                      device)

    def _reduce_routed_cpu_tensor(self, t: torch.Tensor):
        """A CPU tensor under a map that names the CPU: onto the mapped device, or None
        (no map covers it: an ordinary CPU tensor)."""
        send = _tls.send
        if t.requires_grad and send is not None and send.grad_ctx is not None:
            return None  # recorded by distributed autograd, which sends t.detach() on
        target = self._route(t.device)
        if target is None or target.type == "cpu" or t.is_sparse or t.is_quantized \
                or t.layout is not torch.strided:
            return None
        data = t.detach().resolve_conj().resolve_neg().contiguous()
        index = len(self.tensors)
        self.tensors.append(data)
        return _rebuild_on_device, (index, t.dtype, tuple(t.shape), t.requires_grad,
                                    str(target))

    def _reduce_device_tensor(self, t: torch.Tensor):
        """A CUDA tensor: through host memory, onto the device the map names."""
        send = _tls.send
        target = self._route(t.device)
        if target is None:
            # torch's wording first: code ported from torch matches on it ("Response
            # device mapping is not available" for a reply, as torch says there)
            reply = send is not None and send.reply
            raise SerializationError(
                ("Response device mapping is not available for destination "
                 f"worker rank {send.dest}: " if reply else "") +
                "TensorPipe RPC backend only supports CPU tensors by default, please move "
                "your tensors to CPU before sending them over RPC, or call `set_device_map` "
                "on `TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
                f"Found tensor on device: {t.device} (no device map to worker rank "
                f"{send.dest if send is not None else '?'} covers it)")
        if target.type == "cuda" and send is not None and send.dest == hooks.device_here:
            # a call to oneself: the loopback copies it on the device, the rebuild
            # moves it to ``target`` if that is another GPU
            data = cuda_ipc.local(t)
            index = len(self.tensors)
            self.tensors.append(data)
            return _rebuild_on_device, (index, t.dtype, tuple(t.shape), t.requires_grad,
                                        str(target))
        if target.type == "cuda" and hooks.device_ipc is not None \
                and cuda_ipc.worth_sharing(t) and hooks.device_ipc(send.dest):
            shared = cuda_ipc.reduce(t, target, t.requires_grad)
            if shared is not None:
                return shared
        data = cuda_host.to_host(t)
        index = len(self.tensors)
        self.tensors.append(data)
        return _rebuild_on_device, (index, t.dtype, tuple(t.shape), t.requires_grad,
                                    str(target))

    @staticmethod
    def _reduce_script_function(fn):
        qual = fn.qualified_name  # "__torch__.<module path>.<name>"
        parts = qual.split(".")
        module = ".".join(parts[1:-1]) or "__main__"
        return _load_script_function, (module, parts[-1])


class _ClosurePickler(cloudpickle.Pickler):
    """The RPC pickler's reductions, with cloudpickle's for functions and classes: what
    cannot be pickled by reference is pickled by value."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.spans: dict[int, torch.Tensor] | None = None  # see _reduce_tensor

    def reducer_override(self, obj):
        t = type(obj)
        how = _dispatch[t] if t in _dispatch else _resolve(t)
        if how is _CODE and closures.main_by_reference(obj):
            return NotImplemented  # a file-run __main__'s: by reference, as the first try
        if how is None or how is _CODE:
            if isinstance(obj, io.IOBase):
                # cloudpickle would send a text file's contents, read from the start,
                # as a StringIO: not what the caller holds (pickle refuses files)
                raise TypeError(f"cannot pickle {t.__qualname__!r} object: an open file "
                                "does not travel (send its name or its contents)")
            return super().reducer_override(obj)
        return self._reduce_special(how, obj)

    _reduce_special = _RpcPickler._reduce_special
    _reduce_tensor = _RpcPickler._reduce_tensor
    _reduce_device_tensor = _RpcPickler._reduce_device_tensor
    _reduce_routed_cpu_tensor = _RpcPickler._reduce_routed_cpu_tensor
    _route = _RpcPickler._route
    _reduce_script_function = _RpcPickler._reduce_script_function


def _dumps_by_value(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` with :class:`_ClosurePickler` (the reference pickler failed).

    Raises:
        SerializationError: ``obj`` cannot be pickled even so; it names the part of
            ``obj`` that fails.
    """
    send = _tls.send
    if send is not None:
        send.abort()  # what the first attempt's reducers did (RRef forks) is undone
    try:
        f = io.BytesIO()
        p = _ClosurePickler(f)
        p.dump(obj)
        return sharing.share(f.getvalue(), p.tensors, _PROTOCOL, p.spans)
    except SerializationError:
        raise
    except Exception as exc:
        if send is not None:
            send.abort()
        where = closures.culprit(obj, _can_pickle)
        raise SerializationError(
            f"cannot pickle {where or _short_type(obj)}: {type(exc).__name__}: {exc} "
            "(not even by value, with cloudpickle)") from exc


def _can_pickle(obj: Any) -> bool:
    """Whether ``obj`` alone pickles by value (to find the culprit of a failure)."""
    send, _tls.send = _tls.send, None  # no RRef fork or autograd record for a probe
    try:
        _ClosurePickler(io.BytesIO()).dump(obj)
        return True
    except Exception:
        return False
    finally:
        _tls.send = send


def dumps(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Serialize ``obj``.

    Returns:
        ``(payload, tensors)``: the pickle stream and the contiguous CPU tensors
        whose bytes must travel with it, in table order.

    Raises:
        SerializationError: ``obj`` (or something inside it) cannot be pickled.
    """
    # One pickler per thread, reset between messages: building a Pickler and its
    # BytesIO costs more than pickling a small call.
    cached = _tls.pickler
    if cached is None or cached[2]:
        f = io.BytesIO()
        cached = [_RpcPickler(f), f, False]
        _tls.pickler = cached
    p, f = cached[0], cached[1]
    cached[2] = True  # in use: a reducer that pickles recursively gets a fresh pickler
    try:
        p.tensors = []
        p.dump(obj)
        tensors = p.tensors
        if len(tensors) < 2:
            return f.getvalue(), tensors
        return sharing.share(f.getvalue(), tensors, _PROTOCOL, p.spans)
    except (SerializationError, WorkerUnavailableError):
        raise  # (an RRef whose owner is gone cannot be sent: its own error)
    except Exception:  # pickle raises PicklingError, TypeError, AttributeError, ByValue
        pass
    finally:
        p.clear_memo()
        p.tensors = []
        p.spans = None
        f.seek(0)
        f.truncate()
        cached[2] = False
    # By reference failed (a lambda, a closure, an interactive __main__'s function):
    # by value.  Off the fast path: this costs tens of microseconds more.
    return _dumps_by_value(obj)


class SendContext:
    """What a reducer may know about the message being pickled, and what it left behind.

    Attributes:
        dest: rank of the worker the message goes to.
        request: True for a call (its reply proves the peer unpickled it), False
            for a reply or a one-way message.
        reply: the message answers a request of ``dest``: its CUDA tensors go through
            the inverse of ``dest``'s device map, not through this worker's.
        pins: objects to keep alive until the request's reply arrives.
        undo: callables that cancel what pickling did, run if the message is
            never sent (pickling failed, the connection is gone).
        grad_ctx: the distributed autograd context the message belongs to (its
            tensors that require grad are recorded there), or None.
    """

    __slots__ = ("dest", "request", "reply", "pins", "undo", "grad_ctx")

    def __init__(self, dest: int, request: bool, reply: bool = False) -> None:
        self.dest = dest
        self.request = request
        self.reply = reply
        self.pins: list = []
        self.undo: list = []
        self.grad_ctx = None

    def abort(self) -> None:
        undo, self.undo, self.pins = self.undo, [], []
        for fn in reversed(undo):
            fn()


def current_send() -> SendContext | None:
    """The :class:`SendContext` of the message being pickled on this thread, if any."""
    return _tls.send


def dumps_to(obj: Any, dest: int, request: bool, reply: bool = False) \
        -> tuple[bytes, list[torch.Tensor], SendContext | None]:
    """:func:`dumps` for a message to worker ``dest``: a call (``request``), a reply
    (``reply``) or a one-way message (neither).

    Returns:
        ``(payload, tensors, ctx)``; ``ctx`` is None unless a reducer recorded pins
        or undo actions, which the caller must keep (pins) or run if the message is
        not sent (``ctx.abort()``).
    """
    prev = _tls.send
    ctx = _tls.send = SendContext(dest, request, reply)
    try:
        if request and _grad.context is not None:
            obj = hooks.autograd.outgoing(ctx, obj)
        payload, tensors = dumps(obj)
    except BaseException:
        ctx.abort()
        raise
    finally:
        _tls.send = prev
    return payload, tensors, (ctx if ctx.pins or ctx.undo else None)


def add_gate(fut) -> bool:
    """From a reducer's rebuild function: the message's function must not run before
    ``fut`` completes.  Returns False when the message being decoded takes no gates
    (a reply)."""
    gates = _tls.gates
    if gates is None:
        return False
    gates.append(fut)
    return True


def loads(payload, tensors: list, gates=None) -> Any:
    """Inverse of :func:`dumps`; ``tensors`` are the received ``uint8`` buffers.

    ``gates``: a list to collect the futures that rebuild functions ask the caller to
    wait for before using the result (see :func:`add_gate`); None for no gating.

    Raises:
        SerializationError: the payload cannot be unpickled here.
    """
    tls = _tls
    prev, prev_gates = tls.tensors, tls.gates
    tls.tensors, tls.gates = tensors, gates
    try:
        return pickle.loads(payload)
    except Exception as exc:
        hint = ""
        if isinstance(exc, (AttributeError, ImportError)):
            hint = (" (a module-level function or class travels by reference: it must be "
                    "importable under the same module name on both workers; lambdas, "
                    "closures and an interactive __main__'s travel by value)")
        raise SerializationError(
            f"cannot unpickle message: {type(exc).__name__}: {exc}{hint}") from exc
    finally:
        tls.tensors, tls.gates = prev, prev_gates


def _short_type(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"
