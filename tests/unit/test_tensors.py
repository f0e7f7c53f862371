"""stageserve/tensors.py and stageserve/datatypes.py: raw layout round trips and errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from stageserve import datatypes
from stageserve.datatypes import (
    BY_CONFIG_ENUM,
    BY_ONNX,
    BY_TRITON,
    from_config_enum,
    from_numpy,
    from_triton,
)
from stageserve.tensors import (
    TensorError,
    count_bytes_elements,
    element_count,
    numpy_to_raw,
    raw_to_numpy,
    serialize_bytes_elements,
    split_bytes_elements,
)

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None  # type: ignore[assignment]  # tests skip without it

FIXED = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
]
ALL = FIXED + ["BYTES"]


def sample(datatype: str, shape) -> np.ndarray:
    dt = from_triton(datatype)
    n = element_count(shape)
    if datatype == "BOOL":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if datatype in ("FP16", "FP32", "FP64"):
        return (np.arange(n, dtype=np.float64) * -1.25 + 0.5).astype(dt.numpy).reshape(shape)
    info = np.iinfo(dt.numpy)
    values = [info.min, info.max, 0, 1] * (n // 4 + 1)
    return np.array(values[:n], dtype=dt.numpy).reshape(shape)


def frame(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# ====================================================================== element_count


@pytest.mark.parametrize("shape,n", [([], 1), ([5], 5), ([2, 3, 4], 24), ([3, 0, 2], 0), ((7,), 7)])
def test_element_count(shape, n):
    assert element_count(shape) == n


# ====================================================================== BYTES framing


def test_serialize_bytes_layout():
    assert serialize_bytes_elements([b"ab", "é", b""]) == (
        b"\x02\x00\x00\x00ab" + b"\x02\x00\x00\x00\xc3\xa9" + b"\x00\x00\x00\x00"
    )
    assert serialize_bytes_elements([]) == b""


@pytest.mark.parametrize(
    "items",
    [[], [b""], [b"a"], [b"", b"", b""], [b"hello", b"\x00" * 300, b"x" * 70000], [b"\xff\xfe"]],
)
def test_bytes_round_trip(items):
    raw = serialize_bytes_elements(items)
    assert split_bytes_elements(raw) == items
    assert split_bytes_elements(memoryview(raw)) == items
    assert split_bytes_elements(raw, expected=len(items)) == items
    assert count_bytes_elements(raw) == len(items)
    assert count_bytes_elements(memoryview(raw)) == len(items)


def test_bytes_concatenation_is_batching():
    a = serialize_bytes_elements([b"a", b"bb"])
    b = serialize_bytes_elements([b"", b"ccc"])
    assert split_bytes_elements(a + b) == [b"a", b"bb", b"", b"ccc"]


@pytest.mark.parametrize(
    "raw,what",
    [
        (b"\x01", "truncated"),
        (b"\x01\x00\x00", "truncated"),
        (frame(b"ok") + b"\x00\x00", "truncated"),
        (struct.pack("<I", 5) + b"abcd", "declares 5 bytes but only 4 remain"),
        (frame(b"ok") + struct.pack("<I", 3), "declares 3 bytes but only 0 remain"),
        (struct.pack("<I", 2**32 - 1), "declares 4294967295"),
    ],
)
def test_malformed_bytes(raw, what):
    with pytest.raises(TensorError, match=what):
        split_bytes_elements(raw)
    with pytest.raises(TensorError, match=what):
        count_bytes_elements(raw)


def test_malformed_bytes_names_the_element():
    raw = frame(b"a", b"b") + b"\x09"
    with pytest.raises(TensorError, match="element 2"):
        split_bytes_elements(raw)
    with pytest.raises(TensorError, match="element 2"):
        count_bytes_elements(raw)


def test_bytes_expected_count_mismatch():
    with pytest.raises(TensorError, match="holds 2 elements, expected 3"):
        split_bytes_elements(frame(b"a", b"b"), expected=3)


def test_tensor_error_is_value_error():
    assert issubclass(TensorError, ValueError)


# ====================================================================== fixed-size round trips


@pytest.mark.parametrize("datatype", FIXED)
@pytest.mark.parametrize("shape", [[2, 3], [5], [], [0, 4]], ids=["2x3", "5", "scalar", "empty"])
def test_fixed_round_trip(datatype, shape):
    dt = from_triton(datatype)
    arr = sample(datatype, shape)
    raw = numpy_to_raw(arr, dt)
    assert len(raw) == element_count(shape) * dt.item_size
    assert raw == arr.astype(dt.numpy).astype(dt.numpy.newbyteorder("<")).tobytes()
    back = raw_to_numpy(raw, datatype, shape)
    assert back.shape == tuple(shape)
    assert back.dtype == dt.numpy
    np.testing.assert_array_equal(back, arr)
    # without a datatype, the array's own dtype decides
    assert numpy_to_raw(arr) == raw


@pytest.mark.parametrize("datatype", FIXED)
def test_raw_size_mismatch(datatype):
    dt = from_triton(datatype)
    raw = numpy_to_raw(sample(datatype, [4]), dt)
    for bad in (raw[:-1], raw + b"\x00", b""):
        with pytest.raises(
            TensorError, match=f"{datatype} tensor of shape \\[4\\] needs {len(raw)}"
        ):
            raw_to_numpy(bad, datatype, [4])


def test_raw_to_numpy_accepts_memoryview_and_list_shape():
    raw = np.arange(6, dtype=np.int32).tobytes()
    arr = raw_to_numpy(memoryview(raw), "INT32", [np.int64(2), 3])
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_known_layout_is_little_endian_row_major():
    assert numpy_to_raw(np.array([[1, 2], [3, 4]], np.int16)) == b"\x01\x00\x02\x00\x03\x00\x04\x00"
    assert raw_to_numpy(b"\x00\x00\x80\x3f", "FP32", [1]).tolist() == [1.0]


def test_non_contiguous_arrays_are_row_major():
    arr = np.arange(6, dtype=np.int32).reshape(2, 3).T  # Fortran-ordered view
    raw = numpy_to_raw(arr, from_triton("INT32"))
    assert raw_to_numpy(raw, "INT32", [3, 2]).tolist() == arr.tolist()
    assert numpy_to_raw(arr[::2]) == np.ascontiguousarray(arr[::2]).tobytes()


def test_big_endian_arrays_are_written_little_endian():
    arr = np.array([1, 258], dtype=">i4")
    expected = b"\x01\x00\x00\x00\x02\x01\x00\x00"
    assert numpy_to_raw(arr) == expected
    assert numpy_to_raw(arr, from_triton("INT32")) == expected
    assert raw_to_numpy(numpy_to_raw(np.array([1.5], ">f8")), "FP64", [1]).tolist() == [1.5]


def test_numpy_to_raw_converts_to_the_given_datatype():
    arr = np.array([1, -2, 3], dtype=np.int64)
    assert numpy_to_raw(arr, from_triton("INT32")) == np.array([1, -2, 3], np.int32).tobytes()
    assert numpy_to_raw(arr, from_triton("FP32")) == np.array([1, -2, 3], np.float32).tobytes()
    assert numpy_to_raw(np.array([0, 2, 0]), from_triton("BOOL")) == b"\x00\x01\x00"


# ====================================================================== BF16


def test_bf16_words_pass_through():
    words = np.array([0x3F80, 0xC020, 0x7FC0, 0], dtype=np.uint16)
    raw = numpy_to_raw(words, from_triton("BF16"))
    assert raw == words.tobytes()
    assert raw_to_numpy(raw, "BF16", [4]).tolist() == words.tolist()


def test_bf16_from_floats_is_rounded_not_reinterpreted():
    x = np.array([1.0, -2.5, 0.0, np.inf, -np.inf], np.float32)
    raw = numpy_to_raw(x, from_triton("BF16"))
    assert len(raw) == 2 * len(x)
    assert np.frombuffer(raw, np.uint16).tolist() == [0x3F80, 0xC020, 0x0000, 0x7F80, 0xFF80]
    # ties to even: 1 + 2**-8 is halfway between two bf16 values
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    assert np.frombuffer(numpy_to_raw(halfway, from_triton("BF16")), np.uint16).tolist() == [
        0x3F80,
        0x3F82,
    ]
    nan = np.frombuffer(
        numpy_to_raw(np.array([np.nan], np.float64), from_triton("BF16")), np.uint16
    )
    assert (nan[0] & 0x7F80) == 0x7F80 and (nan[0] & 0x7F) != 0  # still a NaN


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_bf16_matches_ml_dtypes():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000)).astype(np.float32)
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert numpy_to_raw(x, from_triton("BF16")) == expected.tobytes()
    assert numpy_to_raw(x.astype(ml_dtypes.bfloat16), from_triton("BF16")) == expected.tobytes()


# ====================================================================== BYTES tensors


def test_bytes_tensor_round_trip():
    arr = np.array([[b"a", b""], [b"xyz", b"\x00\x01"]], dtype=object)
    raw = numpy_to_raw(arr)
    assert raw == frame(b"a", b"", b"xyz", b"\x00\x01")
    assert numpy_to_raw(arr, from_triton("BYTES")) == raw
    back = raw_to_numpy(raw, "BYTES", [2, 2])
    assert back.dtype == object and back.shape == (2, 2)
    assert back.tolist() == arr.tolist()


def test_bytes_tensor_from_str_and_fixed_width_arrays():
    assert numpy_to_raw(np.array(["hé", "x"])) == frame("hé".encode(), b"x")
    assert numpy_to_raw(np.array([b"ab", b"c"], dtype="S2")) == frame(b"ab", b"c")
    mixed = np.array([b"b", "s", np.bytes_(b"n"), 7], dtype=object)
    assert numpy_to_raw(mixed) == frame(b"b", b"s", b"n", b"7")


def test_bytes_datatype_with_numeric_array():
    assert numpy_to_raw(np.array([1, 22]), from_triton("BYTES")) == frame(b"1", b"22")


def test_bytes_scalar_and_empty():
    assert raw_to_numpy(frame(b"only"), "BYTES", []).tolist() == b"only"
    empty = raw_to_numpy(b"", "BYTES", [0, 3])
    assert empty.shape == (0, 3)


@pytest.mark.parametrize("items", [1, 3])
def test_bytes_tensor_count_mismatch(items):
    with pytest.raises(TensorError, match="expected 2"):
        raw_to_numpy(frame(*[b"q"] * items), "BYTES", [2])


def test_bytes_tensor_malformed():
    with pytest.raises(TensorError):
        raw_to_numpy(b"\x05\x00\x00\x00ab", "BYTES", [1])


def test_unknown_datatype_name():
    with pytest.raises(KeyError):
        raw_to_numpy(b"", "FP8", [0])


@pytest.mark.parametrize("datatype", ALL)
def test_batched_raw_is_concatenation(datatype):
    dt = from_triton(datatype)
    if datatype == "BYTES":
        a = np.array([[b"a", b"bc"]], dtype=object)
        b = np.array([[b"", b"d"], [b"eee", b"f"]], dtype=object)
    else:
        a, b = sample(datatype, [1, 2]), sample(datatype, [2, 2])[::-1].copy()
    joined = numpy_to_raw(a, dt) + numpy_to_raw(b, dt)
    batched = raw_to_numpy(joined, datatype, [3, 2])
    assert batched.tolist() == np.concatenate([a, b]).tolist()


# ====================================================================== datatypes


@pytest.mark.parametrize("datatype", ALL)
def test_datatype_table_is_consistent(datatype):
    d = from_triton(datatype)
    assert d.triton == datatype
    assert from_config_enum(d.config_enum) is d
    assert BY_ONNX[d.onnx] is d
    if d.numpy is None:
        assert datatype == "BYTES" and d.item_size == 0
    else:
        assert d.item_size == d.numpy.itemsize


def test_datatype_names_are_unique():
    assert len(BY_TRITON) == len(BY_CONFIG_ENUM) == len(BY_ONNX) == len(ALL)
    assert BY_CONFIG_ENUM["TYPE_STRING"].triton == "BYTES"


def test_onnx_enum_values_match_onnx():
    onnx = pytest.importorskip("onnx")
    names = {
        "BOOL": "BOOL",
        "UINT8": "UINT8",
        "UINT16": "UINT16",
        "UINT32": "UINT32",
        "UINT64": "UINT64",
        "INT8": "INT8",
        "INT16": "INT16",
        "INT32": "INT32",
        "INT64": "INT64",
        "FP16": "FLOAT16",
        "FP32": "FLOAT",
        "FP64": "DOUBLE",
        "BF16": "BFLOAT16",
        "BYTES": "STRING",
    }
    for triton, onnx_name in names.items():
        assert from_triton(triton).onnx == getattr(onnx.TensorProto, onnx_name), triton


def test_config_enum_names_match_model_config_proto():
    from stageserve.generated import model_config_pb2 as mc

    for d in BY_TRITON.values():
        assert mc.DataType.Value(d.config_enum) > 0


@pytest.mark.parametrize("name", ["TYPE_INVALID", "FP32", "TYPE_FLOAT", ""])
def test_from_config_enum_unknown(name):
    with pytest.raises(KeyError):
        from_config_enum(name)


@pytest.mark.parametrize("name", ["TYPE_FP32", "fp32", "STRING", ""])
def test_from_triton_unknown(name):
    with pytest.raises(KeyError):
        from_triton(name)


@pytest.mark.parametrize("datatype", [d for d in FIXED if d != "BF16"])
def test_from_numpy_fixed(datatype):
    d = from_triton(datatype)
    assert from_numpy(d.numpy) is d
    assert from_numpy(d.numpy.newbyteorder(">")) is d  # byte order does not change the type


def test_from_numpy_uint16_is_uint16_not_bf16():
    assert from_numpy(np.dtype(np.uint16)).triton == "UINT16"


@pytest.mark.parametrize("dtype", [np.dtype(object), np.dtype("S7"), np.dtype("U3")])
def test_from_numpy_bytes(dtype):
    assert from_numpy(dtype).triton == "BYTES"


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_from_numpy_bfloat16():
    assert from_numpy(np.dtype(ml_dtypes.bfloat16)).triton == "BF16"


@pytest.mark.parametrize(
    "dtype",
    [np.complex64, np.dtype("M8[s]"), np.float128 if hasattr(np, "float128") else np.complex128],
)
def test_from_numpy_unsupported(dtype):
    with pytest.raises(KeyError, match="no Triton datatype"):
        from_numpy(np.dtype(dtype))


def test_module_exposes_one_table():
    assert set(datatypes.BY_TRITON) == set(ALL)
