"""Serialization: tensors and containers through dumps/loads, through real RPC,
and the frame codec underneath.

(a) in-process round trips through ``torchwire._serialization`` with a tensor
    table that is byte-copied the way the transport delivers it;
(b) the same values echoed through a real RPC by the shared ``world`` job;
(c) the wire format of ``torchwire/_wire/frame.py`` and a ``Connection`` reader
    fed raw bytes over a socketpair.
"""

from __future__ import annotations

import math
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world
from torchwire import _serialization as ser
from torchwire._serialization import byte_view, dumps, loads, tensor_nbytes
from torchwire._wire import frame as F
from torchwire._wire.channels.link import ChannelSet
from torchwire._wire.connection import Connection

# torch warns once per process, on the first sparse tensor built without an explicit
# ``check_invariants``.  Whether torchwire's receiver does that is checked by
# test_receiving_sparse_tensor_emits_no_warning (in a fresh interpreter); elsewhere the
# once-only warning must not make whichever test happens to come first fail.
_SPARSE_WARNING = "Sparse invariant checks are implicitly disabled"
pytestmark = pytest.mark.filterwarnings(f"ignore:{_SPARSE_WARNING}")


def _ignore_sparse_warning():
    warnings.filterwarnings("ignore", message=_SPARSE_WARNING)


@pytest.fixture(scope="module", autouse=True)
def _world_before_local_work(world):
    """Start the shared job before this module runs torch ops in the pytest process:
    a child forked after the parent used torch's intra-op thread pool hangs on its
    first parallel op."""
    world.run_all(_ignore_sparse_warning)


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
        for attr in ("dtype", "shape", "requires_grad", "layout", "is_sparse"):
            a, b = getattr(expected, attr), getattr(got, attr)
            if a != b:
                problems.append(f"{path}.{attr}: {a} != {b}")
        if type(expected) is not type(got):
            problems.append(f"{path}: type {type(expected).__name__} != {type(got).__name__}")
        if problems:
            return problems
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


def describe(obj):
    """A plain-Python summary (picklable over the test harness pipe)."""
    if isinstance(obj, torch.Tensor):
        d = {"type": type(obj).__name__, "dtype": str(obj.dtype), "shape": tuple(obj.shape),
             "requires_grad": obj.requires_grad, "layout": str(obj.layout)}
        if obj.is_sparse:
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
    "same_tensor_twice": lambda: (lambda t: [t, t, {"k": t}])(torch.arange(5)),
    "many_small_tensors": lambda: [torch.full((i % 7,), float(i)) for i in range(200)],
    "tensors_and_python_values": lambda: (1, "two", 3.0, None, b"bytes",
                                          {"t": torch.ones(2, dtype=torch.int16)}),
})


def build(name: str):
    return CASES[name]()


# ------------------------------------------------------------------ (a) in process


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_in_process(name):
    value = build(name)
    got, payload, table = roundtrip(value)
    assert differences(value, got) == []
    assert describe(got) == describe(value)
    assert all(t.is_contiguous() for t in table)


def test_every_listed_dtype_that_torch_has_is_covered():
    names = {str(d).split(".")[-1] for d in DTYPES}
    for must in ("float16", "float32", "float64", "bfloat16", "complex64", "complex128",
                 "int8", "int16", "int32", "int64", "uint8", "bool"):
        assert must in names
    for name in names:
        assert f"dtype_{name}" in CASES


@pytest.mark.parametrize("name,numel", [("view_of_big_slice", 10), ("view_of_big_row", 300),
                                        ("view_of_big_column", 100),
                                        ("view_of_big_0dim", 1)])
def test_view_sends_only_its_own_elements(name, numel):
    view = build(name)
    assert view.untyped_storage().nbytes() == 120_000  # really a view of the big tensor
    payload, table = dumps(view)
    assert len(table) == 1
    assert sum(tensor_nbytes(t) for t in table) == numel * 4
    assert len(payload) < 1000
    got = loads(payload, wire(table))
    assert torch.equal(got, view)
    assert got.untyped_storage().nbytes() == numel * 4


def test_tensor_bytes_travel_in_the_table_not_in_the_payload():
    t = torch.randn(256, 1024, generator=_gen())  # 1 MiB
    payload, table = dumps({"w": t, "note": "x"})
    assert len(payload) < 1000
    assert [tensor_nbytes(x) for x in table] == [t.numel() * 4]
    # not torch's default tensor pickling either (storage bytes inline in the stream)
    sevens = torch.full((20_000,), 7, dtype=torch.int32)
    payload, table = dumps(sevens)
    assert b"\x07\x00\x00\x00" * 100 not in payload
    assert torch.equal(loads(payload, wire(table)), sevens)


def test_received_tensor_is_a_view_of_the_received_buffer():
    # "no copy after the bytes leave the socket": the unpickler re-types in place
    t = torch.randn(4, 5, generator=_gen(), dtype=torch.float64)
    payload, table = dumps(t)
    received = wire(table)
    got = loads(payload, received)
    assert got.data_ptr() == received[0].data_ptr()
    assert torch.equal(got, t)


def test_same_tensor_twice_is_sent_once_and_stays_one_object():
    t = torch.arange(5)
    payload, table = dumps([t, t, {"k": t}])
    assert len(table) == 1
    got = loads(payload, wire(table))
    assert got[0] is got[1] is got[2]["k"]
    assert torch.equal(got[0], t)


def test_nested_containers_keep_sharing_and_structure():
    value = _nested()
    got, _, table = roundtrip(value)
    assert differences(value, got) == []
    assert got["layers"][1][1] is got["again"][0]
    assert isinstance(got["layers"][0], tuple) and isinstance(got["layers"], list)
    assert got["meta"] == {"step": 7, "name": "ckpt", "scale": 0.5, "flags": (True, None)}


def test_parameter_and_requires_grad_are_preserved():
    p = torch.nn.Parameter(torch.randn(3, generator=_gen()))
    frozen = torch.nn.Parameter(torch.randn(3, generator=_gen()), requires_grad=False)
    leaf = torch.randn(3, generator=_gen()).requires_grad_()
    got, _, _ = roundtrip((p, frozen, leaf, leaf * 2, torch.ones(2)))
    assert type(got[0]) is torch.nn.Parameter and got[0].requires_grad
    assert type(got[1]) is torch.nn.Parameter and not got[1].requires_grad
    assert type(got[2]) is torch.Tensor and got[2].requires_grad and got[2].is_leaf
    assert got[3].requires_grad and got[3].is_leaf  # a non-leaf arrives as a leaf
    assert not got[4].requires_grad
    got[2].sum().backward()  # usable as an autograd leaf
    assert torch.equal(got[2].grad, torch.ones(3))


def test_sparse_coalesced_flag_and_duplicates_are_kept():
    unco = _sparse(False)
    got, _, _ = roundtrip(unco)
    assert got.is_sparse and not got.is_coalesced()
    assert got._nnz() == 5  # duplicates were not summed on the way
    assert torch.equal(got.to_dense(), unco.to_dense())
    co = _sparse(True)
    got, _, _ = roundtrip(co)
    assert got.is_coalesced() and got._nnz() == 4
    assert torch.equal(got.to_dense(), co.to_dense())


def test_conjugated_complex_tensor_keeps_its_values():
    z = torch.tensor([1 + 2j, 3 - 4j])
    got, _, _ = roundtrip(z.conj())
    assert torch.equal(got.resolve_conj(), torch.tensor([1 - 2j, 3 + 4j])), (
        f"sent {z.conj()}, received {got}")


def test_receiving_sparse_tensor_emits_no_warning():
    # A fresh interpreter: torch's warning fires once per process.  The sender built
    # its tensor with explicit invariant checks; the receiver's rebuild must not warn
    # either (under -W error / pytest's filterwarnings=error it would fail to unpickle).
    code = textwrap.dedent("""
        import warnings, torch
        from torchwire._serialization import byte_view, dumps, loads, tensor_nbytes
        t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,),
                                    check_invariants=True)
        payload, table = dumps(t)
        received = []
        for x in table:
            n = tensor_nbytes(x)
            r = torch.empty(n, dtype=torch.uint8)
            byte_view(r, n)[:] = byte_view(x, n)
            received.append(r)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = loads(payload, received)
        print(got.to_dense().tolist())
        print([str(w.message)[:100] for w in caught])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=str(Path(__file__).parents[1]))
    assert proc.returncode == 0, proc.stderr
    values, warned = proc.stdout.strip().splitlines()[-2:]
    assert values == "[1.0, 0.0, 2.0]"
    assert warned == "[]", f"loads() of a sparse tensor warned: {warned}"


def test_sparse_tensor_with_out_of_range_indices_is_refused_on_receipt():
    # The receiver must validate a peer's sparse indices before any kernel uses them.
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 7]]), torch.tensor([1.0, 2.0]), (3,),
                                  check_invariants=False)
    payload, table = dumps(bad)
    with pytest.raises(torchwire.SerializationError):
        loads(payload, wire(table))


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_tensor = torch.quantize_per_tensor(torch.randn(4, generator=_gen()), 0.1, 3,
                                               torch.quint8)
        per_channel = torch.quantize_per_channel(torch.randn(2, 3, generator=_gen()),
                                                 torch.tensor([0.1, 0.2]),
                                                 torch.tensor([0, 1]), 0, torch.qint8)
    return per_tensor, per_channel


@pytest.mark.parametrize("which", [0, 1], ids=["per_tensor", "per_channel"])
def test_quantized_tensor_is_refused(which):
    q = _quantized()[which]
    for value in (q, [1, {"q": q}]):
        with pytest.raises(torchwire.SerializationError, match="quantized"):
            dumps(value)


def _local_function():
    def inner():
        return 1
    return inner


def _capturing(value):
    return lambda: value


def test_lambdas_and_local_functions_travel_by_value_with_their_tensors():
    t = torch.arange(3.0)
    for fn, expected in [(lambda: 1, 1), (_local_function(), 1),
                         (_capturing(t), t), (_capturing([t, "x"]), [t, "x"])]:
        payload, tensors = dumps((fn, (), None))
        # a captured tensor is lifted out of the stream as any tensor
        assert len(tensors) == (1 if fn.__closure__ and "value" in fn.__code__.co_freevars
                                else 0)
        got, args, _ = loads(payload, [bytearray(x.numpy().tobytes()) for x in tensors])
        value = got()
        if isinstance(expected, list):
            assert torch.equal(value[0], t) and value[1] == "x"
        elif isinstance(expected, torch.Tensor):
            assert torch.equal(value, t)
        else:
            assert value == expected


def test_what_cannot_be_pickled_even_by_value_is_named():
    lock = threading.Lock()
    with pytest.raises(torchwire.SerializationError,
                       match=r"args\[1\]\[0\]\['k'\] \(a _thread.lock\)"):
        dumps((len, (1, [{"k": lock}]), None))
    with pytest.raises(torchwire.SerializationError,
                       match=r"captured variable 'lock'\) \(a _thread.lock\)"):
        dumps((lambda: lock, (), None))


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("refusing to be pickled")


@pytest.mark.parametrize("make", [
    lambda: threading.Lock(),
    lambda: [1, {"deep": (torch.ones(2), threading.Lock())}],
    lambda: (i for i in range(3)),
    lambda: _Unpicklable(),
    lambda: _capturing(threading.Lock()),
], ids=["lock", "lock_nested_after_tensor", "generator", "reduce_raises",
        "lambda_capturing_a_lock"])
def test_unpicklable_objects_are_serialization_errors(make):
    with pytest.raises(torchwire.SerializationError) as info:
        dumps(make())
    assert isinstance(info.value, RuntimeError)  # code written for torch catches RuntimeError


@pytest.mark.parametrize("make,match", [
    (lambda: torch.randn(2, 3).to_sparse_csr(), "layout"),
    (lambda: torch.empty(3, device="meta"), "device"),
], ids=["sparse_csr", "meta_device"])
def test_unsupported_tensors_are_serialization_errors(make, match):
    value = _quiet(make)()  # torch warns that sparse CSR is in beta
    with pytest.raises(torchwire.SerializationError, match=match):
        dumps(value)


def test_corrupt_payload_is_serialization_error():
    with pytest.raises(torchwire.SerializationError):
        loads(b"\x80\x05not a pickle", [])
    payload, table = dumps(torch.ones(3))
    with pytest.raises(torchwire.SerializationError):
        loads(payload, [])  # the tensor table is missing


# ------------------------------------------------------------------ (b) through real RPC


def echo(x):
    return x


def body_echo_case(name: str, to: str):
    value = build(name)
    got = rpc.rpc_sync(to, echo, args=(value,))
    return differences(value, got), describe(got)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_through_rpc(world, name):
    problems, summary = world.run(0, body_echo_case, name, "worker1")
    assert problems == []
    assert summary == describe(build(name))


def body_identity_through_rpc():
    t = torch.arange(5)
    got = rpc.rpc_sync("worker2", echo, args=([t, t, {"k": t}],))
    nested = rpc.rpc_sync("worker3", echo, args=(_nested(),))
    return (got[0] is got[1] is got[2]["k"], nested["layers"][1][1] is nested["again"][0],
            differences(_nested(), nested))


def test_shared_tensors_stay_shared_through_rpc(world):
    same, nested_same, problems = world.run(1, body_identity_through_rpc)
    assert same and nested_same
    assert problems == []


def body_many_tensors(n: int):
    tensors = [torch.full((i % 5 + 1,), float(i), dtype=torch.float64) for i in range(n)]
    got = rpc.rpc_sync("worker3", echo, args=(tensors,))
    return len(got), differences(tensors, got)


def test_many_tensors_in_one_message(world):
    n, problems = world.run(2, body_many_tensors, 200)
    assert n == 200 and problems == []


def body_big_tensor():
    t = torch.randn(4 * 1024 * 1024, generator=_gen())  # 16 MiB of float32
    assert t.numel() * t.element_size() == 16 * 1024 * 1024
    got = rpc.rpc_sync("worker2", echo, args=(t,))
    half = rpc.rpc_sync("worker3", echo, args=(t.view(2048, 2048)[:, ::2],))  # 8 MiB strided
    return (tuple(got.shape), str(got.dtype), torch.equal(got, t),
            tuple(half.shape), torch.equal(half, t.view(2048, 2048)[:, ::2]))


def test_16_mib_tensor(world):
    assert world.run(1, body_big_tensor) == ((4 * 1024 * 1024,), "torch.float32", True,
                                             (2048, 1024), True)


def body_refused_values():
    out = {}
    lock = threading.Lock()
    for key, value in {"quantized": _quantized()[0], "lambda": lambda: lock,
                       "lock": lock}.items():
        try:
            rpc.rpc_sync("worker1", echo, args=(value,))
            out[key] = ("no error", "")
        except Exception as exc:
            out[key] = (type(exc).__name__, str(exc))
    out["still_serving"] = rpc.rpc_sync("worker1", echo, args=(torch.ones(2),)).tolist()
    return out


def test_refused_values_through_rpc_fail_on_the_caller(world):
    out = world.run(0, body_refused_values)
    assert out["quantized"][0] == "SerializationError" and "quantized" in out["quantized"][1]
    # a lambda travels by value, but not what it captures if that cannot be pickled
    assert out["lambda"][0] == "SerializationError" and "captured variable" in out["lambda"][1]
    assert out["lock"][0] == "SerializationError"
    assert out["still_serving"] == [1.0, 1.0]


def test_more_tensors_than_fit_the_read_buffer_in_one_message():
    # frame.MAX_BUFFERS allows 2**20 buffers per frame; 40,000 small tensors must arrive.
    # A fresh job: if the frame is refused, the shared world's connection would be lost.
    def body(rank, world_size):
        if rank != 0:
            return None
        tensors = [torch.full((1,), float(i)) for i in range(40_000)]
        try:
            got = rpc.rpc_sync("worker1", echo, args=(tensors,), timeout=20)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return len(got), differences(tensors, got) == []

    assert run_world(body, 2, timeout=60)[0] == (40_000, True)


# ------------------------------------------------------------------ (c) frame codec


@pytest.mark.parametrize("kind", list(F.Kind))
@pytest.mark.parametrize("lens", [[], [0], [1, 2, 3], [2 ** 39, 7]])
def test_header_round_trip(kind, lens):
    rid = 2 ** 64 - 3
    data = F.encode_header(int(kind), F.F_ERROR, rid, 12345, lens)
    assert len(data) == F.HEADER_SIZE + 8 * len(lens)
    assert F.decode_header(data) == (int(kind), F.F_ERROR, rid, 12345, len(lens))
    assert F.decode_buffer_lens(data[F.HEADER_SIZE:], len(lens), 12345) == lens


def test_header_layout_is_little_endian_and_fixed():
    data = F.encode_header(F.K_REQUEST, 0, 0x0102030405060708, 0x11, [0x22])
    assert F.HEADER_SIZE == 32
    assert data[:4] == b"TW\x07\x03"  # magic, version 7, kind REQUEST
    assert struct.unpack_from("<I", data, 4)[0] == 0  # flags
    assert struct.unpack_from("<Q", data, 8)[0] == 0x0102030405060708
    assert struct.unpack_from("<Q", data, 16)[0] == 0x11  # payload length
    assert struct.unpack_from("<I", data, 24)[0] == 1  # number of buffers
    assert struct.unpack_from("<Q", data, 32)[0] == 0x22  # first buffer length
    assert [int(k) for k in F.Kind] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [int(op) for op in F.ControlOp] == [1, 2]
    assert (F.F_ERROR, F.F_CMA, F.F_SHM, F.F_RETIRE, F.F_PLAIN) == (1, 2, 4, 8, 16)


def test_wrong_magic_is_protocol_error():
    data = b"XY" + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[2:]
    with pytest.raises(torchwire.ProtocolError, match="magic"):
        F.decode_header(data)
    with pytest.raises(torchwire.ProtocolError):
        F.decode_header(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 8, 255])
def test_wrong_version_is_protocol_error(version):
    data = bytearray(F.encode_header(F.K_REQUEST, 0, 1, 0, []))
    data[2] = version
    with pytest.raises(torchwire.ProtocolError, match="version"):
        F.decode_header(bytes(data))


@pytest.mark.parametrize("kind", [0, 10, 200, 255])
def test_unknown_kind_is_protocol_error(kind):
    data = F.encode_header(kind, 0, 1, 0, [])
    with pytest.raises(torchwire.ProtocolError, match="kind"):
        F.decode_header(data)


def test_payload_over_max_message_size_is_protocol_error():
    assert F.decode_header(F.encode_header(F.K_REQUEST, 0, 1, 1000, []), 1000)[3] == 1000
    with pytest.raises(torchwire.ProtocolError, match="max message size"):
        F.decode_header(F.encode_header(F.K_REQUEST, 0, 1, 1001, []), 1000)
    with pytest.raises(torchwire.ProtocolError):
        F.decode_header(F.encode_header(F.K_RESPONSE, 0, 1, 2 ** 64 - 1, []))


def test_buffers_over_max_message_size_is_protocol_error():
    lens = [300, 200]
    data = F.encode_header(F.K_REQUEST, 0, 1, 500, lens)
    table = data[F.HEADER_SIZE:]
    assert F.decode_buffer_lens(table, 2, 500, max_message_size=1000) == lens
    with pytest.raises(torchwire.ProtocolError, match="max message size"):
        F.decode_buffer_lens(table, 2, 501, max_message_size=1000)


def test_too_many_buffers_is_protocol_error():
    data = F.pack_header(F.K_REQUEST, 0, 1, 0, F.MAX_BUFFERS + 1)
    with pytest.raises(torchwire.ProtocolError, match="buffers"):
        F.decode_header(data)
    ok = F.pack_header(F.K_REQUEST, 0, 1, 0, F.MAX_BUFFERS)
    assert F.decode_header(ok)[4] == F.MAX_BUFFERS


# ------------------------------------------------------------------ (c) Connection reader


class _Sink:
    """on_frames / on_close callbacks that record what a reader delivers."""

    def __init__(self) -> None:
        self.frames: list = []
        self.closed = threading.Event()
        self.close_exc = None

    def on_frames(self, conn, frames, at_rest=False) -> bool:
        self.frames.extend(frames)
        return False

    def on_close(self, conn, exc) -> None:
        self.close_exc = exc
        self.closed.set()


def _reader(max_message_size=F.DEFAULT_MAX_MESSAGE_SIZE):
    a, b = socket.socketpair()
    sink = _Sink()
    conn = Connection(a, 1, sink.on_frames, sink.on_close, max_message_size=max_message_size,
                      initiated=False, transport="unix")
    conn.start()
    return conn, b, sink


def test_connection_delivers_frames_with_their_tensors():
    conn, peer_sock, sink = _reader()
    sender_sink = _Sink()
    sender = Connection(peer_sock, 0, sender_sink.on_frames, sender_sink.on_close,
                        initiated=True, transport="unix")
    sender.start()
    try:
        # "y" is larger than the reader's 256 KiB buffer: received straight into storage
        value = {"x": torch.arange(10, dtype=torch.int16), "y": torch.randn(300_000)}
        payload, table = dumps(value)
        sender.send_frame(F.K_REQUEST, 0, 42, payload, table)
        sender.send_frame(F.K_GOODBYE, 0, 0, b"")
        sender.close()  # both frames are in the kernel: send_frame flushed them
        assert sink.closed.wait(10)
        assert sink.close_exc is None  # clean EOF after a GOODBYE
        assert [f[:3] for f in sink.frames] == [(F.K_REQUEST, 0, 42), (F.K_GOODBYE, 0, 0)]
        kind, flags, rid, got_payload, tensors = sink.frames[0]
        assert bytes(got_payload) == payload
        # "x" came whole with the frame's first read: handed on as a bytearray (typed
        # by the unpickler, no torch call in the reader); "y" as a uint8 tensor
        assert type(tensors[0]) is bytearray and len(tensors[0]) == 20
        assert tensors[1].dtype == torch.uint8 and tensors[1].numel() == 1_200_000
        got = loads(got_payload, tensors)
        assert torch.equal(got["x"], value["x"])
        # compared with numpy: torch.equal on 300k elements would start torch's thread pool
        assert got["y"].shape == value["y"].shape
        assert got["y"].numpy().tobytes() == value["y"].numpy().tobytes()
    finally:
        sender.close()
        conn.close()


def _cma_frame(rid: int, t: torch.Tensor, token: int) -> bytes:
    """A request whose one buffer stays in this process's memory (CMA)."""
    n = tensor_nbytes(t)
    return (F.encode_header(F.K_REQUEST, F.F_CMA, rid, 3, [n | F.REMOTE_BIT]) + b"abc"
            + F.REMOTE_REF.pack(t.data_ptr(), token))


def test_a_reader_sends_cma_releases_itself_and_never_blocks_on_a_full_socket():
    import os
    a, b = socket.socketpair()
    sink = _Sink()
    deferred: list = []
    ran = threading.Event()

    def defer(fn, *args):  # the pool: record, run on another thread
        deferred.append(fn)
        threading.Thread(target=lambda: (fn(*args), ran.set()), daemon=True).start()

    # This process plays the peer: the reader reads the buffers from our own memory.
    conn = Connection(a, 1, sink.on_frames, sink.on_close, initiated=False, transport="unix",
                      channels=ChannelSet(cma_pid=os.getpid()), defer=defer)
    conn.start()
    src = torch.arange(100_000, dtype=torch.int32)
    try:
        # 1. An idle socket: the reader writes the RELEASE itself, no other thread.
        b.sendall(_cma_frame(11, src, token=7))
        got = b.recv(F.HEADER_SIZE)
        assert F.HEADER.unpack(got)[2:5] == (F.K_RELEASE, 0, 7)
        assert deferred == []
        assert sink.frames[0][4][0].view(torch.int32).equal(src)
        # 2. The socket towards the peer is full: the reader must not block on it.
        a.setblocking(False)
        filled = 0
        try:
            while True:
                filled += a.send(b"\0" * 65536)
        except BlockingIOError:
            pass
        a.setblocking(True)
        b.sendall(_cma_frame(12, src, token=8))
        deadline = time.monotonic() + 10
        while len(sink.frames) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.frames) == 2, "the reader blocked on its full socket"
        assert len(deferred) == 1  # the pool writes the RELEASE once there is room
        assert not ran.is_set()
        drained = bytearray()
        b.settimeout(10)
        while len(drained) < filled + F.HEADER_SIZE:
            drained += b.recv(1 << 20)
        assert ran.wait(10)
        assert F.HEADER.unpack(bytes(drained[filled:]))[2:5] == (F.K_RELEASE, 0, 8)
        assert conn.frames_out == 2 and not conn.closed
    finally:
        conn.close()
        b.close()


@pytest.mark.parametrize("raw,match", [
    (b"XY" + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[2:], "magic"),
    (F.encode_header(F.K_REQUEST, 0, 1, 0, [])[:2] + b"\x09"
     + F.encode_header(F.K_REQUEST, 0, 1, 0, [])[3:], "version"),
    (F.encode_header(10, 0, 1, 0, []), "kind"),
    (F.encode_header(F.K_REQUEST, 0, 1, 5000, []), "max message size"),
    (F.encode_header(F.K_REQUEST, 0, 1, 10, [5000]), "max message size"),
], ids=["magic", "version", "kind", "payload_too_big", "buffers_too_big"])
def test_connection_drops_a_peer_that_breaks_the_protocol(raw, match):
    conn, peer_sock, sink = _reader(max_message_size=4096)
    try:
        peer_sock.sendall(raw)
        assert sink.closed.wait(10)
        assert isinstance(sink.close_exc, torchwire.ProtocolError)
        assert match in str(sink.close_exc)
        assert sink.frames == []
        assert conn.closed
    finally:
        conn.close()
        peer_sock.close()


def test_connection_reads_a_frame_with_more_buffers_than_its_read_buffer_holds():
    # 40,000 one-byte buffers: an 8-byte length each is 320,000 bytes of length table,
    # more than the reader's 256 KiB buffer, yet well under frame.MAX_BUFFERS.
    n = 40_000
    conn, peer_sock, sink = _reader()
    try:
        lens = [1] * n
        body = b"payload" + bytes(i % 256 for i in range(n))
        def send():
            try:
                peer_sock.sendall(F.encode_header(F.K_CONTROL, 0, 5, 7, lens) + body)
                peer_sock.shutdown(socket.SHUT_WR)
            except OSError:  # the reader dropped the connection: reported below
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        assert sink.closed.wait(10)
        assert sink.close_exc is None or not isinstance(sink.close_exc, torchwire.ProtocolError), (
            f"frame with {n} buffers refused: {sink.close_exc}")
        assert len(sink.frames) == 1
        kind, _, rid, payload, tensors = sink.frames[0]
        assert (kind, rid, bytes(payload)) == (F.K_CONTROL, 5, b"payload")
        assert len(tensors) == n
        assert [int(t[0]) for t in tensors[:300]] == [i % 256 for i in range(300)]
    finally:
        sender.join(10)
        conn.close()
        peer_sock.close()


def test_non_contiguous_view_keeps_its_strides_and_sends_its_span_only():
    base = torch.rand(5, 5)
    view = base.narrow(1, 2, 2)  # strides (5, 1): not contiguous
    payload, table = dumps(view)
    assert sum(t.numel() * t.element_size() for t in table) == 22 * 4  # span, not 25
    got = loads(payload, [t.reshape(-1).view(torch.uint8).clone() for t in table])
    assert torch.equal(got, view) and not got.is_contiguous() and got.stride() == (5, 1)
    sparse = torch.arange(100_000.0)[::1000]  # spans 99 001 elements for 100: compacted
    payload, table = dumps(sparse)
    assert sum(t.numel() * t.element_size() for t in table) == 100 * 4
    got = loads(payload, [t.reshape(-1).view(torch.uint8).clone() for t in table])
    assert torch.equal(got, sparse)


# ---------------------------------------------------------------- plain messages' tensors

@pytest.mark.parametrize("dtype", list(ser.plain._PLAIN_DTYPES))
@pytest.mark.parametrize("shape", [(0,), (5,), (2, 3), (1, 0, 4), ()])
def test_plain_tensors_round_trip_from_either_kind_of_buffer(dtype, shape):
    t = (torch.arange(math.prod(shape)) % 7).to(dtype).reshape(shape)
    code, got_shape = ser.plain_meta(t)
    raw = t.reshape(-1).view(torch.uint8)
    for buf in (bytearray(raw.numpy().tobytes()), raw.clone()):  # reader: small / pooled
        back = ser.plain_tensor(buf, code, got_shape)
        assert back.dtype == dtype and back.shape == t.shape
        assert torch.equal(back, t)


def test_tensors_that_need_pickling_have_no_plain_form():
    dense = torch.ones(4, 4)
    assert ser.plain_meta(dense) is not None
    for t in (dense.t(), dense.to_sparse(), torch.ones(3, requires_grad=True),
              torch.nn.Parameter(torch.ones(2)), torch.ones(2, dtype=torch.complex64).conj()):
        assert ser.plain_meta(t) is None, t


@pytest.mark.parametrize("code, shape", [(0, (4,)), (0, (2, 2, 2)), (1, (3,)), (0, (-3,)),
                                         (99, (3,)), (0, "xyz")])
def test_a_plain_description_that_does_not_fit_its_buffer_is_a_protocol_error(code, shape):
    buf = bytearray(12)  # three float32
    with pytest.raises(torchwire.ProtocolError, match="malformed tensor"):
        ser.plain_tensor(buf, code, shape)


def test_plain_replies_round_trip_and_others_are_left_to_pickle():
    for v in (None, torch.arange(5.0), torch.zeros(2, 0), torch.tensor(3)):
        payload, tensors = ser.plain_reply(v)
        bufs = [bytearray(byte_view(t, t.nbytes)) if t.nbytes else torch.empty(0, dtype=torch.uint8)
                for t in tensors]
        back = ser.plain_value(payload, bufs)
        assert (back is None and v is None) or torch.equal(back, v)
    for v in (1, "x", [torch.ones(1)], torch.ones(2, requires_grad=True), torch.ones(3, 3).t(),
              torch.nn.Parameter(torch.ones(1)), torch.ones(2).to_sparse()):
        assert ser.plain_reply(v) is None, v
    for payload, tensors in ((b"", []), (bytes([99]), []), (bytes([ser.PlainKind.TENSOR]), []),
                             (bytes([ser.PlainKind.TENSOR]) + b"\x07", [bytearray(4)])):
        with pytest.raises(torchwire.ProtocolError):
            ser.plain_value(payload, tensors)
