"""Per-thread state of the serialization layer.

* The message being pickled or unpickled on this thread (:data:`tls`): its
  :class:`~.pickler.SendContext`, the received tensor table, the hook that wraps
  received tensors, the gates a request must wait for, and the thread's cached
  pickler.
* The distributed autograd context that requests sent from this thread carry
  (:func:`grad_context`, :func:`set_grad_context`, :func:`outside_grad_context`).
  Distributed autograd sets it; serialization reads it for every message, so it
  lives here, below both.

Class attributes are the defaults: a missing attribute would be an AttributeError
raised and caught on every ``getattr(tls, name, None)``, which costs microseconds
with the caches cold (as they are between messages).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class _Tls(threading.local):
    send = None  # SendContext of the message being pickled
    pickler = None  # [pickler, its BytesIO, in use]
    tensors = None  # the received tensor table being unpickled
    recv_hook = None  # wraps each received tensor (None: none)
    gates = None  # futures the request being decoded must wait for (None: takes none)


tls = _Tls()


class _GradState(threading.local):
    context: Any = None  # the autograd context id this thread's requests carry


grad = _GradState()


def grad_context() -> int | None:
    """The autograd context id requests sent from this thread carry (None: none)."""
    return grad.context


def set_grad_context(context_id) -> Any:
    """Set this thread's autograd context id; returns the previous one."""
    prev, grad.context = grad.context, context_id
    return prev


def outside_grad_context(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with no autograd context on this thread (control traffic of the
    runtime: releases, a backward pass's messages, optimizer steps); the thread's
    context is restored after."""
    g = grad
    prev = g.context
    if prev is None:
        return fn(*args)
    g.context = None
    try:
        return fn(*args)
    finally:
        g.context = prev
