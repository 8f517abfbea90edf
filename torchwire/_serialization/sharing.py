"""Tensors of one message that share memory arrive sharing it.

The pickler lifts each tensor into the message's table on its own: a view sends the
bytes it spans, not its storage.  Two entries of one storage (a tensor and a view of
it, two views, ``t`` and ``t.detach()``) would arrive as two storages, the bytes
they have in common sent twice, and a write through one would not show in the
other.  After pickling, :func:`share` finds the entries that are views of one CPU
storage and groups those that lie close together: each group sends the bytes its
entries span once, and the table the unpickler sees is rebuilt from slices of it
(:func:`_unshare`), so the tensors rebuilt from them share it again.

Entries lie close together when the span of their group is under ``_SMALL`` bytes
or at most ``_DENSITY`` times the bytes of its entries.  Views far apart in a large
storage (its first and last rows) go on their own: sharing them would send the
whole gap.  torch's RPC sends a view's whole storage, but clones each view that uses
less than half of a storage of 8 KiB or more, so those arrive apart there too.

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
_SMALL = 8 << 10  # a region this small is shared, however sparse
_DENSITY = 2  # else at most this many times the bytes of its entries


def shares(tensors: list) -> bool:
    """Whether two of ``tensors`` may be views of one storage (two empty storages
    count as one: a false alarm costs only the closer look of :func:`share`)."""
    return len({t.untyped_storage().data_ptr() for t in tensors}) != len(tensors)


def share(payload: bytes, tensors: list, protocol: int,
          spans: dict | None = None) -> tuple[bytes, list]:
    """``(payload, tensors)`` of a pickled message, its entries that are views of one
    CPU storage sent once, as one region of it.

    ``spans``: entries the pickler compacted (sparse views, copied), each with the
    memory its view spans; such an entry goes as that span when another entry shares
    its storage, else as its copy."""
    if spans is None and not shares(tensors):
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
    for members in groups.values():
        if len(members) == 1:
            continue
        views = {i: spans.get(i, tensors[i]) for i in members}
        # (start, bytes spanned, bytes it would send alone, entry); an empty view's
        # data_ptr() is 0, its offset is not
        ranges = sorted((v.storage_offset() * v.element_size(), v.numel() * v.element_size(),
                         tensors[i].numel() * tensors[i].element_size(), i)
                        for i, v in views.items())
        for cluster in _close_together(ranges):
            if len(cluster) == 1:
                continue
            lo = cluster[0][0] // _ALIGN * _ALIGN
            hi = max(start + n for start, n, _, _ in cluster)
            storage = views[cluster[0][3]].untyped_storage()
            region = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,))
            for start, n, _, i in cluster:
                layout[i] = (len(sent), start - lo, n)
            sent.append(region)
    for i, t in enumerate(tensors):
        if layout[i][0] < 0:
            layout[i] = (len(sent), -1, 0)
            sent.append(t)
    return pickle.dumps(_Shared(tuple(layout), payload), protocol=protocol), sent


def _close_together(ranges: list) -> list[list]:
    """``ranges`` (sorted ``(start, bytes spanned, bytes alone, entry)``) in groups
    whose span is under ``_SMALL`` or at most ``_DENSITY`` times what their entries
    would send alone."""
    clusters: list[list] = []
    cluster: list = []
    lo = hi = alone = 0
    for r in ranges:
        start, n, own, _ = r
        if cluster:
            span = max(hi, start + n) - lo
            if span < _SMALL or span <= _DENSITY * (alone + own):
                cluster.append(r)
                hi, alone = max(hi, start + n), alone + own
                continue
            clusters.append(cluster)
        cluster, lo, hi, alone = [r], start, start + n, own
    clusters.append(cluster)
    return clusters


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
