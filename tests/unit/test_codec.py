"""hookwire.wire.codec: Values and Tensors between Python and the wire."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from hookwire.wire import codec
from hookwire.v1 import tensor_pb2

# Every DType of the contract, with its torch and numpy counterparts (bfloat16
# has no numpy dtype: without torch it widens to float32).
DTYPES = [
    (tensor_pb2.DTYPE_FLOAT32, torch.float32, np.float32),
    (tensor_pb2.DTYPE_FLOAT64, torch.float64, np.float64),
    (tensor_pb2.DTYPE_FLOAT16, torch.float16, np.float16),
    (tensor_pb2.DTYPE_BFLOAT16, torch.bfloat16, None),
    (tensor_pb2.DTYPE_INT8, torch.int8, np.int8),
    (tensor_pb2.DTYPE_INT16, torch.int16, np.int16),
    (tensor_pb2.DTYPE_INT32, torch.int32, np.int32),
    (tensor_pb2.DTYPE_INT64, torch.int64, np.int64),
    (tensor_pb2.DTYPE_UINT8, torch.uint8, np.uint8),
    (tensor_pb2.DTYPE_BOOL, torch.bool, np.bool_),
]
DTYPE_IDS = [tensor_pb2.DType.Name(code) for code, _, _ in DTYPES]
TORCH_DTYPES = [t for _, t, _ in DTYPES]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ITEMSIZES = {
    torch.float32: 4,
    torch.float64: 8,
    torch.float16: 2,
    torch.bfloat16: 2,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 4,
    torch.int64: 8,
    torch.uint8: 1,
    torch.bool: 1,
}
# Bit patterns of NaNs with payloads (quiet and signalling), infinities and -0.0.
SPECIAL_BITS = {
    torch.float32: (torch.int32, [0x7FC00001, 0x7F800001, -0x3FFFFF, 0x7F800000, -0x7F800000, -(2**31), 0x00000001]),
    torch.float64: (
        torch.int64,
        [0x7FF8000000000001, 0x7FF0000000000001, -0x7FFFFFFFFFFFF, 0x7FF0000000000000, -(2**63), 1],
    ),
    torch.float16: (torch.int16, [0x7E01, 0x7C01, -0x1FF, 0x7C00, -0x8000, 0x0001]),
    torch.bfloat16: (torch.int16, [0x7FC1, 0x7F81, -0x3F, 0x7F80, -0x8000, 0x0001]),
}


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """A deterministic tensor of ``dtype`` with varied (incl. negative, extreme) values."""
    g = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
    flat = t.view(-1)
    if flat.numel() >= 2:
        flat[0] = info.min
        flat[1] = info.max
    return t


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert raw_bytes(got) == raw_bytes(want)
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want)
    else:
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan], want[~nan])


def roundtrip_tensor(t, **kw):
    msg = codec.encode_tensor(t)
    wire = tensor_pb2.Tensor.FromString(msg.SerializeToString())
    return msg, codec.decode_tensor(wire, **kw)


def assert_writable_torch(t: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(1)


def assert_writable_numpy(a) -> None:
    assert isinstance(a, np.ndarray), type(a)
    assert a.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a[...] = a.dtype.type(1)


# --------------------------------------------------------------------------- tensors through torch


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_roundtrip_every_dtype(dtype):
    t = sample(dtype)
    msg, got = roundtrip_tensor(t)
    assert msg.dtype == codec.wire_dtype_of(dtype)
    assert list(msg.shape) == [3, 5]
    assert len(msg.data) == 15 * ITEMSIZES[dtype]
    assert msg.data == raw_bytes(t)
    assert_identical(got, t)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d))
def test_float_special_bit_patterns_survive(dtype):
    int_dtype, bits = SPECIAL_BITS[dtype]
    t = torch.tensor(bits, dtype=torch.int64).to(int_dtype).view(dtype)
    assert torch.isnan(t).any()
    _, got = roundtrip_tensor(t)
    assert raw_bytes(got) == raw_bytes(t)
    assert torch.equal(got.view(int_dtype), t.view(int_dtype))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_scalar_tensor(dtype):
    t = sample(dtype, ()).clone()
    msg, got = roundtrip_tensor(t)
    assert list(msg.shape) == []
    assert len(msg.data) == ITEMSIZES[dtype]
    assert got.shape == torch.Size([])
    assert_identical(got, t)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 4)])
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_zero_element_tensor(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    msg, got = roundtrip_tensor(t)
    assert list(msg.shape) == list(shape)
    assert msg.data == b""
    assert got.dtype == dtype
    assert got.shape == torch.Size(shape)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_non_contiguous_sources(dtype):
    base = sample(dtype, (6, 8))
    views = {
        "transposed": base.t(),
        "step-sliced": base[::2, 1::3],
        "transposed-and-sliced": base.t()[::3],
        "expanded": base[:1].expand(4, 8),
    }
    for name, view in views.items():
        assert not view.is_contiguous(), name
        msg, got = roundtrip_tensor(view)
        assert list(msg.shape) == list(view.shape), name
        assert msg.data == raw_bytes(view.contiguous()), name
        assert got.is_contiguous(), name
        assert_identical(got, view.contiguous())


def test_negative_and_conjugate_views_are_resolved():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    neg = torch._neg_view(t)
    assert neg.is_neg()
    _, got = roundtrip_tensor(neg)
    assert torch.equal(got, -t)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d))
def test_requires_grad_tensor(dtype):
    leaf = sample(dtype, (2, 3)).requires_grad_(True)
    nonleaf = leaf * 2
    for t in (leaf, nonleaf):
        msg, got = roundtrip_tensor(t)
        assert msg.data == raw_bytes(t)
        assert not got.requires_grad
        assert_identical(got, t.detach())
    assert leaf.grad is None


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(4, 3), ()], ids=["matrix", "scalar"])
def test_decoded_torch_tensor_is_writable_and_owns_its_memory(dtype, shape):
    t = sample(dtype, shape).clone()
    msg = codec.encode_tensor(t)
    data_before = bytes(msg.data)
    got = codec.decode_tensor(msg)
    assert_writable_torch(got)
    # Writing to the result changes neither the message nor the source.
    assert msg.data == data_before
    assert raw_bytes(t) == data_before


def test_decode_tensor_twice_yields_independent_tensors():
    msg = codec.encode_tensor(torch.zeros(4))
    a = codec.decode_tensor(msg)
    b = codec.decode_tensor(msg)
    a.fill_(7)
    assert torch.equal(b, torch.zeros(4))


# --------------------------------------------------------------------------- numpy


@pytest.mark.parametrize(
    "code,tdtype,ndtype",
    [d for d in DTYPES if d[2] is not None],
    ids=[i for i, d in zip(DTYPE_IDS, DTYPES) if d[2] is not None],
)
def test_decode_as_numpy(code, tdtype, ndtype):
    t = sample(tdtype, (2, 7))
    msg = codec.encode_tensor(t)
    arr = codec.decode_tensor(msg, as_numpy=True)
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == np.dtype(ndtype)
    assert arr.shape == (2, 7)
    assert arr.tobytes() == msg.data
    np.testing.assert_array_equal(arr, t.numpy())
    assert_writable_numpy(arr)


@pytest.mark.parametrize(
    "code,tdtype,ndtype",
    [d for d in DTYPES if d[2] is not None],
    ids=[i for i, d in zip(DTYPE_IDS, DTYPES) if d[2] is not None],
)
def test_numpy_array_encodes_like_torch(code, tdtype, ndtype):
    t = sample(tdtype, (3, 4))
    arr = t.numpy()
    from_np = codec.encode_tensor(arr)
    from_torch = codec.encode_tensor(t)
    assert from_np == from_torch
    assert from_np.dtype == code
    # Non-contiguous numpy sources too.
    assert codec.encode_tensor(arr.T) == codec.encode_tensor(t.t())
    assert codec.encode_tensor(arr[:, ::2]) == codec.encode_tensor(t[:, ::2])


def test_decode_as_numpy_float_nan_payloads_exact():
    bits = np.array([0x7FC00001, 0x7F800001, 0xFFC0FFFF, 0x3F800000], dtype=np.uint32)
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], data=bits.tobytes())
    arr = codec.decode_tensor(msg, as_numpy=True)
    assert arr.dtype == np.float32
    assert arr.view(np.uint32).tolist() == bits.tolist()


def test_bfloat16_as_numpy_widens_exactly_like_torch():
    # Every bf16 bit pattern: normals, subnormals, zeros, infinities, NaNs with payloads.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16).reshape(256, 256)
    msg = codec.encode_tensor(t)
    arr = codec.decode_tensor(msg, as_numpy=True)
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == np.float32
    assert arr.shape == (256, 256)
    want = t.to(torch.float32)
    assert arr.tobytes() == raw_bytes(want)
    assert_writable_numpy(arr)


def test_bfloat16_scalar_as_numpy_is_writable_array():
    t = torch.tensor(1.5, dtype=torch.bfloat16)
    arr = codec.decode_tensor(codec.encode_tensor(t), as_numpy=True)
    assert isinstance(arr, np.ndarray)
    assert arr.shape == ()
    assert arr.dtype == np.float32
    assert float(arr) == 1.5
    assert_writable_numpy(arr)


@pytest.mark.parametrize(
    "code,tdtype,ndtype",
    [d for d in DTYPES if d[2] is not None],
    ids=[i for i, d in zip(DTYPE_IDS, DTYPES) if d[2] is not None],
)
def test_scalar_and_empty_as_numpy(code, tdtype, ndtype):
    scalar = codec.decode_tensor(codec.encode_tensor(sample(tdtype, ()).clone()), as_numpy=True)
    assert isinstance(scalar, np.ndarray)
    assert scalar.shape == ()
    assert_writable_numpy(scalar)
    empty = codec.decode_tensor(codec.encode_tensor(torch.empty(0, 3, dtype=tdtype)), as_numpy=True)
    assert isinstance(empty, np.ndarray)
    assert empty.shape == (0, 3)
    assert empty.dtype == np.dtype(ndtype)


def test_bfloat16_empty_as_numpy():
    arr = codec.decode_tensor(codec.encode_tensor(torch.empty(2, 0, dtype=torch.bfloat16)), as_numpy=True)
    assert isinstance(arr, np.ndarray)
    assert arr.shape == (2, 0)
    assert arr.dtype == np.float32


def test_decode_value_as_numpy_propagates_into_containers():
    value = codec.encode_value({"a": [torch.ones(2)], "b": (torch.zeros((), dtype=torch.int64),)})
    out = codec.decode_value(value, as_numpy=True)
    assert isinstance(out["a"][0], np.ndarray)
    assert isinstance(out["b"][0], np.ndarray)
    np.testing.assert_array_equal(out["a"][0], np.ones(2, dtype=np.float32))


# --------------------------------------------------------------------------- values


def roundtrip_value(obj, **kw):
    wire = tensor_pb2.Value.FromString(codec.encode_value(obj).SerializeToString())
    return codec.decode_value(wire, **kw)


@pytest.mark.parametrize(
    "obj,kind",
    [
        (None, "null_value"),
        (True, "bool_value"),
        (False, "bool_value"),
        (0, "int_value"),
        (-7, "int_value"),
        (2**63 - 1, "int_value"),
        (-(2**63), "int_value"),
        (1.5, "float_value"),
        (-0.0, "float_value"),
        (float("inf"), "float_value"),
        (1e308, "float_value"),
        ("", "string_value"),
        ("héllo \u2603 \x00", "string_value"),
    ],
)
def test_python_scalars(obj, kind):
    msg = codec.encode_value(obj)
    assert msg.WhichOneof("kind") == kind
    got = roundtrip_value(obj)
    assert type(got) is type(obj)
    assert got == obj
    if isinstance(obj, float):
        assert math.copysign(1.0, got) == math.copysign(1.0, obj)


def test_float_nan_value():
    got = roundtrip_value(float("nan"))
    assert isinstance(got, float) and math.isnan(got)


def test_bool_is_not_encoded_as_int():
    assert codec.encode_value(True).WhichOneof("kind") == "bool_value"
    assert codec.encode_value(np.bool_(False)).WhichOneof("kind") == "bool_value"


def test_numpy_scalars_become_python_scalars():
    assert roundtrip_value(np.int32(-3)) == -3
    assert type(roundtrip_value(np.int64(5))) is int
    assert roundtrip_value(np.float32(0.5)) == 0.5
    assert type(roundtrip_value(np.float64(0.25))) is float


def test_empty_value_decodes_to_none():
    assert codec.decode_value(tensor_pb2.Value()) is None


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 10**30, -(10**30)])
def test_int_out_of_int64_range_raises(bad):
    with pytest.raises(codec.CodecError, match="int64"):
        codec.encode_value(bad)
    with pytest.raises(codec.CodecError):
        codec.encode_value({"x": [1, (2, bad)]})


def test_list_and_tuple_are_distinguished():
    obj = ([1, 2], (3, 4), [], (), [(5,), [6]])
    msg = codec.encode_value(obj)
    assert msg.list.is_list is False
    assert msg.list.items[0].list.is_list is True
    assert msg.list.items[1].list.is_list is False
    got = roundtrip_value(obj)
    assert got == obj
    assert type(got) is tuple
    assert type(got[0]) is list
    assert type(got[1]) is tuple
    assert type(got[2]) is list
    assert type(got[3]) is tuple
    assert type(got[4][0]) is tuple
    assert type(got[4][1]) is list


def test_empty_list_and_tuple_keep_their_kind():
    assert codec.encode_value([]).WhichOneof("kind") == "list"
    assert codec.encode_value(()).WhichOneof("kind") == "list"
    assert roundtrip_value([]) == []
    assert roundtrip_value(()) == ()
    assert codec.encode_value({}).WhichOneof("kind") == "map"
    assert roundtrip_value({}) == {}


def test_map_preserves_insertion_order():
    keys = ["zeta", "alpha", "mid", "Alpha", "", "b", "a"]
    obj = {k: i for i, k in enumerate(keys)}
    msg = codec.encode_value(obj)
    assert list(msg.map.keys) == keys
    got = roundtrip_value(obj)
    assert list(got) == keys
    assert got == obj


def test_map_without_keys_decodes_in_some_order():
    msg = tensor_pb2.Value()
    msg.map.entries["b"].int_value = 1
    msg.map.entries["a"].int_value = 2
    assert codec.decode_value(msg) == {"a": 2, "b": 1}


def test_nested_containers_with_tensors():
    t1 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t2 = torch.tensor([True, False])
    obj = {
        "hidden": (t1, [t2, None]),
        "meta": {"name": "layer.0", "n": 3, "scale": 0.5, "flag": False},
        "empty": [],
    }
    msg = codec.encode_value(obj)
    nbytes = codec.encode_value_into(obj, tensor_pb2.Value())
    assert nbytes == t1.numel() * 4 + t2.numel()
    got = roundtrip_value(obj)
    assert list(got) == ["hidden", "meta", "empty"]
    assert type(got["hidden"]) is tuple
    assert_identical(got["hidden"][0], t1)
    assert type(got["hidden"][1]) is list
    assert_identical(got["hidden"][1][0], t2)
    assert got["hidden"][1][1] is None
    assert got["meta"] == obj["meta"]
    assert list(got["meta"]) == ["name", "n", "scale", "flag"]
    assert got["empty"] == []
    assert msg.map.entries["hidden"].list.items[0].tensor.dtype == tensor_pb2.DTYPE_FLOAT32


def test_mapping_that_is_not_a_dict_is_encoded():
    import collections
    import types

    got = roundtrip_value(types.MappingProxyType(collections.OrderedDict([("y", 1), ("x", 2)])))
    assert got == {"y": 1, "x": 2}
    assert list(got) == ["y", "x"]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "obj",
    [
        object(),
        b"bytes",
        {1, 2},
        1 + 2j,
        torch.zeros(2, dtype=torch.complex64),
        torch.zeros(2, dtype=torch.uint16),
        np.zeros(2, dtype=np.complex128),
        np.zeros(2, dtype=np.uint32),
        np.array(["a"]),
        [1, object()],
        {"k": (None, torch.zeros(1, dtype=torch.complex128))},
    ],
    ids=lambda o: type(o).__name__ if not hasattr(o, "dtype") else f"{type(o).__name__}-{o.dtype}",
)
def test_unsupported_values_raise_codec_error(obj):
    with pytest.raises(codec.CodecError):
        codec.encode_value(obj)


def test_codec_error_is_value_error():
    assert issubclass(codec.CodecError, ValueError)


def test_non_string_map_key_raises():
    with pytest.raises(codec.CodecError, match="not a string"):
        codec.encode_value({1: "a"})


def test_encode_tensor_rejects_non_tensor():
    with pytest.raises(codec.CodecError):
        codec.encode_tensor([1.0, 2.0])
    with pytest.raises(codec.CodecError, match="complex"):
        codec.encode_tensor(torch.zeros(1, dtype=torch.complex64))


@pytest.mark.parametrize("code", [tensor_pb2.DTYPE_UNSPECIFIED, 11, 99, 12345])
def test_decode_rejects_unknown_dtype(code):
    msg = tensor_pb2.Tensor(dtype=code, shape=[1], data=b"\x00" * 4)
    with pytest.raises(codec.CodecError, match="not a valid dtype"):
        codec.decode_tensor(msg)
    with pytest.raises(codec.CodecError):
        codec.decode_tensor(msg, as_numpy=True)


def test_decode_rejects_negative_dimension():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, -1], data=b"")
    with pytest.raises(codec.CodecError, match="negative"):
        codec.decode_tensor(msg)
    # Two negatives whose product would be positive and match the data.
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[-1, -2], data=b"\x00\x00")
    with pytest.raises(codec.CodecError, match="negative"):
        codec.decode_tensor(msg, as_numpy=True)


@pytest.mark.parametrize(
    "dtype,shape,nbytes,expected",
    [
        (tensor_pb2.DTYPE_FLOAT32, [2, 3], 20, 24),
        (tensor_pb2.DTYPE_FLOAT32, [2, 3], 28, 24),
        (tensor_pb2.DTYPE_FLOAT64, [], 4, 8),
        (tensor_pb2.DTYPE_INT16, [0, 5], 2, 0),
        (tensor_pb2.DTYPE_BFLOAT16, [3], 0, 6),
        (tensor_pb2.DTYPE_BOOL, [4], 5, 4),
    ],
)
def test_decode_rejects_byte_length_mismatch(dtype, shape, nbytes, expected):
    msg = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=b"\x01" * nbytes)
    for as_numpy in (False, True):
        with pytest.raises(codec.CodecError) as info:
            codec.decode_tensor(msg, where="args[0]", as_numpy=as_numpy)
        text = str(info.value)
        assert f"{nbytes} bytes" in text
        assert f"needs {expected}" in text
        assert "args[0]" in text


def test_decode_value_error_names_the_location():
    msg = tensor_pb2.Value()
    msg.map.keys.append("x")
    bad = msg.map.entries["x"].list.items.add().tensor
    bad.dtype = tensor_pb2.DTYPE_FLOAT32
    bad.shape.append(2)
    bad.data = b"\x00"
    with pytest.raises(codec.CodecError) as info:
        codec.decode_value(msg, where="output")
    assert "output['x'][0]" in str(info.value)


def nested_list_value(levels: int) -> tensor_pb2.Value:
    """A Value of ``levels`` nested lists around an int."""
    root = tensor_pb2.Value()
    cur = root
    for _ in range(levels):
        cur = cur.list.items.add()
    cur.int_value = 1
    return root


def nested_map_value(levels: int) -> tensor_pb2.Value:
    root = tensor_pb2.Value()
    cur = root
    for _ in range(levels):
        cur.map.keys.append("k")
        cur = cur.map.entries["k"]
    cur.int_value = 1
    return root


def test_decode_nesting_up_to_max_depth_is_accepted():
    got = codec.decode_value(nested_list_value(codec.MAX_DEPTH))
    for _ in range(codec.MAX_DEPTH):
        assert isinstance(got, tuple) and len(got) == 1
        got = got[0]
    assert got == 1


@pytest.mark.parametrize("builder", [nested_list_value, nested_map_value])
@pytest.mark.parametrize("extra", [1, 2, 40])
def test_decode_nesting_deeper_than_max_depth_raises(builder, extra):
    msg = builder(codec.MAX_DEPTH + extra)
    with pytest.raises(codec.CodecError, match="deeper"):
        codec.decode_value(msg)


def test_encode_nesting_deeper_than_max_depth_raises():
    obj: object = 1
    for _ in range(codec.MAX_DEPTH + 1):
        obj = [obj]
    with pytest.raises(codec.CodecError, match="deeper"):
        codec.encode_value(obj)
    ok: object = 1
    for _ in range(codec.MAX_DEPTH):
        ok = [ok]
    # In memory (no serialization): encode and decode agree on the limit.
    assert codec.decode_value(codec.encode_value(ok)) == ok


@pytest.mark.parametrize("wrap", [lambda o: [o], lambda o: {"k": o}], ids=["list", "map"])
def test_every_encodable_nesting_survives_serialization(wrap):
    obj: object = 1
    for _ in range(codec.MAX_DEPTH):
        obj = wrap(obj)
    assert roundtrip_value(obj) == obj


def test_self_referencing_list_raises_codec_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(codec.CodecError):
        codec.encode_value(loop)


# --------------------------------------------------------------------------- dtype helpers


@pytest.mark.parametrize("code,tdtype,ndtype", DTYPES, ids=DTYPE_IDS)
def test_wire_dtype_of(code, tdtype, ndtype):
    assert codec.wire_dtype_of(tdtype) == code
    assert codec.TORCH_DTYPES[code] == tdtype
    if ndtype is not None:
        assert codec.wire_dtype_of(np.dtype(ndtype)) == code
    assert codec.ITEMSIZE[code] == ITEMSIZES[tdtype]


def test_dtype_enum_fully_covered():
    codes = {v.number for v in tensor_pb2.DType.DESCRIPTOR.values} - {tensor_pb2.DTYPE_UNSPECIFIED}
    assert codes == {code for code, _, _ in DTYPES}
    assert set(codec.ITEMSIZE) == codes


def test_wire_dtype_of_unknown_raises():
    for bad in (torch.complex64, np.complex64, np.uint64, "not-a-dtype"):
        with pytest.raises(codec.CodecError):
            codec.wire_dtype_of(bad)


def test_dtype_name():
    assert codec.dtype_name(tensor_pb2.DTYPE_BFLOAT16) == "DTYPE_BFLOAT16"
    assert "77" in codec.dtype_name(77)


def test_a_value_in_wire_form_is_copied_as_the_tensor_would_be_encoded():
    """A capture a vLLM worker sent as a Value message: encode_value_into copies it, inline
    or through a chunker that keeps its size, byte for byte what encoding the tensor gives;
    a value that is not a plain tensor is decoded and encoded again."""
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    wire = codec.encode_value(t)
    direct, copied = tensor_pb2.Value(), tensor_pb2.Value()
    assert codec.encode_value_into(t, direct) == codec.encode_value_into(wire, copied) == t.numel() * 4
    assert copied.SerializeToString() == direct.SerializeToString()
    want_chunker, got_chunker = codec.Chunker(snapshot=False), codec.Chunker(snapshot=False)
    want_chunker.INLINE_TENSOR_MAX = got_chunker.INLINE_TENSOR_MAX = 8  # both keep it
    direct, copied = tensor_pb2.Value(), tensor_pb2.Value()
    codec.encode_value_into(t, direct, chunker=want_chunker)
    codec.encode_value_into(wire, copied, chunker=got_chunker)
    assert copied.tensor.chunk_id and not copied.tensor.data
    assert [c.SerializeToString() for c in got_chunker.chunks(16)] == [c.SerializeToString() for c in want_chunker.chunks(16)]
    nested = codec.encode_value((t, 2))
    out = tensor_pb2.Value()
    codec.encode_value_into(nested, out)
    assert out.SerializeToString() == codec.encode_value((t, 2)).SerializeToString()
