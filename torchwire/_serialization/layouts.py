"""Quantized and nested tensors: sent as the plain tensors they are made of.

The pickler reduces each to a rebuild call whose arguments are ordinary tensors and
numbers; those tensors go through the message's table like any other (the bytes on
the fast channel, never through the pickle stream).

* A quantized tensor is its integer representation (``int_repr()``) and its
  quantization parameters: a scale and zero point, or per-channel scales, zero
  points and axis.  The sub-byte types (``quint4x2``, ``quint2x4``) are refused:
  torch has no public constructor for them from their packed bytes.
* A nested tensor of jagged layout is its values, offsets, lengths and ragged
  dimension; one of strided layout is the list of its tensors.
"""

from __future__ import annotations

import torch

from .._base.errors import SerializationError

_PACKED = tuple(getattr(torch, name) for name in ("quint4x2", "quint2x4") if hasattr(torch, name))
_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_affine_float_qparams)


def reduce_quantized(t: torch.Tensor):
    scheme = t.qscheme()
    if t.dtype in _PACKED or (scheme is not torch.per_tensor_affine
                              and scheme not in _PER_CHANNEL):
        raise SerializationError(
            f"quantized tensors of {t.dtype} with {scheme} are not supported by torchwire "
            "RPC; send t.dequantize(), or t.int_repr() and its quantization parameters")
    if scheme is torch.per_tensor_affine:
        return _rebuild_per_tensor, (t.int_repr(), t.q_scale(), t.q_zero_point(), t.dtype)
    return _rebuild_per_channel, (t.int_repr(), t.q_per_channel_scales(),
                                  t.q_per_channel_zero_points(), t.q_per_channel_axis(),
                                  t.dtype)


def _checked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype is not dtype:
        raise SerializationError(f"a quantized tensor of {dtype} arrived as {t.dtype}")
    return t


def _rebuild_per_tensor(data: torch.Tensor, scale: float, zero_point: int,
                        dtype: torch.dtype) -> torch.Tensor:
    return _checked(torch._make_per_tensor_quantized_tensor(data, scale, zero_point), dtype)


def _rebuild_per_channel(data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
                         axis: int, dtype: torch.dtype) -> torch.Tensor:
    return _checked(torch._make_per_channel_quantized_tensor(data, scales, zero_points, axis),
                    dtype)


def reduce_nested(t: torch.Tensor):
    requires_grad = t.requires_grad
    data = t.detach()
    if t.layout is torch.jagged:
        return _rebuild_jagged, (data.values(), data.offsets(), data.lengths(),
                                 data._ragged_idx, requires_grad)
    if t.layout is torch.strided:
        return _rebuild_nested, (list(data.unbind()), data.dtype, requires_grad)
    raise SerializationError(f"nested tensors of layout {t.layout} are not supported; "
                             "send t.unbind() (its tensors)")


def _rebuild_jagged(values: torch.Tensor, offsets: torch.Tensor, lengths, ragged_idx: int,
                    requires_grad: bool) -> torch.Tensor:
    t = torch.nested.nested_tensor_from_jagged(values, offsets, lengths, jagged_dim=ragged_idx)
    return t.requires_grad_(True) if requires_grad else t


def _rebuild_nested(tensors: list, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return torch.nested.nested_tensor(tensors, dtype=dtype, layout=torch.strided,
                                      requires_grad=requires_grad)
