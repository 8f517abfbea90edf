"""Serialization: tensors and containers through dumps/loads and through real RPC.

(a) in-process round trips through ``torchwire._serialization`` with a tensor
    table that is byte-copied the way the transport delivers it;
(b) the same values echoed through a real RPC by the shared ``world`` job;
(c) the tensors of plain (unpickled) messages.

The values and their comparison are in tests/_serialization_cases.py; the frame
codec underneath is tested in tests/test_frame_codec.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

import torchwire
import torchwire.rpc as rpc
from _cluster import run_world
from _serialization_cases import (CASES, DTYPES, _gen, _nested, _quiet, _sparse, build,
                                  describe, differences, roundtrip, wire)
from torchwire import _serialization as ser
from torchwire._serialization import byte_view, dumps, loads, tensor_nbytes

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


@pytest.mark.parametrize("dtype", ["quint4x2", "quint2x4"])
def test_a_packed_quantized_tensor_is_refused_with_advice(dtype):
    q = _quiet(lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 1,
                                                 getattr(torch, dtype)))()
    for value in (q, [1, {"q": q}]):
        with pytest.raises(torchwire.SerializationError, match=r"dequantize\(\)"):
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


def test_an_expanded_tensor_travels_as_its_few_elements_with_its_zero_strides():
    row = torch.randn(1024)
    wide = row.expand(4096, 1024)  # 16 MiB of elements over 4 KiB of memory
    payload, table = dumps(wide)
    assert sum(t.numel() * t.element_size() for t in table) == 1024 * 4
    got = loads(payload, [t.reshape(-1).view(torch.uint8).clone() for t in table])
    assert torch.equal(got, wide) and got.stride() == (0, 1)


class _Tagged(torch.Tensor):
    pass


def test_attributes_of_a_parameter_or_tensor_subclass_travel_with_it():
    p = torch.nn.Parameter(torch.ones(3))
    p.tag = "sharded"
    s = torch.arange(4.0).as_subclass(_Tagged)
    s.tag = 7
    payload, table = dumps([p, s, torch.nn.Parameter(torch.zeros(2))])
    got = loads(payload, [t.reshape(-1).view(torch.uint8).clone() for t in table])
    assert type(got[0]) is torch.nn.Parameter and got[0].tag == "sharded"
    assert type(got[1]) is _Tagged and got[1].tag == 7 and torch.equal(got[1], s)
    assert got[2].__dict__ == {}


def test_views_of_one_storage_arrive_sharing_one_and_send_its_bytes_once():
    base = torch.arange(1000.0)
    value = {"view": base[10:20], "base": base, "ints": base.view(torch.int32)[500:510],
             "other": torch.ones(3), "strided": base.view(10, 100)[:, 3]}
    payload, table = dumps(value)
    assert sum(tensor_nbytes(t) for t in table) == 4000 + 12  # the storage's span, once
    got = loads(payload, wire(table))
    assert differences(value, got) == []
    got["view"][0] = -1.0
    got["base"][503] = 7.0
    got["strided"][2] = -5.0
    assert got["base"][10] == -1.0 and got["ints"][3] == torch.tensor(7.0).view(torch.int32)
    assert got["base"][203] == -5.0 and got["other"].data_ptr() != got["base"].data_ptr()


def test_small_views_near_each_other_share_the_few_bytes_between_them():
    base = torch.arange(10_000.0)
    payload, table = dumps((base[100:110], base[200:205]))
    assert sum(tensor_nbytes(t) for t in table) == 820 - 400  # bytes 400..820 of 40,000
    got = loads(payload, wire(table))
    assert torch.equal(got[0], base[100:110]) and torch.equal(got[1], base[200:205])
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()


def test_an_empty_view_travels_with_the_views_of_its_storage():
    x = torch.arange(10.0)
    for value in ((x, x[3:3]), (x[10:], x), (x[2:4], x[5:5], x[7:])):
        got = loads(*_payload_and_wire(value))
        assert differences(value, got) == []
        assert len({t.untyped_storage().data_ptr() for t in got}) == 1


def test_small_views_far_apart_in_a_large_storage_go_apart():
    # sharing them would send the 64 MiB between them (torch clones such views too)
    x = torch.zeros(16 << 20)
    x[:4] = 1.0
    x[-4:] = 2.0
    value = (x[:4], x[-4:], x.view(4096, 4096)[:, 0])
    payload, table = dumps(value)
    assert sum(tensor_nbytes(t) for t in table) == 16 + 16 + 4096 * 4
    got = loads(payload, wire(table))
    assert differences(value, got) == []


def _payload_and_wire(value):
    payload, table = dumps(value)
    return payload, wire(table)


def test_a_message_of_distinct_tensors_is_not_rewrapped():
    value = (torch.ones(3), torch.zeros(2), torch.arange(4)[1:])
    payload, table = dumps(value)
    assert b"_unshare" not in payload and len(table) == 3


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


def write_through_second(a, b):
    """Writes through ``b``; what ``a`` sees (a is b, then a's first element)."""
    b.view(-1)[0] = -1
    return a is b, a.view(-1)[0].item() if a.numel() == b.numel() else a[2].item()


def split_with_view(n: int):
    x = torch.arange(float(n))
    return x, x[1:3], x.view(8, -1)[:, 1]  # the column: a sparse view, sent compacted alone


def body_views_share_through_rpc():
    base = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    out = {}
    before = rpc.stats()["peers"].get("worker2", {}).get("bytes_out", 0)
    # a module function with two tensor arguments: the plain (unpickled) call form
    out["view"] = rpc.rpc_sync("worker2", write_through_second, args=(base, base[2:5]))
    out["bytes_out"] = rpc.stats()["peers"]["worker2"]["bytes_out"] - before
    out["same"] = rpc.rpc_sync("worker2", write_through_second, args=(base, base))
    out["detached"] = rpc.rpc_sync("worker2", write_through_second, args=(base, base.detach()))
    x, part, column = rpc.rpc_sync("worker2", split_with_view, args=(64,))
    part[0] = 100.0
    column[1] = 200.0
    out["reply"] = (x[1].item(), x[9].item(), x[2].item(), column.stride())
    return out


def test_views_of_one_storage_stay_one_storage_through_rpc(world):
    out = world.run(1, body_views_share_through_rpc)
    assert out["view"] == (False, -1.0)  # the callee's write through the view shows
    assert out["same"] == (True, -1.0) and out["detached"] == (False, -1.0)
    assert out["bytes_out"] < (1 << 20) + (64 << 10), "the storage was sent more than once"
    assert out["reply"] == (100.0, 200.0, 2.0, (8,))


def body_expanded():
    wide = torch.randn(1024).expand(65536, 1024)  # 256 MiB of elements, 4 KiB of memory
    before = rpc.stats()["peers"].get("worker2", {}).get("bytes_out", 0)
    got = rpc.rpc_sync("worker2", echo, args=(wide,))
    sent = rpc.stats()["peers"]["worker2"]["bytes_out"] - before
    return torch.equal(got, wide), got.stride(), sent


def test_an_expanded_tensor_crosses_as_its_memory_not_its_elements(world):
    equal, stride, sent = world.run(1, body_expanded)
    assert equal and stride == (0, 1)
    assert sent < 64 << 10, f"{sent} bytes sent for 4 KiB of memory"


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
    packed = _quiet(lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 1,
                                                      torch.quint4x2))()
    for key, value in {"quantized": packed, "lambda": lambda: lock,
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


# ---------------------------------------------------------------- (c) plain messages' tensors

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
