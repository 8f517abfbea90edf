"""Tensors of one message that share memory arrive sharing it, as torch's do.

The pickler lifts each tensor into the message's table on its own: a view sends the
bytes it spans, not its storage.  Two entries of one storage (a tensor and a view of
it, two views, ``t`` and ``t.detach()``) would arrive as two storages, the bytes
they have in common sent twice, and a write through one would not show in the
other, where torch keeps them one storage.  After pickling, :func:`share` finds the
entries that are views of one CPU storage; each such storage sends the bytes its
entries span once, and the table the unpickler sees is rebuilt from slices of it
(:func:`_unshare`), so the tensors rebuilt from them share it again.

The message then is a small pickle around the original one: ``_unshare(layout,
payload)``, where ``layout`` gives each original entry as ``(sent entry, byte
offset, bytes)`` (offset -1: the sent entry whole).  A message whose storages are
all distinct (nearly all) is not touched: one ``untyped_storage()`` per entry, and
only when there are two or more.
"""

from __future__ import annotations

import pickle

import torch

from .._base.errors import SerializationError
from .state import tls as _tls

# A shared region starts this aligned within its storage, so every entry's offset in
# it stays a multiple of its element size (the largest is complex128's).
_ALIGN = 16


def shares(tensors: list) -> bool:
    """Whether two of ``tensors`` are views of one storage (empty ones excepted)."""
    seen = set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            if ptr in seen:
                return True
            seen.add(ptr)
    return False


def share(payload: bytes, tensors: list, protocol: int,
          spans: dict | None = None) -> tuple[bytes, list]:
    """``(payload, tensors)`` of a pickled message, its entries that are views of one
    CPU storage sent once, as one region of it.

    ``spans``: entries the pickler compacted (sparse views, copied), each with the
    memory its view spans; such an entry goes as that span when another entry shares
    its storage, else as its copy."""
    if spans is None and len({t.untyped_storage().data_ptr() for t in tensors}) \
            == len(tensors):
        return payload, tensors  # nearly every message: no storage twice
    spans = spans or {}
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        t = spans.get(i, t)
        if t.is_cpu and t.is_contiguous():
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                groups.setdefault(ptr, []).append(i)
    if all(len(members) == 1 for members in groups.values()):
        return payload, tensors
    layout: list[tuple[int, int, int]] = [(-1, -1, 0)] * len(tensors)
    sent: list = []
    for base, members in groups.items():
        if len(members) == 1:
            continue
        views = [spans.get(i, tensors[i]) for i in members]
        ranges = [(v.data_ptr() - base, v.numel() * v.element_size()) for v in views]
        lo = min(start for start, _ in ranges) // _ALIGN * _ALIGN
        hi = max(start + n for start, n in ranges)
        region = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage(), lo,
                                                        (hi - lo,))
        for i, (start, n) in zip(members, ranges):
            layout[i] = (len(sent), start - lo, n)
        sent.append(region)
    for i, t in enumerate(tensors):
        if layout[i][0] < 0:
            layout[i] = (len(sent), -1, 0)
            sent.append(t)
    return pickle.dumps(_Shared(tuple(layout), payload), protocol=protocol), sent


class _Shared:
    __slots__ = ("layout", "payload")

    def __init__(self, layout: tuple, payload: bytes) -> None:
        self.layout, self.payload = layout, payload

    def __reduce__(self):
        return _unshare, (self.layout, self.payload)


def _unshare(layout: tuple, payload: bytes):
    """On the receiver: the table the sender pickled, rebuilt from the regions sent,
    then the message."""
    sent = _tls.tensors
    table = []
    for k, start, n in layout:
        raw = sent[k]
        if start >= 0:
            if type(raw) is bytearray:
                raw = sent[k] = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                                 else torch.empty(0, dtype=torch.uint8))
            if start + n > raw.numel() or n < 0:
                raise SerializationError(f"a shared region of {raw.numel()} bytes has no "
                                         f"bytes {start}..{start + n}")
            raw = raw[start:start + n]
        table.append(raw)
    _tls.tensors = table  # loads() restores the caller's table after
    return pickle.loads(payload)
