"""The plain codec: messages in a fixed layout, not pickled.

With the caches cold, as they are between the messages of a training step, pickling
and unpickling even a small message costs tens of microseconds each side; a fixed
layout costs a few.  A frame with the PLAIN flag carries one of these instead of a
pickle stream.  Its payload's first byte is the message *kind* (an ``IntEnum``
member, registered in :data:`.hooks.hooks`), then a ``marshal`` of ints, floats and
strings; tensors travel as the frame's buffers, each described by
``(dtype number, shape)``.  Three uses:

* **one-way requests** of the layers above (distributed autograd's gradients,
  reports and context releases): the agent hands the payload to the handler the
  sender's layer registered for its kind;
* **replies** (:func:`plain_reply` / :func:`plain_value`): None, a plain tensor, or
  a tensor of an autograd context (decoded by what autograd registered);
* **calls** (:func:`plain_call` / :func:`plain_call_decode`): a module-level Python
  function with simple positional arguments.

Anything else is pickled (:mod:`.pickler`).  A decoder raises only
:class:`ProtocolError` or :class:`SerializationError`, whatever the bytes.
"""

from __future__ import annotations

import enum
import importlib
import marshal
import math
import sys
import types
from typing import Any

import torch

from .._base.asyncexec import ASYNC_ATTR
from .._base.errors import ProtocolError, SerializationError
from .closures import interactive_main
from .hooks import hooks
from .pickler import SendContext, _shaped
from .sharing import shares
from .state import grad as _grad


class PlainKind(enum.IntEnum):
    """The serialization layer's own plain message kinds.  Values are part of the wire
    format; the other layers' kinds (distributed autograd's) take other values."""

    NONE = 4  # reply: None
    TENSOR = 5  # reply: a plain tensor
    CALL = 7  # request with a request id: a call


hooks.claim_plain(PlainKind)

_PLAIN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                 torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool)
_PLAIN_CODES = {d: i for i, d in enumerate(_PLAIN_DTYPES)}


def plain_meta(t) -> tuple | None:
    """``(dtype number, shape)`` of a tensor that an internal message can carry as its
    raw bytes (a plain, dense, contiguous CPU tensor that needs no autograd), else
    None (it must be pickled, as every tensor is when a device map names the CPU)."""
    if (type(t) is torch.Tensor and t.layout is torch.strided and t.is_cpu
            and not hooks.cpu_routed and not t.requires_grad and t.is_contiguous()
            and not (t.is_conj() or t.is_neg())):
        code = _PLAIN_CODES.get(t.dtype)
        if code is not None:
            try:
                return code, tuple(t.shape)
            except RuntimeError:  # a nested tensor of strided layout has no shape
                return None
    return None


def plain_body(payload, n: int | None = None):
    """The ``marshal``-ed body of a plain message (after its kind byte); with ``n``,
    checked to be a tuple of ``n`` items.

    Raises:
        ProtocolError: malformed.
    """
    data = memoryview(payload)[1:]
    _check_sizes(data)
    try:
        body = marshal.loads(data)
    except (EOFError, ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed plain message: {exc}") from None
    if n is not None and (type(body) is not tuple or len(body) != n):
        raise ProtocolError(f"malformed plain message: not {n} fields")
    return body


# marshal's codes for what plain messages hold (FLAG_REF, 0x80, may be added):
# their fixed sizes, and the codes followed by a count (of bytes or of items).
_FIXED = {ord("N"): 0, ord("T"): 0, ord("F"): 0, ord("i"): 4, ord("g"): 8, ord("r"): 4}
_COUNT4 = {ord(c) for c in "(usta[A"}
_COUNT1 = {ord(c) for c in ")zZ"}
_CONTAINERS = {ord(c) for c in "()["}


def _check_sizes(data) -> None:
    """Check a marshal stream's declared lengths against what the stream holds,
    before ``marshal.loads`` allocates them: a header claiming a tuple of a
    billion items must not cost gigabytes (only the types plain messages use).

    Raises:
        ProtocolError: a type plain messages never hold, or a count the bytes left
            cannot satisfy.
    """
    end, pos, todo = len(data), 0, 1
    while todo:
        if pos >= end:
            raise ProtocolError("malformed plain message: truncated")
        code = data[pos] & 0x7F
        pos += 1
        todo -= 1
        if code in _FIXED:
            pos += _FIXED[code]
            continue
        if code == ord("l"):  # a long: count of 15-bit digits, two bytes each
            count = int.from_bytes(data[pos:pos + 4], "little", signed=True)
            pos += 4 + 2 * abs(count)
            continue
        if code in _COUNT4:
            count = int.from_bytes(data[pos:pos + 4], "little", signed=True)
            pos += 4
        elif code in _COUNT1:
            count = data[pos] if pos < end else 0
            pos += 1
        else:
            raise ProtocolError(f"malformed plain message: marshal type {code:#x}")
        if count < 0 or count > end - pos:  # every item or byte takes a byte at least
            raise ProtocolError(f"malformed plain message: {count} items or bytes in "
                                f"{end - pos} left")
        if code in _CONTAINERS:
            todo += count
        else:
            pos += count
    if pos > end:
        raise ProtocolError("malformed plain message: truncated")


def one_buffer(tensors) -> Any:
    """The single buffer of a plain tensor reply.

    Raises:
        ProtocolError: not exactly one."""
    if len(tensors) != 1:
        raise ProtocolError(f"plain tensor reply with {len(tensors)} buffers")
    return tensors[0]


_NONE_REPLY = bytes([PlainKind.NONE])
_TENSOR_REPLY = bytes([PlainKind.TENSOR])
_K_NONE, _K_TENSOR = int(PlainKind.NONE), int(PlainKind.TENSOR)


def plain_reply(value) -> tuple[bytes, list] | None:
    """``(payload, tensors)`` of a reply ``value`` that needs no pickling (None, a
    plain tensor, or what the grad hook takes: a tensor replied in an autograd
    context), else None."""
    if value is None:
        return _NONE_REPLY, []
    if type(value) is torch.Tensor:
        meta = plain_meta(value)
        return None if meta is None else (_TENSOR_REPLY + marshal.dumps(meta), [value])
    hook = hooks.autograd
    if hook is not None:
        return hook.plain_reply(value)
    return None


def plain_value(payload, tensors) -> Any:
    """Inverse of :func:`plain_reply`.

    Raises:
        ProtocolError: a malformed or unknown plain reply.
    """
    kind = payload[0] if payload else None
    if kind == _K_NONE:
        return None
    if kind == _K_TENSOR:
        code, shape = plain_body(payload, 2)
        return plain_tensor(one_buffer(tensors), code, shape)
    decode = hooks.plain_decoder(kind)
    if decode is None:
        raise ProtocolError(f"unknown plain reply kind {kind}")
    return decode(payload, tensors)


_CALL_BYTE = bytes([PlainKind.CALL])
_SCALARS = (type(None), bool, int, float, str)
_FUNCTION = types.FunctionType
# An argument's form in a plain call (first item of its description).
_ARG_TENSOR, _ARG_GRAD, _ARG_VALUE, _ARG_RREF = 0, 1, 2, 3


def plain_call(func, args, kwargs, dest: int) -> tuple[bytes, list, SendContext | None] | None:
    """``(payload, tensors, ctx)`` of a request that needs no pickling, as
    :func:`dumps_to` for ``(func, args, kwargs)``, else None.

    Plain: a module-level Python function (named by module and name, as pickle does),
    no keyword arguments, and positional arguments that are each None, a bool, int,
    float or str, a plain dense CPU tensor (one that requires grad only inside an
    autograd context: it is recorded as a send entry, as pickled), or an RRef sent to
    its owner."""
    if args is None:
        args = ()
    if kwargs or type(func) is not _FUNCTION or type(args) is not tuple:
        return None
    name = func.__name__
    if func.__qualname__ != name or getattr(func, ASYNC_ATTR, None) is not None:
        return None  # (is_async, inlined: every call's path)
    module = func.__module__
    mod = sys.modules.get(module) if type(module) is str else None
    if mod is None or getattr(mod, name, None) is not func or \
            (module == "__main__" and interactive_main()):
        return None
    cid = _grad.context
    grad_hook = hooks.autograd
    rrefs = hooks.rref
    metas = []  # (dtype number, shape, detached) of each tensor argument, in order
    for a in args:  # every argument first: nothing is recorded for a pickled call
        t = type(a)
        if t is torch.Tensor:
            if a.requires_grad:
                if cid is None or grad_hook is None:
                    return None
                d = a.detach()
            else:
                d = a
            meta = plain_meta(d)
            if meta is None:
                return None
            metas.append((meta[0], meta[1], d))
        elif t not in _SCALARS and not (rrefs is not None and t is rrefs.rref_type
                                        and rrefs.can(a, dest)):
            return None
    if len(metas) > 1 and shares([m[2] for m in metas]):
        return None  # pickled: tensors that share memory arrive sharing it
    send = SendContext(dest, True)
    descs, tensors = [], []
    k = 0
    for a in args:
        t = type(a)
        if t is torch.Tensor:
            code, shape, d = metas[k]
            k += 1
            if d is not a:  # requires grad: a send entry
                rank, sid = grad_hook.record(cid, a)
                descs.append((_ARG_GRAD, code, shape, rank, sid))
            else:
                descs.append((_ARG_TENSOR, code, shape))
            tensors.append(d)
        elif t in _SCALARS:
            descs.append((_ARG_VALUE, a))
        else:
            descs.append((_ARG_RREF,) + rrefs.encode(a, send))
    if cid is not None:
        grad_hook.note_worker(cid, dest)
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
        func = None if mod is None else getattr(mod, name, None)
        if func is None:
            # not imported yet, or still being imported by another thread (requests run
            # in parallel): the import system waits for the module to finish
            func = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SerializationError(
            f"cannot unpickle message: {type(exc).__name__}: {exc} (the RPC pickler does "
            "not serialize function code: a function must be defined, importable under "
            "the same module name, on both workers)") from exc
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed plain request: {exc}") from None
    if type(func) is not _FUNCTION:
        raise ProtocolError(f"plain request names {module}.{name}, not a function")
    grad_hook = hooks.autograd
    if cid is not None and grad_hook is None:
        raise ProtocolError("plain call in an autograd context, and distributed autograd is "
                            "not loaded here")
    args = []
    it = iter(tensors)
    try:
        for d in descs:
            form = d[0]
            if form == _ARG_TENSOR:
                args.append(plain_tensor(next(it), d[1], d[2]))
            elif form == _ARG_GRAD:
                t = plain_tensor(next(it), d[1], d[2])
                args.append(grad_hook.recv(cid, d[3], d[4], t))
            elif form == _ARG_VALUE:
                args.append(d[1])
            elif form == _ARG_RREF:
                if hooks.rref is None:
                    raise ProtocolError("plain call with an RRef, and RRefs are not loaded here")
                args.append(hooks.rref.decode(d[1:]))
            else:
                raise ProtocolError(f"unknown argument form {form}")
    except (StopIteration, IndexError, TypeError) as exc:
        raise ProtocolError(f"malformed plain request: {type(exc).__name__} {exc}") from None
    if next(it, None) is not None:
        raise ProtocolError("plain request with more buffers than tensors")
    if cid is not None:
        func = grad_hook.in_context(cid, func)
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
