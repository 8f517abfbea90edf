"""``torchwire.rpc.internal``: the RPC pickler, as ``torch.distributed.rpc.internal``."""

from __future__ import annotations

import torch

from .. import _serialization as ser


def serialize(obj):
    """Pickle ``obj`` as RPC would (tensors in a side table): ``(payload, tensors)``.

    Raises:
        RuntimeError: ``obj`` holds a deleted user RRef ("Cannot call fork an UserRRef
            after deletion.").
        SerializationError: it cannot be pickled.
    """
    payload, tensors, sent = ser.dumps_to(obj, -1, False)
    if sent is not None:
        sent.abort()  # nothing is sent: undo any fork it made
    return payload, tensors


def deserialize(payload, tensors):
    """Inverse of :func:`serialize` (the tensors as returned by it)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return ser.loads(payload, flat)
