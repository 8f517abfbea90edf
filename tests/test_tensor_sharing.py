"""Tensors of one message that share memory arrive sharing it, as torch's pickling keeps
them (torchwire/_serialization/sharing.py), checked against ``torch.save`` /
``torch.load`` of the same values on random views of a few storages (hypothesis):
slices with steps, transposes, columns, expanded rows, empty slices, the base
itself, and unrelated tensors, in one list (``torch.save`` refuses views of one storage as two
dtypes, which torchwire sends: tests/test_serialization.py).  Both must give the
same values and the same storage sharing.  ``TORCHWIRE_FUZZ_EXAMPLES`` sets the
budget (default 100)."""

from __future__ import annotations

import io
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _serialization_cases import wire
from torchwire._serialization import dumps, loads

EXAMPLES = int(os.environ.get("TORCHWIRE_FUZZ_EXAMPLES", "100"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

DTYPES = [torch.float32, torch.float64, torch.int16, torch.uint8]


def _view(base: torch.Tensor, how: str, a: int, b: int, step: int) -> torch.Tensor:
    n = base.numel()
    a, b = a % n, b % n
    lo, hi = min(a, b), max(a, b) + 1
    if how == "slice":
        return base[lo:hi:step]
    if how == "base":
        return base
    if how == "matrix" and n >= 4:
        rows = 2 if n % 2 == 0 else 1
        m = base.view(rows, n // rows)
        return m.t() if step % 2 else m[:, lo % (n // rows)]
    if how == "expand":
        return base[lo:lo + 1].expand(step + 1, 3)
    if how == "empty":
        return base[lo:lo]
    if how == "fresh":
        return torch.arange(hi - lo + 1, dtype=base.dtype) + a
    return base[lo:hi]


views = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(
    ["slice", "base", "matrix", "expand", "empty", "fresh"]),
    st.integers(0, 200), st.integers(0, 200), st.integers(1, 3)), min_size=1, max_size=7)
bases = st.lists(st.tuples(st.integers(1, 64), st.sampled_from(DTYPES)), min_size=3,
                 max_size=3)


def _storage(t: torch.Tensor):
    # an empty tensor has no memory to share (torch.load gives it its base's storage)
    return t.untyped_storage().data_ptr() if t.numel() else None


def _sharing(tensors: list) -> list:
    """For each pair of tensors, whether they share a storage."""
    ptrs = [_storage(t) for t in tensors]
    return [[p is not None and p == q for q in ptrs[i + 1:]] for i, p in enumerate(ptrs)]


@fuzz
@given(bases=bases, views=views)
def test_sharing_and_values_match_torch_save(bases, views):
    made = [(torch.randperm(n) % 127).to(dtype) for n, dtype in bases]
    value = [_view(made[i], how, a, b, step) for i, how, a, b, step in views]
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    theirs = torch.load(buf)
    payload, table = dumps(value)
    ours = loads(payload, wire(table))
    for mine, expected in zip(ours, theirs):
        assert mine.dtype == expected.dtype and mine.shape == expected.shape
        assert torch.equal(mine, expected)
    assert _sharing(ours) == _sharing(theirs)
