"""The serialization layer: messages to (payload bytes, buffers) and back.

* :mod:`.pickler` - the RPC pickler (tensors lifted out of the stream), with
  :mod:`.sharing` (tensors of one storage stay one) and :mod:`.layouts` (quantized
  and nested tensors);
* :mod:`.plain` - the plain codec (fixed layouts for frequent small messages);
* :mod:`.exceptions` - remote exceptions;
* :mod:`.hooks` - the one registry through which the layers above plug in;
* :mod:`.state` - per-thread state (the message being coded, the autograd context).

The agent uses what this package exports; it never sees the layers that register.
"""

from .._wire.buffers import byte_view
from .exceptions import dumps_exception, loads_exception
from .hooks import AutogradHook, Hooks, RRefCodec, hooks
from .pickler import (SendContext, add_gate, current_send, dumps, dumps_to, loads,
                      tensor_nbytes)
from .plain import (PlainKind, one_buffer, plain_body, plain_call, plain_call_decode,
                    plain_meta, plain_reply, plain_tensor, plain_value)
from .state import grad_context, outside_grad_context, set_grad_context

__all__ = [
    "AutogradHook", "Hooks", "PlainKind", "RRefCodec", "SendContext", "add_gate", "byte_view",
    "current_send", "dumps", "dumps_exception", "dumps_to", "grad_context", "hooks",
    "loads", "loads_exception", "one_buffer", "outside_grad_context", "plain_body",
    "plain_call", "plain_call_decode", "plain_meta", "plain_reply", "plain_tensor",
    "plain_value", "set_grad_context", "tensor_nbytes",
]
