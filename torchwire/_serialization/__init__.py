"""Messages to (payload bytes, tensor table) and back.

A pickler lifts every tensor out of the pickle stream (TensorPipe's payload +
tensor-table split): the stream keeps only each tensor's metadata and its index
in the table; the table's raw bytes travel as separate buffers.  A view sends
only its own elements (``numel * itemsize`` bytes), never its whole storage.
On the receiving side the transport reads each buffer straight into a freshly
allocated ``uint8`` tensor and the unpickler re-types it in place
(``view(dtype).view(shape)``): no copy after the bytes leave the socket.

Hooks: later layers (RRefs, distributed autograd) register reducers for their
own types with :func:`register_reducer`, and may wrap received tensors through
the thread-local unpickling context; the agent never imports them.  Distributed
autograd installs one more hook with :func:`set_grad_hook`: it sees requests sent
by a thread that has an autograd context (:func:`set_grad_context`) and tensors
that require grad in messages of such a context; nothing else reaches it.
"""

from __future__ import annotations

import importlib
import io
import marshal
import math
import pickle
import sys
import threading
import types
from typing import Any, Callable

import torch

from .._base.errors import ProtocolError, RemoteError, SerializationError
from .._wire.buffers import byte_view  # noqa: F401 - part of this layer's API

_PROTOCOL = pickle.HIGHEST_PROTOCOL
class _Tls(threading.local):
    """Per-thread state of the message being pickled or unpickled.  Class attributes
    are the defaults: a missing one would be an AttributeError raised and caught on
    every ``getattr(_tls, name, None)`` (microseconds, with the caches cold)."""

    send = None  # SendContext of the message being pickled
    pickler = None  # [pickler, its BytesIO, in use]
    tensors = None  # the received tensor table being unpickled
    recv_hook = None
    gates = None


_tls = _Tls()

# type -> reducer(obj) returning a pickle reduce tuple; consulted for exact type first.
_extra_reducers: dict[type, Callable[[Any], Any]] = {}


def register_reducer(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Make the RPC pickler reduce instances of ``cls`` (and subclasses) with ``reducer``."""
    _extra_reducers[cls] = reducer
    _dispatch.clear()


# How the pickler treats each exact type (filled lazily): None = as pickle does.
_TENSOR, _SCRIPT, _FUTURE = object(), object(), object()
_dispatch: dict[type, Any] = {}


def _resolve(t: type):
    if issubclass(t, torch.Tensor):
        return _TENSOR
    reducer = _extra_reducers.get(t)
    if reducer is not None:
        return reducer
    for cls, fn in _extra_reducers.items():
        if issubclass(t, cls):
            return fn
    if issubclass(t, torch.jit.ScriptFunction):
        return _SCRIPT
    if issubclass(t, torch._C.Future):
        return _FUTURE
    return None


class _GradState(threading.local):
    context: Any = None  # the autograd context id this thread's requests carry


_grad = _GradState()
# Distributed autograd's hook object (None until torchwire.autograd is imported):
#   outgoing(send, call) -> call   a request sent while the thread has a context
#   reduce_tensor(send, t)         a tensor requiring grad, in a message whose
#                                  SendContext has grad_ctx set; a reduce tuple
_grad_hook: Any = None


def set_grad_hook(hook) -> None:
    """Install distributed autograd's hook (see ``_grad_hook``)."""
    global _grad_hook
    _grad_hook = hook


def grad_context():
    """The autograd context id requests sent from this thread carry (None: none)."""
    return _grad.context


def set_grad_context(context_id) -> Any:
    """Set this thread's autograd context id; returns the previous one."""
    prev, _grad.context = _grad.context, context_id
    return prev


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- pickling


def _typed(index: int, dtype: torch.dtype) -> torch.Tensor:
    """Entry ``index`` of the received tensor table as a 1-D tensor of ``dtype`` (one
    torch call).  A reader hands small buffers on as bytearrays (see
    ``connection._SMALL_BUFFER``), others as ``uint8`` tensors."""
    raw = _tls.tensors[index]
    if type(raw) is bytearray:
        return torch.frombuffer(raw, dtype=dtype)
    return raw.view(dtype) if dtype is not torch.uint8 else raw


def _rebuild_tensor(index: int, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                    cls: type | None):
    t = _typed(index, dtype)
    t = t.view(shape)
    return _finish_tensor(t, requires_grad, cls)


_MAX_SPAN_RATIO = 4


def _rebuild_plain(index: int, dtype: torch.dtype, shape: tuple):
    """Rebuild for the fast path of ``_reduce_tensor``: one or two torch calls (each
    costs microseconds with cold caches, as between messages)."""
    t = _shaped(_tls.tensors[index], dtype, shape)
    hook = _tls.recv_hook
    return hook(t) if hook is not None else t


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


# Internal messages that are not pickled (``RpcAgent.notify_plain``).  Their handlers by
# first payload byte, ``handler(src_rank, payload, tensors)``, registered by the modules
# that send them when imported (a worker gets one only from a peer whose messages of
# that module reached it first); the dtypes of their tensors by number.
PLAIN_HANDLERS: dict[int, Callable] = {}
# Their kinds (first byte), part of the wire format: the distributed backward pass's
# gradients and reports, and the release of an autograd context.
PLAIN_GRADS, PLAIN_REPORT, PLAIN_RELEASE = 1, 2, 3
# Replies can be plain too (a RESPONSE with the PLAIN flag, see :func:`plain_reply`):
# None, a plain tensor, and (distributed autograd's) a tensor of a context's reply,
# decoded by ``PLAIN_VALUES[kind](payload, tensors)``.
PLAIN_NONE, PLAIN_TENSOR, PLAIN_RECV = 4, 5, 6
PLAIN_VALUES: dict[int, Callable] = {}
# And requests (a REQUEST with the PLAIN flag and a request id, see :func:`plain_call`).
PLAIN_CALL = 7

_PLAIN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                 torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool)
_PLAIN_CODES = {d: i for i, d in enumerate(_PLAIN_DTYPES)}


def plain_meta(t) -> tuple | None:
    """``(dtype number, shape)`` of a tensor that an internal message can carry as its
    raw bytes (a plain, dense, contiguous CPU tensor that needs no autograd), else
    None (it must be pickled)."""
    if (type(t) is torch.Tensor and t.layout is torch.strided and t.is_cpu
            and not t.requires_grad and t.is_contiguous()
            and not (t.is_conj() or t.is_neg())):
        code = _PLAIN_CODES.get(t.dtype)
        if code is not None:
            return code, tuple(t.shape)
    return None


def plain_body(payload, n: int | None = None):
    """The ``marshal``-ed body of a plain message (after its kind byte); with ``n``,
    checked to be a tuple of ``n`` items.

    Raises:
        ProtocolError: malformed.
    """
    try:
        body = marshal.loads(memoryview(payload)[1:])
    except (EOFError, ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed plain message: {exc}") from None
    if n is not None and (type(body) is not tuple or len(body) != n):
        raise ProtocolError(f"malformed plain message: not {n} fields")
    return body


def one_buffer(tensors) -> Any:
    """The single buffer of a plain tensor reply.

    Raises:
        ProtocolError: not exactly one."""
    if len(tensors) != 1:
        raise ProtocolError(f"plain tensor reply with {len(tensors)} buffers")
    return tensors[0]


_NONE_REPLY = bytes([PLAIN_NONE])
_TENSOR_REPLY = bytes([PLAIN_TENSOR])


def plain_reply(value) -> tuple[bytes, list] | None:
    """``(payload, tensors)`` of a reply ``value`` that needs no pickling (None, a
    plain tensor, or what the grad hook takes: a tensor replied in an autograd
    context), else None.  Pickling and unpickling even a small tensor costs ~50 µs
    with the caches cold (as between messages); this ~15."""
    if value is None:
        return _NONE_REPLY, []
    if type(value) is torch.Tensor:
        meta = plain_meta(value)
        return None if meta is None else (_TENSOR_REPLY + marshal.dumps(meta), [value])
    if _grad_hook is not None:
        return _grad_hook.plain_reply(value)
    return None


def plain_value(payload, tensors) -> Any:
    """Inverse of :func:`plain_reply`.

    Raises:
        ProtocolError: a malformed or unknown plain reply.
    """
    kind = payload[0] if payload else None
    if kind == PLAIN_NONE:
        return None
    if kind == PLAIN_TENSOR:
        code, shape = plain_body(payload, 2)
        return plain_tensor(one_buffer(tensors), code, shape)
    decode = PLAIN_VALUES.get(kind)
    if decode is None:
        raise ProtocolError(f"unknown plain reply kind {kind}")
    return decode(payload, tensors)


_CALL_BYTE = bytes([PLAIN_CALL])
_SCALARS = (type(None), bool, int, float, str)
_FUNCTION = types.FunctionType
# An argument's form in a plain call (first item of its description).
_ARG_TENSOR, _ARG_GRAD, _ARG_VALUE, _ARG_RREF = 0, 1, 2, 3
# RRefs: (RRef type, handler) set by the RRef module (``set_plain_rref``).
_plain_rref: tuple | None = None


def set_plain_rref(rref_type: type, handler) -> None:
    """RRef arguments of plain calls: ``handler.can(rref, dest)``, ``handler.encode(rref,
    send)`` (a tuple of ints) and ``handler.decode(desc)``."""
    global _plain_rref
    _plain_rref = (rref_type, handler)


def plain_call(func, args, kwargs, dest: int) -> tuple[bytes, list, SendContext | None] | None:
    """``(payload, tensors, ctx)`` of a request that needs no pickling, as
    :func:`dumps_to` for ``(func, args, kwargs)``, else None.

    Plain: a module-level Python function (named by module and name, as pickle does),
    no keyword arguments, and positional arguments that are each None, a bool, int,
    float or str, a plain dense CPU tensor (one that requires grad only inside an
    autograd context: it is recorded as a send entry, as pickled), or an RRef sent to
    its owner.  With the caches cold, as between messages, pickling and unpickling
    such a call costs ~50-120 µs; the plain form about half, most of it building the
    tensors."""
    if args is None:
        args = ()
    if kwargs or type(func) is not _FUNCTION or type(args) is not tuple:
        return None
    name = func.__name__
    if func.__qualname__ != name or getattr(func, "_wrapped_async_rpc_function", None) \
            is not None:
        return None
    module = func.__module__
    mod = sys.modules.get(module) if type(module) is str else None
    if mod is None or getattr(mod, name, None) is not func:
        return None
    cid = _grad.context
    rrefs = _plain_rref
    metas = []  # (dtype number, shape, detached) of each tensor argument, in order
    for a in args:  # every argument first: nothing is recorded for a pickled call
        t = type(a)
        if t is torch.Tensor:
            if a.requires_grad:
                if cid is None or _grad_hook is None:
                    return None
                d = a.detach()
            else:
                d = a
            meta = plain_meta(d)
            if meta is None:
                return None
            metas.append((meta[0], meta[1], d))
        elif t not in _SCALARS and not (rrefs is not None and t is rrefs[0]
                                        and rrefs[1].can(a, dest)):
            return None
    send = SendContext(dest, True)
    descs, tensors = [], []
    k = 0
    for a in args:
        t = type(a)
        if t is torch.Tensor:
            code, shape, d = metas[k]
            k += 1
            if d is not a:  # requires grad: a send entry
                rank, sid = _grad_hook.record(cid, a)
                descs.append((_ARG_GRAD, code, shape, rank, sid))
            else:
                descs.append((_ARG_TENSOR, code, shape))
            tensors.append(d)
        elif t in _SCALARS:
            descs.append((_ARG_VALUE, a))
        else:
            descs.append((_ARG_RREF,) + rrefs[1].encode(a, send))
    if cid is not None:
        _grad_hook.note_worker(cid, dest)
    payload = _CALL_BYTE + marshal.dumps((module, name, cid, descs))
    return payload, tensors, (send if send.pins or send.undo else None)


def plain_call_decode(payload, tensors) -> tuple:
    """Inverse of :func:`plain_call`: ``(func, args, None)``; a call made in an
    autograd context runs in it (the grad hook wraps ``func``).

    Raises:
        ProtocolError: malformed.
        SerializationError: the function is not found here.
    """
    module, name, cid, descs = plain_body(payload, 4)
    try:
        mod = sys.modules.get(module)
        if mod is None:
            mod = importlib.import_module(module)
        func = getattr(mod, name)
    except (ImportError, AttributeError) as exc:
        raise SerializationError(
            f"cannot unpickle message: {type(exc).__name__}: {exc} (the RPC pickler does "
            "not serialize function code: a function must be defined, importable under "
            "the same module name, on both workers)") from exc
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed plain request: {exc}") from None
    if type(func) is not _FUNCTION:
        raise ProtocolError(f"plain request names {module}.{name}, not a function")
    if cid is not None and _grad_hook is None:
        importlib.import_module("torchwire.autograd")  # installs it (as unpickling would)
    args = []
    it = iter(tensors)
    try:
        for d in descs:
            form = d[0]
            if form == _ARG_TENSOR:
                args.append(plain_tensor(next(it), d[1], d[2]))
            elif form == _ARG_GRAD:
                t = plain_tensor(next(it), d[1], d[2])
                args.append(_grad_hook.recv(cid, d[3], d[4], t))
            elif form == _ARG_VALUE:
                args.append(d[1])
            elif form == _ARG_RREF:
                args.append(_plain_rref[1].decode(d[1:]))
            else:
                raise ProtocolError(f"unknown argument form {form}")
    except (StopIteration, IndexError, TypeError) as exc:
        raise ProtocolError(f"malformed plain request: {type(exc).__name__} {exc}") from None
    if next(it, None) is not None:
        raise ProtocolError("plain request with more buffers than tensors")
    if cid is not None:
        func = _grad_hook.in_context(cid, func)
    return func, tuple(args), None


def plain_tensor(raw, code: int, shape) -> torch.Tensor:
    """Inverse of :func:`plain_meta` for a received buffer.

    Raises:
        ProtocolError: the description does not fit the buffer.
    """
    try:
        dtype = _PLAIN_DTYPES[code]
        shape = tuple(shape)
        size = len(raw) if type(raw) is bytearray else raw.numel()
        if math.prod(shape) * dtype.itemsize != size or min(shape, default=0) < 0:
            raise ValueError(f"shape {shape} of {dtype} in a buffer of {size} bytes")
        if not size:
            return torch.empty(shape, dtype=dtype)
        return _shaped(raw, dtype, shape)
    except (IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise ProtocolError(f"malformed tensor in an internal message: {exc}") from None


def _span(t: torch.Tensor) -> int | None:
    """Elements from a strided tensor's first to its last, or None if a stride is 0."""
    if t.numel() == 0:
        return None
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            if stride <= 0:
                return None
            span += (size - 1) * stride
    return span


def _rebuild_strided(index: int, dtype: torch.dtype, shape: tuple, stride: tuple,
                     requires_grad: bool, cls: type | None):
    t = _typed(index, dtype).as_strided(shape, stride)
    return _finish_tensor(t, requires_grad, cls)


def _rebuild_on_device(index: int, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                       device: str):
    t = _typed(index, dtype).view(shape)
    return _finish_tensor(t.to(device), requires_grad, None)


# set by the agent when device maps are configured: (dest rank, is request, device) ->
# target device or None
_device_router = None


def set_device_router(router) -> None:
    global _device_router
    _device_router = router


def _finish_tensor(t: torch.Tensor, requires_grad: bool, cls: type | None):
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    if cls is not None:
        t = t.as_subclass(cls)
    hook = getattr(_tls, "recv_hook", None)
    if hook is not None:
        t = hook(t)
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

    def reducer_override(self, obj):
        # Called for nearly every object pickled: one dict lookup by exact type decides.
        t = type(obj)
        try:
            how = _dispatch[t]
        except KeyError:
            how = _dispatch[t] = _resolve(t)
        if how is None:
            return NotImplemented
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
        if (type(t) is torch.Tensor and t.layout is torch.strided and t.is_cpu
                and not t.requires_grad and t.is_contiguous() and not t.is_quantized
                and not (t.is_conj() or t.is_neg())):
            index = len(self.tensors)
            self.tensors.append(t)
            return _rebuild_plain, (index, t.dtype, tuple(t.shape))
        if t.requires_grad and _grad_hook is not None:
            send = getattr(_tls, "send", None)
            if send is not None and send.grad_ctx is not None:
                return _grad_hook.reduce_tensor(send, t)
        if t.is_sparse:
            if t.requires_grad:
                rg, t = True, t.detach()
            else:
                rg = False
            return _rebuild_sparse_coo, (t._indices(), t._values(), tuple(t.shape),
                                         t.is_coalesced(), rg)
        if t.is_quantized:
            raise SerializationError(
                "quantized tensors are not supported by torchwire RPC; "
                "send t.dequantize() or its int_repr() and scale/zero_point instead")
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
        if not data.is_contiguous():
            # torch keeps a non-contiguous tensor's strides.  Send the region of memory the
            # view spans (its own elements and the gaps between them) when that is at most
            # _MAX_SPAN_RATIO x its elements; a sparser view is compacted instead.  Never
            # the whole storage.
            span = _span(data)
            if span is not None and span <= _MAX_SPAN_RATIO * data.numel():
                region = data.as_strided((span,), (1,), data.storage_offset())
                index = len(self.tensors)
                self.tensors.append(region)
                return _rebuild_strided, (index, t.dtype, tuple(t.shape), tuple(data.stride()),
                                          t.requires_grad, cls)
            data = data.contiguous()
        index = len(self.tensors)
        self.tensors.append(data)
        return _rebuild_tensor, (index, t.dtype, tuple(t.shape), t.requires_grad, cls)

    def _reduce_device_tensor(self, t: torch.Tensor):
        """A CUDA tensor: through host memory, onto the device the map names."""
        send = current_send()
        target = None
        if send is not None and _device_router is not None:
            target = _device_router(send.dest, send.request, t.device)
        if target is None:
            # torch's wording first: code ported from torch matches on it
            raise SerializationError(
                "TensorPipe RPC backend only supports CPU tensors by default, please move "
                "your tensors to CPU before sending them over RPC, or call `set_device_map` "
                "on `TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
                f"Found tensor on device: {t.device} (no device map to worker rank "
                f"{send.dest if send is not None else '?'} covers it)")
        data = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
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
    cached = getattr(_tls, "pickler", None)
    if cached is None or cached[2]:
        f = io.BytesIO()
        cached = [_RpcPickler(f), f, False]
        _tls.pickler = cached
    p, f = cached[0], cached[1]
    cached[2] = True  # in use: a reducer that pickles recursively gets a fresh pickler
    try:
        p.tensors = []
        p.dump(obj)
        payload = f.getvalue()
        return payload, p.tensors
    except SerializationError:
        raise
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
        raise SerializationError(f"cannot pickle {_short_type(obj)}: {exc}") from exc
    finally:
        p.clear_memo()
        p.tensors = []
        f.seek(0)
        f.truncate()
        cached[2] = False


class SendContext:
    """What a reducer may know about the message being pickled, and what it left behind.

    Attributes:
        dest: rank of the worker the message goes to.
        request: True for a request (its reply proves the peer unpickled it), False
            for a reply.
        pins: objects to keep alive until the request's reply arrives.
        undo: callables that cancel what pickling did, run if the message is
            never sent (pickling failed, the connection is gone).
        grad_ctx: the distributed autograd context the message belongs to (its
            tensors that require grad are recorded there), or None.
    """

    __slots__ = ("dest", "request", "pins", "undo", "grad_ctx")

    def __init__(self, dest: int, request: bool) -> None:
        self.dest = dest
        self.request = request
        self.pins: list = []
        self.undo: list = []
        self.grad_ctx = None

    def abort(self) -> None:
        undo, self.undo, self.pins = self.undo, [], []
        for fn in reversed(undo):
            fn()


def current_send() -> SendContext | None:
    """The :class:`SendContext` of the message being pickled on this thread, if any."""
    return getattr(_tls, "send", None)


def dumps_to(obj: Any, dest: int, request: bool) \
        -> tuple[bytes, list[torch.Tensor], SendContext | None]:
    """:func:`dumps` for a message to worker ``dest``.

    Returns:
        ``(payload, tensors, ctx)``; ``ctx`` is None unless a reducer recorded pins
        or undo actions, which the caller must keep (pins) or run if the message is
        not sent (``ctx.abort()``).
    """
    prev = getattr(_tls, "send", None)
    ctx = _tls.send = SendContext(dest, request)
    try:
        if request and _grad.context is not None:
            obj = _grad_hook.outgoing(ctx, obj)
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
    gates = getattr(_tls, "gates", None)
    if gates is None:
        return False
    gates.append(fut)
    return True


def loads(payload, tensors: list[torch.Tensor], recv_hook=None, gates=None) -> Any:
    """Inverse of :func:`dumps`; ``tensors`` are the received ``uint8`` buffers.

    ``gates``: a list to collect the futures that rebuild functions ask the caller to
    wait for before using the result (see :func:`add_gate`); None for no gating.

    Raises:
        SerializationError: the payload cannot be unpickled here.
    """
    prev, prev_hook = getattr(_tls, "tensors", None), getattr(_tls, "recv_hook", None)
    prev_gates = getattr(_tls, "gates", None)
    _tls.tensors, _tls.recv_hook, _tls.gates = tensors, recv_hook, gates
    try:
        return pickle.loads(payload)
    except Exception as exc:
        hint = ""
        if isinstance(exc, (AttributeError, ImportError)):
            hint = (" (the RPC pickler does not serialize function code: a function must be "
                    "defined, importable under the same module name, on both workers)")
        raise SerializationError(
            f"cannot unpickle message: {type(exc).__name__}: {exc}{hint}") from exc
    finally:
        _tls.tensors, _tls.recv_hook, _tls.gates = prev, prev_hook, prev_gates


def _short_type(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


# --------------------------------------------------------------------------- exceptions


def dumps_exception(exc: BaseException, worker_desc: str, tb_text: str) -> bytes:
    """Describe an exception with plain strings, so the caller can always decode it."""
    cls = type(exc)
    # str(), not repr(): keeps the message's own newlines instead of "\\n" escapes
    message = f"On {worker_desc}:\n{cls.__name__}({exc})\n{tb_text}"
    return pickle.dumps((cls.__module__, cls.__qualname__, message, worker_desc, tb_text),
                        protocol=_PROTOCOL)


def loads_exception(payload) -> BaseException:
    """Rebuild a remote exception: same type where possible, else :class:`RemoteError`."""
    try:
        module, qualname, message, worker_desc, tb_text = pickle.loads(payload)
    except Exception as exc:
        return RemoteError(f"undecodable remote error: {exc}")
    cls: Any = None
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except Exception:
        cls = None
    exc_obj: BaseException | None = None
    if cls is torch.jit.Error:
        # A TorchScript function failed: torch's RPC raises a RuntimeError for it (the
        # interpreter's error is not one), with the script's own error in the message.
        cls = None
        exc_obj = RemoteError(message, remote_type=f"{module}.{qualname}",
                              worker_name=worker_desc, remote_traceback=tb_text)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            exc_obj = cls(message)
        except Exception:
            exc_obj = None
    if exc_obj is None:
        exc_obj = RemoteError(f"Original exception on remote side was {module}.{qualname} "
                              f"(it could not be rebuilt here): {message}",
                              remote_type=f"{module}.{qualname}",
                              worker_name=worker_desc, remote_traceback=tb_text)
    else:
        try:
            exc_obj.remote_traceback = tb_text  # type: ignore[attr-defined]
            exc_obj.worker_name = worker_desc  # type: ignore[attr-defined]
        except Exception:
            pass
    return exc_obj
