"""The one registry through which the layers above plug into serialization.

Serialization never imports the layers above it (RRefs, distributed autograd, the
public API); each of them registers here what it adds, when it is imported:

=====================  ===============================  =================================
what                   registered by                    used by
=====================  ===============================  =================================
reducers               RRef, RemoteModule               the pickler, for instances of a type
``autograd``           distributed autograd             requests sent in a context, tensors
                       (:class:`AutogradHook`)          that require grad, plain replies
``rref``               RRefs (:class:`RRefCodec`)       RRef arguments of plain calls
``device_router``      the agent (per job)              CUDA tensors: the receiver's device
plain kinds            each layer that sends plain      the agent, for PLAIN frames
                       messages (an ``IntEnum``)
=====================  ===============================  =================================

A plain message (a frame with the PLAIN flag, see :mod:`.plain`) starts with one
byte, its *kind*: a member of the ``IntEnum`` of the layer that sends it.  A kind
is registered once, with the handler of a one-way message or the decoder of a
reply value; two layers cannot claim one byte.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Protocol

import torch

PlainHandler = Callable[[int, Any, list], None]  # (sender rank, payload, buffers)
PlainDecoder = Callable[[Any, list], Any]  # (payload, buffers) -> the reply's value
# (dest rank, a request: True / a reply: False / one-way: None, device) -> device or None
DeviceRouter = Callable[[int, "bool | None", torch.device], "torch.device | None"]


class AutogradHook(Protocol):
    """Distributed autograd's view of messages.  Reached only for a request sent by a
    thread that has an autograd context, a tensor that requires grad in a message of
    such a context, or a reply value of one; a call outside a context pays one
    thread-local read."""

    def outgoing(self, send, call) -> tuple:
        """``(func, args, kwargs)`` of a request sent in a context, as it travels."""

    def reduce_tensor(self, send, t: torch.Tensor) -> tuple:
        """The pickle reduce tuple of a tensor that requires grad (a send entry)."""

    def plain_reply(self, value) -> tuple | None:
        """``(payload, tensors)`` of a reply value made in a context, or None."""

    def record(self, context_id: int, t: torch.Tensor) -> tuple[int, int]:
        """Record ``t`` as a send entry of a plain call: ``(this rank, send id)``."""

    def note_worker(self, context_id: int, dest: int) -> None:
        """A request of the context goes to ``dest``."""

    def recv(self, context_id: int, src: int, send_id: int, t: torch.Tensor) -> torch.Tensor:
        """A received tensor that requires grad, through its recv node."""

    def in_context(self, context_id: int, func) -> Callable:
        """``func``, run inside the context on the callee."""


class RRefCodec(Protocol):
    """RRef arguments of plain calls (``plain.plain_call``)."""

    rref_type: type

    def can(self, rref, dest: int) -> bool:
        """Whether ``rref`` may travel plain to worker ``dest``."""

    def encode(self, rref, send) -> tuple:
        """Its description, a tuple of ints (``send`` may pin it until the reply)."""

    def decode(self, desc: tuple):
        """The RRef a description names, on the receiver."""


class Hooks:
    """What the layers above serialization registered (one instance: :data:`hooks`).

    Attributes read on hot paths (one attribute lookup each): ``autograd``, ``rref``,
    ``device_router``.
    """

    __slots__ = ("autograd", "rref", "device_router", "cpu_routed", "device_ipc", "device_here",
                 "_reducers",
                 "_handlers", "_decoders", "_kinds", "_on_reducers")

    def __init__(self) -> None:
        self.autograd: AutogradHook | None = None
        self.rref: RRefCodec | None = None
        self.device_router: DeviceRouter | None = None
        self.cpu_routed = False  # some map names "cpu": CPU tensors are routed too
        self.device_ipc: Callable[[int], bool] | None = None  # rank -> shares CUDA memory
        self.device_here = -1  # this worker's rank: its calls to itself copy on the device
        self._reducers: dict[type, Callable[[Any], Any]] = {}
        self._handlers: dict[int, PlainHandler] = {}
        self._decoders: dict[int, PlainDecoder] = {}
        self._kinds: dict[int, enum.IntEnum] = {}
        self._on_reducers: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        kinds = ", ".join(f"{int(k)}={k.name}" for k in self._kinds.values())
        reducers = sorted(c.__name__ for c in self._reducers)
        return (f"<serialization Hooks autograd={self.autograd is not None} "
                f"rref={self.rref is not None} reducers={reducers} plain kinds: {kinds}>")

    # ------------------------------------------------------------------ reducers

    def register_reducer(self, cls: type, reducer: Callable[[Any], Any]) -> None:
        """Make the RPC pickler reduce instances of ``cls`` (and of its subclasses) with
        ``reducer(obj) -> reduce tuple``."""
        self._reducers[cls] = reducer
        for changed in self._on_reducers:
            changed()

    def reducer_for(self, t: type) -> Callable[[Any], Any] | None:
        """The reducer registered for ``t`` or for its nearest registered base."""
        reducer = self._reducers.get(t)
        if reducer is not None:
            return reducer
        for cls, fn in self._reducers.items():
            if issubclass(t, cls):
                return fn
        return None

    def watch_reducers(self, changed: Callable[[], None]) -> None:
        """Call ``changed()`` whenever a reducer is registered (the pickler's cache)."""
        self._on_reducers.append(changed)

    # ------------------------------------------------------------------ single hooks

    def set_autograd(self, hook: AutogradHook) -> None:
        self.autograd = hook

    def set_rref_codec(self, codec: RRefCodec) -> None:
        self.rref = codec

    def set_device_router(self, router: DeviceRouter | None, cpu_routed: bool = False,
                          ipc: Callable[[int], bool] | None = None, here: int = -1) -> None:
        """Where a CUDA tensor goes (``router(dest rank, is request, device)``); None:
        no device maps, CUDA tensors are refused.  ``cpu_routed``: a map names the CPU
        (``{"cpu": 0}``), so CPU tensors ask the router too, and no message is plain.
        ``ipc(dest rank)``: whether CUDA tensors to it travel by CUDA IPC.  ``here``:
        this worker's rank, whose CUDA tensors to itself stay on the device."""
        self.device_router = router
        self.cpu_routed = cpu_routed and router is not None
        self.device_ipc = ipc if router is not None else None
        self.device_here = here if router is not None else -1

    # ------------------------------------------------------------------ plain kinds

    def register_plain(self, kind: enum.IntEnum, *, handler: PlainHandler | None = None,
                       decoder: PlainDecoder | None = None) -> None:
        """Claim the plain message kind ``kind``: a one-way message for ``handler``, or
        a reply value for ``decoder`` (one of them).

        Raises:
            ValueError: another kind holds that byte, or neither or both are given.
        """
        if (handler is None) == (decoder is None):
            raise ValueError("register_plain takes a handler or a decoder")
        held = self._kinds.get(int(kind))
        if held is not None and held is not kind:
            raise ValueError(f"plain message kind {int(kind)} is taken by "
                             f"{type(held).__name__}.{held.name}")
        self._kinds[int(kind)] = kind
        if handler is not None:
            self._handlers[int(kind)] = handler
        else:
            self._decoders[int(kind)] = decoder

    def claim_plain(self, kinds: type[enum.IntEnum]) -> None:
        """Claim every member of ``kinds`` without a handler (the serialization layer's
        own kinds, decoded where they are sent)."""
        for kind in kinds:
            held = self._kinds.get(int(kind))
            if held is not None and held is not kind:
                raise ValueError(f"plain message kind {int(kind)} is taken by "
                                 f"{type(held).__name__}.{held.name}")
            self._kinds[int(kind)] = kind

    def plain_handler(self, kind: int) -> PlainHandler | None:
        """The handler of a one-way plain message of ``kind`` (None: unknown here)."""
        return self._handlers.get(kind)

    def plain_decoder(self, kind: int) -> PlainDecoder | None:
        """The decoder of a plain reply value of ``kind`` (None: unknown here)."""
        return self._decoders.get(kind)


hooks = Hooks()
