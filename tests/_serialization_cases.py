"""The values the serialization tests send, and how they are compared: CASES (every
dtype, 0-dim, empty, strided, conjugated and sparse tensors, parameters, a subclass,
nested containers) built by name; ``differences`` and ``describe`` check type, dtype,
shape, flags and bytes; ``wire`` hands over a tensor table as the transport delivers
it.  Used by tests/test_serialization.py."""

from __future__ import annotations

import warnings

import torch

from torchwire._serialization import byte_view, dumps, loads, tensor_nbytes


# ------------------------------------------------------------------ helpers


def wire(table: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the receiver gets for a tensor table: a fresh uint8 tensor per entry holding
    exactly the ``numel * itemsize`` bytes the sender writes (``Connection.send_frame``
    sends ``byte_view(t, n)``; the reader fills ``torch.empty(n, dtype=torch.uint8)``)."""
    out = []
    for t in table:
        n = tensor_nbytes(t)
        received = torch.empty(n, dtype=torch.uint8)
        if n:
            byte_view(received, n)[:] = byte_view(t, n)
        out.append(received)
    return out


def roundtrip(obj):
    payload, table = dumps(obj)
    return loads(payload, wire(table)), payload, table


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The logical values of ``t`` as bytes (conjugation / negation resolved)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


_NO_TORCH_EQUAL = {getattr(torch, "complex32", None)}


def differences(expected, got, path: str = "value") -> list[str]:
    """Every way ``got`` differs from ``expected`` (empty list: the same)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: expected a tensor, got {type(got).__name__}"]
        problems = []
        for attr in ("dtype", "requires_grad", "layout", "is_sparse", "is_nested"):
            a, b = getattr(expected, attr), getattr(got, attr)
            if a != b:
                problems.append(f"{path}.{attr}: {a} != {b}")
        # a nested tensor of strided layout has no shape: its parts are compared below
        if not problems and not expected.is_nested and expected.shape != got.shape:
            problems.append(f"{path}.shape: {expected.shape} != {got.shape}")
        if type(expected) is not type(got):
            problems.append(f"{path}: type {type(expected).__name__} != {type(got).__name__}")
        if problems:
            return problems
        if expected.is_quantized:
            return problems + _quantized_differences(expected, got, path)
        if expected.is_nested:
            if expected.layout is torch.jagged and expected._ragged_idx != got._ragged_idx:
                problems.append(f"{path}._ragged_idx: {expected._ragged_idx} != "
                                f"{got._ragged_idx}")
            return problems + differences(list(expected.unbind()), list(got.unbind()),
                                          f"{path}.unbind()")
        if expected.is_sparse:
            if expected.is_coalesced() != got.is_coalesced():
                problems.append(f"{path}.is_coalesced: {expected.is_coalesced()} != "
                                f"{got.is_coalesced()}")
            if not torch.equal(expected.detach().to_dense(), got.detach().to_dense()):
                problems.append(f"{path}: sparse values differ (to_dense)")
            if not (torch.equal(expected._indices(), got._indices())
                    and torch.equal(expected._values().detach(), got._values().detach())):
                problems.append(f"{path}: sparse indices/values differ")
            return problems
        if expected.dtype not in _NO_TORCH_EQUAL and not torch.equal(expected.detach(),
                                                                     got.detach()):
            problems.append(f"{path}: values differ (torch.equal)")
        if not torch.equal(_bits(expected), _bits(got)):
            problems.append(f"{path}: bytes differ")
        return problems
    if isinstance(expected, dict):
        if not isinstance(got, dict) or list(expected) != list(got):
            return [f"{path}: dict keys {list(expected)} != {got!r:.200}"]
        return [p for k in expected for p in differences(expected[k], got[k], f"{path}[{k!r}]")]
    if isinstance(expected, (list, tuple)):
        if type(expected) is not type(got) or len(expected) != len(got):
            return [f"{path}: {type(expected).__name__}[{len(expected)}] != {got!r:.200}"]
        return [p for i, (a, b) in enumerate(zip(expected, got))
                for p in differences(a, b, f"{path}[{i}]")]
    return [] if expected == got and type(expected) is type(got) else [
        f"{path}: {expected!r} != {got!r}"]


def _quantized_differences(expected, got, path: str) -> list[str]:
    if expected.qscheme() != got.qscheme():
        return [f"{path}.qscheme: {expected.qscheme()} != {got.qscheme()}"]
    if expected.qscheme() is torch.per_tensor_affine:
        params = [(expected.q_scale(), got.q_scale()),
                  (expected.q_zero_point(), got.q_zero_point())]
    else:
        params = [(expected.q_per_channel_axis(), got.q_per_channel_axis())]
        for a, b in ((expected.q_per_channel_scales(), got.q_per_channel_scales()),
                     (expected.q_per_channel_zero_points(), got.q_per_channel_zero_points())):
            if not (a.dtype == b.dtype and torch.equal(a, b)):
                return [f"{path}: per-channel parameters {a} != {b}"]
    problems = [f"{path}: quantization parameter {a!r} != {b!r}" for a, b in params
                if a != b or type(a) is not type(b)]
    if not torch.equal(expected.int_repr(), got.int_repr()):
        problems.append(f"{path}: int_repr() differs")
    return problems


def describe(obj):
    """A plain-Python summary (picklable over the test harness pipe)."""
    if isinstance(obj, torch.Tensor):
        d = {"type": type(obj).__name__, "dtype": str(obj.dtype),
             "requires_grad": obj.requires_grad, "layout": str(obj.layout)}
        if obj.is_nested:
            d["parts"] = describe(list(obj.detach().unbind()))
            return d
        d["shape"] = tuple(obj.shape)
        if obj.is_quantized:
            d["qscheme"] = str(obj.qscheme())
            d["bits"] = bytes(obj.int_repr().reshape(-1).view(torch.uint8).numpy())
        elif obj.is_sparse:
            d["coalesced"] = obj.is_coalesced()
            d["bits"] = bytes(_bits(obj.detach().to_dense()).numpy())
        else:
            d["bits"] = bytes(_bits(obj).numpy())
        return d
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [describe(v) for v in obj])
    return obj


# ------------------------------------------------------------------ the cases

def _gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dtype_values(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    g = _gen()
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g) == 1
    if dtype.is_complex:
        real = torch.randn(shape, generator=g, dtype=torch.float64)
        imag = torch.randn(shape, generator=g, dtype=torch.float64)
        return torch.complex(real, imag).to(dtype)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g) * 4
        if dtype is getattr(torch, "float8_e8m0fnu", None):  # unsigned exponent-only format
            x = x.abs() + 0.25
        return x.to(dtype)
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g,
                      dtype=torch.int64).to(dtype)
    flat = x.view(-1)
    flat[0] = torch.tensor([info.max], dtype=dtype)[0]
    flat[1] = torch.tensor([info.min], dtype=dtype)[0]
    return x


_DTYPE_NAMES = ["float16", "float32", "float64", "bfloat16", "complex32", "complex64",
                "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float8_e8m0fnu"]
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None),
                                                                 torch.dtype)]


def _big() -> torch.Tensor:
    # 30,000 elements: big next to its views, small enough that torch does not start its
    # intra-op thread pool in the pytest process (children forked after that hang).
    return torch.arange(30_000, dtype=torch.float32)


def _sparse(coalesce: bool, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    # (0, 1) appears twice: uncoalesced, the duplicates must survive as they are
    indices = torch.tensor([[0, 0, 1, 3, 0], [1, 1, 2, 4, 0]])
    values = torch.tensor([1.5, 2.0, -3.0, 4.25, 7.0], dtype=dtype)
    t = torch.sparse_coo_tensor(indices, values, (4, 5), check_invariants=True)
    if coalesce:
        t = t.coalesce()
    if requires_grad:
        t.requires_grad_(True)
    return t


def _quiet(fn):
    """Build a case with torch's experimental-dtype warnings silenced (pytest runs with
    warnings as errors)."""
    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    return build


class MyTensor(torch.Tensor):
    """A tensor subclass: its class must survive the trip."""


def _nested():
    shared = torch.arange(6.0).reshape(2, 3)
    return {
        "layers": [(torch.ones(2), torch.zeros(3, dtype=torch.int64)),
                   (torch.randn(2, 2, generator=_gen()), shared)],
        "meta": {"step": 7, "name": "ckpt", "scale": 0.5, "flags": (True, None)},
        "again": [shared, (shared.t(),)],
        "empty": [],
    }


CASES = {f"dtype_{str(d).split('.')[-1]}": _quiet(lambda d=d: _dtype_values(d)) for d in DTYPES}
CASES.update({
    "0dim_float32": lambda: torch.tensor(3.25),
    "0dim_int64": lambda: torch.tensor(-(2 ** 40)),
    "0dim_bool": lambda: torch.tensor(True),
    "0dim_complex128": lambda: torch.tensor(1.5 - 2.5j, dtype=torch.complex128),
    "0dim_bfloat16": lambda: torch.tensor(0.1, dtype=torch.bfloat16),
    "empty_1d": lambda: torch.empty(0),
    "empty_0x3": lambda: torch.empty(0, 3, dtype=torch.float64),
    "empty_2x0x5_int32": lambda: torch.empty(2, 0, 5, dtype=torch.int32),
    "empty_transposed": lambda: torch.empty(3, 0).t(),
    "transposed": lambda: torch.randn(4, 6, generator=_gen()).t(),
    "strided_slice": lambda: torch.randn(10, 10, generator=_gen())[::2, 1::3],
    "flipped": lambda: torch.arange(10).flip(0),
    "expanded": lambda: torch.tensor([[1.0, 2.0, 3.0]]).expand(4, 3),
    "channels_last": lambda: torch.randn(2, 3, 4, 5, generator=_gen()).to(
        memory_format=torch.channels_last),
    "view_of_big_slice": lambda: _big()[1000:1010],
    "view_of_big_row": lambda: _big().view(100, 300)[5],
    "view_of_big_column": lambda: _big().view(100, 300)[:, 7],
    "view_of_big_0dim": lambda: _big()[12345],
    "complex_conj": lambda: torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j]).conj(),
    "sparse_coalesced": lambda: _sparse(True),
    "sparse_uncoalesced": lambda: _sparse(False),
    "sparse_float64_requires_grad": lambda: _sparse(True, torch.float64, requires_grad=True),
    "sparse_hybrid": lambda: torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), (3, 2),
        check_invariants=True),
    "sparse_empty": lambda: torch.sparse_coo_tensor(
        torch.empty(2, 0, dtype=torch.int64), torch.empty(0), (3, 3), check_invariants=True),
    "requires_grad_leaf": lambda: torch.randn(3, 2, generator=_gen()).requires_grad_(),
    "requires_grad_non_leaf": lambda: torch.randn(3, generator=_gen()).requires_grad_() * 2,
    "requires_grad_false_float": lambda: torch.randn(3, generator=_gen()),
    "parameter": lambda: torch.nn.Parameter(torch.randn(2, 3, generator=_gen())),
    "parameter_frozen": lambda: torch.nn.Parameter(torch.randn(2, generator=_gen()),
                                                   requires_grad=False),
    "subclass": lambda: torch.arange(4.0).as_subclass(MyTensor),
    "nested_containers": _nested,
    "quantized_per_tensor_quint8": _quiet(lambda: torch.quantize_per_tensor(
        torch.randn(4, 6, generator=_gen()), 0.1, 3, torch.quint8)),
    "quantized_per_tensor_qint32_transposed": _quiet(lambda: torch.quantize_per_tensor(
        torch.randn(4, 6, generator=_gen()) * 100, 0.5, -2, torch.qint32).t()),
    "quantized_per_channel_qint8": _quiet(lambda: torch.quantize_per_channel(
        torch.randn(2, 3, generator=_gen()), torch.tensor([0.1, 0.2], dtype=torch.float64),
        torch.tensor([0, 1]), 0, torch.qint8)),
    "quantized_per_channel_float_qparams": _quiet(lambda: torch.quantize_per_channel(
        torch.randn(3, 4, generator=_gen()), torch.tensor([0.1, 0.2, 0.3, 0.4]),
        torch.tensor([1.0, -2.0, 0.5, 0.0]), 1, torch.quint8)),
    "nested_strided": _quiet(lambda: torch.nested.nested_tensor(
        [torch.randn(2, 3, generator=_gen()), torch.randn(4, 3, generator=_gen())])),
    "nested_jagged": _quiet(lambda: torch.nested.nested_tensor(
        [torch.randn(2, 3, generator=_gen()), torch.randn(5, 3, generator=_gen())],
        layout=torch.jagged)),
    "nested_jagged_requires_grad": _quiet(lambda: torch.nested.nested_tensor(
        [torch.arange(3.0), torch.arange(1.0)], layout=torch.jagged, requires_grad=True)),
    "same_tensor_twice": lambda: (lambda t: [t, t, {"k": t}])(torch.arange(5)),
    "many_small_tensors": lambda: [torch.full((i % 7,), float(i)) for i in range(200)],
    "tensors_and_python_values": lambda: (1, "two", 3.0, None, b"bytes",
                                          {"t": torch.ones(2, dtype=torch.int16)}),
})


def build(name: str):
    return CASES[name]()
