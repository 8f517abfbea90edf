"""Distributed autograd's plain message kinds (see ``torchwire._serialization.plain``).

The first byte of the payload of a PLAIN frame; values are part of the wire format.
Each kind is registered with the serialization layer's hook registry by the module
that handles it.
"""

from __future__ import annotations

import enum


class AutogradKind(enum.IntEnum):
    GRADS = 1  # one-way: gradients of a backward pass, for the receiver's send entries
    REPORT = 2  # one-way: a part of a backward pass reports its weight to the root
    RELEASE = 3  # one-way: a context ended on the sender
    RECV = 6  # reply value: a tensor that requires grad, replied in a context
