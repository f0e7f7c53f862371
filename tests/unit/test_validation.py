"""stageserve/validation.py: every refusal and every accepted request shape.

Our generated modules live in a private descriptor pool; tritonclient is not
imported here on purpose.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from stageserve.config import parse_config_text, to_spec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.validation import CONTENTS_FIELD, ValidatedRequest, validate_infer

MODEL = "vmodel"

BATCHED = to_spec(
    parse_config_text(
        f"""
name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {{ name: "IN_F" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "IN_I" data_type: TYPE_INT32 dims: [ -1, 2 ] }},
  {{ name: "IN_S" data_type: TYPE_STRING dims: [ 2 ] optional: true }}
]
output [
  {{ name: "OUT_A" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "OUT_B" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "OUT_C" data_type: TYPE_FP32 dims: [ 3 ] }}
]
"""
    )
)


def spec_for(datatype_enum: str, dims="[ 4 ]", max_batch_size=0, extra=""):
    return to_spec(
        parse_config_text(
            f"""
name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "T" data_type: {datatype_enum} dims: {dims} {extra} }} ]
output [ {{ name: "O" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""
        )
    )


def tensor(name, datatype, shape, **contents):
    t = gs.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(t.contents, field).extend(values)
    return t


def request(inputs, raws=None, outputs=(), **params):
    r = gs.ModelInferRequest(model_name=MODEL, inputs=inputs)
    if raws is not None:
        r.raw_input_contents.extend(raws)
    for name in outputs:
        r.outputs.add(name=name)
    for name, (which, value) in params.items():
        setattr(r.parameters[name], which, value)
    return r


def f32(*shape):
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def i32(*shape):
    return np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)


def good_inputs(batch=2, n=5):
    """A valid raw request for BATCHED: IN_F [batch,3], IN_I [batch,n,2]."""
    return (
        [tensor("IN_F", "FP32", [batch, 3]), tensor("IN_I", "INT32", [batch, n, 2])],
        [f32(batch, 3).tobytes(), i32(batch, n, 2).tobytes()],
    )


def refused(req, spec=BATCHED, *words) -> str:
    with pytest.raises(StageError) as info:
        validate_infer(req, spec)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in err.message, f"{w!r} not in {err.message!r}"
    return err.message


def frame(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# ====================================================================== errors


def test_unknown_input():
    inputs, raws = good_inputs()
    inputs.append(tensor("NOPE", "FP32", [2, 3]))
    raws.append(f32(2, 3).tobytes())
    refused(request(inputs, raws), BATCHED, MODEL, "'NOPE'", "unexpected inference input")


def test_duplicate_input():
    inputs, raws = good_inputs()
    inputs.append(tensor("IN_F", "FP32", [2, 3]))
    raws.append(f32(2, 3).tobytes())
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_F'", "more than once")


def test_wrong_datatype():
    inputs, raws = good_inputs()
    inputs[0] = tensor("IN_F", "FP64", [2, 3])
    raws[0] = f32(2, 3).astype(np.float64).tobytes()
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_F'", "FP64", "FP32")


@pytest.mark.parametrize(
    "shape",
    [[2, 4], [2, 3, 1], [2], [2, 1, 3]],
    ids=["wrong-dim", "extra-dim", "missing-dim", "wrong-rank"],
)
def test_wrong_shape(shape):
    inputs, raws = good_inputs()
    inputs[0] = tensor("IN_F", "FP32", shape)
    raws[0] = np.zeros(shape, np.float32).tobytes()
    msg = refused(request(inputs, raws), BATCHED, MODEL, "'IN_F'", "unexpected shape")
    assert "[-1,3]" in msg  # the expected shape, with the batch dimension


def test_variable_dim_still_checks_rank():
    inputs, raws = good_inputs()
    inputs[1] = tensor("IN_I", "INT32", [2, 10])
    raws[1] = i32(2, 10).tobytes()
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_I'", "[-1,-1,2]")


def test_no_batch_dimension_on_batching_model():
    spec = spec_for("TYPE_FP32", "[ -1 ]", max_batch_size=4)
    # an empty shape: a scalar, where [batch, n] is needed
    req = request([tensor("T", "FP32", [])], [np.float32(1).tobytes()])
    refused(req, spec, MODEL, "'T'", "batch dimension")


def test_negative_dimension():
    inputs, raws = good_inputs()
    inputs[1] = tensor("IN_I", "INT32", [2, -1, 2])
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_I'", "negative")


def test_batch_larger_than_max_batch_size():
    inputs, raws = good_inputs(batch=9)
    msg = refused(request(inputs, raws), BATCHED, MODEL, "batch-size", "8")
    assert "9" in msg


def test_batch_equal_to_max_batch_size_is_accepted():
    inputs, raws = good_inputs(batch=8)
    assert validate_infer(request(inputs, raws), BATCHED).batch_size == 8


def test_batch_zero():
    inputs, raws = good_inputs(batch=0)
    msg = refused(request(inputs, raws), BATCHED, MODEL, "batch-size")
    assert "got 0" in msg


def test_inputs_with_different_batch_sizes():
    inputs = [tensor("IN_F", "FP32", [2, 3]), tensor("IN_I", "INT32", [3, 5, 2])]
    raws = [f32(2, 3).tobytes(), i32(3, 5, 2).tobytes()]
    msg = refused(request(inputs, raws), BATCHED, MODEL, "'IN_I'", "batch size 3")
    assert "2" in msg


def test_raw_byte_size_mismatch():
    inputs, raws = good_inputs()
    raws[0] = raws[0][:-1]
    msg = refused(request(inputs, raws), BATCHED, MODEL, "'IN_F'", "byte size")
    assert "Expected 24, got 23" in msg


def test_raw_byte_size_too_long():
    inputs, raws = good_inputs()
    raws[1] = raws[1] + b"\x00" * 4
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_I'", "Expected 80, got 84")


def test_raw_count_not_input_count():
    inputs, raws = good_inputs()
    msg = refused(request(inputs, raws[:1]), BATCHED, MODEL, "raw input contents")
    assert "expected 2" in msg and "got 1" in msg


def test_more_raw_contents_than_inputs():
    inputs, raws = good_inputs()
    refused(request(inputs, raws + [b""]), BATCHED, MODEL, "expected 2", "got 3")


def test_contents_and_raw_mixed():
    inputs, raws = good_inputs()
    inputs[0].contents.fp32_contents.extend([0.0] * 6)
    refused(request(inputs, raws), BATCHED, MODEL, "'IN_F'", "raw_input_contents")


TRITON_CONTENTS_WITH_RAW = (
    "contents field must not be specified when using raw_input_contents for '{}' for model '{}'"
)


def test_contents_with_raw_is_triton_message():
    """Triton 2.51's exact words (gRPC, tritonclient's grpc_explicit_int_content_client)."""
    inputs, raws = good_inputs()
    inputs[1].contents.int_contents.extend([0] * 10)
    with pytest.raises(StageError) as info:
        validate_infer(request(inputs, raws), BATCHED)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == TRITON_CONTENTS_WITH_RAW.format("IN_I", MODEL)


def test_contents_with_raw_checked_before_raw_count():
    """Triton checks contents-with-raw before the raw count (one raw for two inputs,
    one of them with typed contents: the contents message)."""
    inputs, raws = good_inputs()
    inputs[0].contents.fp32_contents.extend([0.0] * 6)
    with pytest.raises(StageError) as info:
        validate_infer(request(inputs, raws[:1]), BATCHED)
    assert info.value.message == TRITON_CONTENTS_WITH_RAW.format("IN_F", MODEL)


def test_contents_with_raw_checked_before_input_name():
    """An unknown input carrying contents next to raw gets the contents message, as Triton."""
    inputs, raws = good_inputs()
    inputs.append(tensor("NOPE", "FP32", [2, 3], fp32_contents=[0.0] * 6))
    with pytest.raises(StageError) as info:
        validate_infer(request(inputs, raws), BATCHED)
    assert info.value.message == TRITON_CONTENTS_WITH_RAW.format("NOPE", MODEL)


def test_typed_contents_count_mismatch():
    req = request(
        [
            tensor("IN_F", "FP32", [2, 3], fp32_contents=[1.0] * 5),
            tensor("IN_I", "INT32", [2, 1, 2], int_contents=[1, 2, 3, 4]),
        ]
    )
    msg = refused(req, BATCHED, MODEL, "'IN_F'", "fp32_contents has 5")
    assert "needs 6" in msg


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_types_refused_in_typed_contents(datatype):
    spec = spec_for(f"TYPE_{datatype}")
    req = request([tensor("T", datatype, [4], fp32_contents=[1.0] * 4)])
    refused(req, spec, MODEL, "'T'", datatype, "raw_input_contents")


def test_half_types_accepted_raw():
    spec = spec_for("TYPE_FP16")
    raw = np.array([1, 2, 3, 4], np.float16).tobytes()
    v = validate_infer(request([tensor("T", "FP16", [4])], [raw]), spec)
    assert v.inputs[0].raw == raw


@pytest.mark.parametrize(
    "datatype,enum,wrong",
    [
        ("FP32", "TYPE_FP32", "int_contents"),
        ("INT32", "TYPE_INT32", "fp32_contents"),
        ("INT64", "TYPE_INT64", "int_contents"),
        ("UINT8", "TYPE_UINT8", "int_contents"),
        ("BOOL", "TYPE_BOOL", "uint_contents"),
        ("BYTES", "TYPE_STRING", "int64_contents"),
    ],
)
def test_wrong_contents_field_for_datatype(datatype, enum, wrong):
    spec = spec_for(enum)
    values = {"bool_contents": [True] * 4}.get(wrong, [1] * 4)
    req = request([tensor("T", datatype, [4], **{wrong: values})])
    refused(req, spec, MODEL, "'T'", wrong)


def test_wrong_contents_field_alongside_right_one():
    spec = spec_for("TYPE_FP32")
    req = request([tensor("T", "FP32", [4], fp32_contents=[1.0] * 4, fp64_contents=[1.0])])
    refused(req, spec, MODEL, "'T'", "fp64_contents")


def test_no_data_at_all_is_a_count_mismatch():
    spec = spec_for("TYPE_FP32")
    refused(request([tensor("T", "FP32", [4])]), spec, MODEL, "'T'", "needs 4")


@pytest.mark.parametrize(
    "raw,what",
    [
        (frame(b"ab") + b"\x01\x00", "truncated"),
        (b"\x03", "truncated"),
        (frame(b"ab") + struct.pack("<I", 10) + b"abc", "declares 10 bytes"),
        (struct.pack("<I", 2**32 - 1), "declares"),
    ],
    ids=["short-prefix", "one-byte", "beyond-buffer", "huge-length"],
)
def test_malformed_bytes(raw, what):
    spec = spec_for("TYPE_STRING", "[ 2 ]")
    req = request([tensor("T", "BYTES", [2])], [raw])
    refused(req, spec, MODEL, "'T'", "malformed BYTES", what)


@pytest.mark.parametrize("n", [1, 3, 0])
def test_bytes_element_count_mismatch(n):
    spec = spec_for("TYPE_STRING", "[ 2 ]")
    raw = frame(*[b"x"] * n)
    req = request([tensor("T", "BYTES", [2])], [raw])
    msg = refused(req, spec, MODEL, "'T'", f"holds {n} BYTES elements")
    assert "needs 2" in msg


def test_bytes_typed_contents_count_mismatch():
    spec = spec_for("TYPE_STRING", "[ 2 ]")
    req = request([tensor("T", "BYTES", [2], bytes_contents=[b"a"])])
    refused(req, spec, MODEL, "'T'", "bytes_contents has 1")


def test_missing_required_input_lists_it():
    inputs, raws = good_inputs()
    msg = refused(request(inputs[:1], raws[:1]), BATCHED, MODEL, "'IN_I'", "missing")
    assert "IN_S" not in msg.split("missing")[1]  # optional inputs are not required
    assert "expected 2 inputs but got 1" in msg


def test_missing_every_input():
    msg = refused(request([]), BATCHED, MODEL, "'IN_F'", "'IN_I'")
    assert "got 0 inputs" in msg


def test_unknown_requested_output():
    inputs, raws = good_inputs()
    refused(
        request(inputs, raws, outputs=["OUT_A", "NOPE"]),
        BATCHED,
        MODEL,
        "'NOPE'",
        "unexpected inference output",
    )


def test_requested_output_named_like_an_input():
    inputs, raws = good_inputs()
    refused(request(inputs, raws, outputs=["IN_F"]), BATCHED, MODEL, "'IN_F'", "output")


def test_duplicate_requested_output():
    inputs, raws = good_inputs()
    refused(
        request(inputs, raws, outputs=["OUT_B", "OUT_A", "OUT_B"]),
        BATCHED,
        MODEL,
        "'OUT_B'",
        "twice",
    )


@pytest.mark.parametrize("param", ["priority", "timeout"])
@pytest.mark.parametrize(
    "which,value",
    [("string_param", "3"), ("bool_param", True), ("double_param", 1.5)],
)
def test_int_param_of_wrong_type(param, which, value):
    inputs, raws = good_inputs()
    msg = refused(
        request(inputs, raws, **{param: (which, value)}), BATCHED, MODEL, f"'{param}'", which
    )
    assert "integer" in msg


@pytest.mark.parametrize("param", ["priority", "timeout"])
def test_int_param_negative(param):
    inputs, raws = good_inputs()
    msg = refused(
        request(inputs, raws, **{param: ("int64_param", -5)}), BATCHED, MODEL, f"'{param}'"
    )
    assert "negative" in msg and "-5" in msg


@pytest.mark.parametrize("which,value", [("bool_param", True), ("double_param", 2.0)])
def test_sequence_id_of_wrong_type(which, value):
    inputs, raws = good_inputs()
    refused(
        request(inputs, raws, sequence_id=(which, value)), BATCHED, MODEL, "'sequence_id'", which
    )


@pytest.mark.parametrize("flag", ["sequence_start", "sequence_end"])
@pytest.mark.parametrize(
    "which,value", [("int64_param", 1), ("string_param", "true"), ("uint64_param", 1)]
)
def test_sequence_flags_must_be_bool(flag, which, value):
    inputs, raws = good_inputs()
    refused(request(inputs, raws, **{flag: (which, value)}), BATCHED, MODEL, f"'{flag}'", which)


# ====================================================================== success


def test_raw_success():
    inputs, raws = good_inputs(batch=3, n=4)
    v = validate_infer(request(inputs, raws), BATCHED)
    assert isinstance(v, ValidatedRequest)
    assert v.batch_size == 3
    assert [t.name for t in v.inputs] == ["IN_F", "IN_I"]
    assert [t.datatype for t in v.inputs] == ["FP32", "INT32"]
    assert [list(t.shape) for t in v.inputs] == [[3, 3], [3, 4, 2]]
    assert [t.raw for t in v.inputs] == raws
    assert v.outputs == []
    assert v.priority == 0 and v.timeout_us == 0


def test_optional_input_given():
    inputs, raws = good_inputs(batch=1)
    inputs.append(tensor("IN_S", "BYTES", [1, 2]))
    raws.append(frame(b"hello", b""))
    v = validate_infer(request(inputs, raws), BATCHED)
    assert [t.name for t in v.inputs] == ["IN_F", "IN_I", "IN_S"]
    assert v.inputs[2].raw == frame(b"hello", b"")


def test_inputs_in_any_order():
    inputs, raws = good_inputs()
    v = validate_infer(request(inputs[::-1], raws[::-1]), BATCHED)
    assert [t.name for t in v.inputs] == ["IN_I", "IN_F"]
    assert v.inputs[0].raw == raws[1]


def test_zero_sized_variable_dimension():
    inputs = [tensor("IN_F", "FP32", [1, 3]), tensor("IN_I", "INT32", [1, 0, 2])]
    v = validate_infer(request(inputs, [f32(1, 3).tobytes(), b""]), BATCHED)
    assert list(v.inputs[1].shape) == [1, 0, 2] and v.inputs[1].raw == b""


TYPED_CASES = {
    "BOOL": [True, False, True, True],
    "INT8": [-128, 0, 5, 127],
    "INT16": [-32768, 1, -2, 32767],
    "INT32": [-(2**31), 0, 1, 2**31 - 1],
    "INT64": [-(2**63), 0, 2**53 + 1, 2**63 - 1],
    "UINT8": [0, 1, 200, 255],
    "UINT16": [0, 65535, 3, 4],
    "UINT32": [0, 2**32 - 1, 5, 6],
    "UINT64": [0, 2**64 - 1, 2**63 + 1, 1],
    "FP32": [1.5, -2.25, 0.0, 3.0e38],
    "FP64": [0.1, -1e300, 2.5, 2**53 + 1.0],
}
NUMPY = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "FP64": np.float64,
}


def test_typed_cases_cover_every_contents_datatype():
    assert set(TYPED_CASES) | {"BYTES"} == set(CONTENTS_FIELD)


@pytest.mark.parametrize("datatype", sorted(TYPED_CASES))
def test_typed_contents_become_raw_bytes(datatype):
    values = TYPED_CASES[datatype]
    spec = spec_for(f"TYPE_{datatype}")
    req = request([tensor("T", datatype, [4], **{CONTENTS_FIELD[datatype]: values})])
    v = validate_infer(req, spec)
    (t,) = v.inputs
    assert t.datatype == datatype and list(t.shape) == [4]
    expected = np.array(values, dtype=NUMPY[datatype]).tobytes()
    assert t.raw == expected
    assert (
        np.frombuffer(t.raw, NUMPY[datatype]).tolist()
        == np.array(values, dtype=NUMPY[datatype]).tolist()
    )


@pytest.mark.parametrize("datatype", sorted(TYPED_CASES))
def test_typed_contents_with_batch_dimension(datatype):
    values = TYPED_CASES[datatype] * 2
    spec = spec_for(f"TYPE_{datatype}", "[ 4 ]", max_batch_size=2)
    req = request([tensor("T", datatype, [2, 4], **{CONTENTS_FIELD[datatype]: values})])
    v = validate_infer(req, spec)
    assert v.batch_size == 2
    assert v.inputs[0].raw == np.array(values, dtype=NUMPY[datatype]).tobytes()


def test_bytes_contents_framing():
    spec = spec_for("TYPE_STRING", "[ 3 ]")
    items = [b"abc", b"", b"\x00\xff\x10"]
    v = validate_infer(request([tensor("T", "BYTES", [3], bytes_contents=items)]), spec)
    assert v.inputs[0].raw == (
        b"\x03\x00\x00\x00abc" + b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00\x00\xff\x10"
    )


def test_bytes_raw_success():
    spec = spec_for("TYPE_STRING", "[ 2 ]", max_batch_size=4)
    raw = frame(b"a", b"bb", b"ccc", b"")
    v = validate_infer(request([tensor("T", "BYTES", [2, 2])], [raw]), spec)
    assert v.inputs[0].raw == raw and v.batch_size == 2


def test_requested_outputs_order_kept():
    inputs, raws = good_inputs()
    v = validate_infer(request(inputs, raws, outputs=["OUT_C", "OUT_A"]), BATCHED)
    assert v.outputs == ["OUT_C", "OUT_A"]


def test_model_without_batching():
    spec = spec_for("TYPE_FP32", "[ 2, 3 ]", max_batch_size=0)
    assert not spec.batching
    v = validate_infer(request([tensor("T", "FP32", [2, 3])], [f32(2, 3).tobytes()]), spec)
    assert v.batch_size == 0
    assert list(v.inputs[0].shape) == [2, 3]
    # a leading batch dimension is a shape error there
    msg = refused(
        request([tensor("T", "FP32", [1, 2, 3])], [f32(1, 2, 3).tobytes()]), spec, MODEL, "'T'"
    )
    assert "Expected [2,3]" in msg


def test_model_without_batching_first_dim_not_limited_by_max_batch_size():
    spec = spec_for("TYPE_FP32", "[ -1 ]", max_batch_size=0)
    v = validate_infer(request([tensor("T", "FP32", [100])], [f32(100).tobytes()]), spec)
    assert v.batch_size == 0 and list(v.inputs[0].shape) == [100]


def test_reshape_applied_to_forwarded_shape():
    spec = spec_for("TYPE_FP32", "[ 4 ]", max_batch_size=4, extra="reshape: { shape: [ 2, 2 ] }")
    raw = f32(3, 4).tobytes()
    v = validate_infer(request([tensor("T", "FP32", [3, 4])], [raw]), spec)
    assert list(v.inputs[0].shape) == [3, 2, 2]
    assert v.inputs[0].raw == raw


def test_reshape_with_variable_dimension():
    spec = spec_for("TYPE_FP32", "[ -1 ]", max_batch_size=4, extra="reshape: { shape: [ -1, 2 ] }")
    v = validate_infer(request([tensor("T", "FP32", [2, 6])], [f32(2, 6).tobytes()]), spec)
    assert list(v.inputs[0].shape) == [2, 3, 2]


def test_reshape_without_batching():
    spec = spec_for("TYPE_FP32", "[ 1, 6 ]", extra="reshape: { shape: [ 3, 2 ] }")
    v = validate_infer(request([tensor("T", "FP32", [1, 6])], [f32(1, 6).tobytes()]), spec)
    assert list(v.inputs[0].shape) == [3, 2]


def test_reshape_to_scalar_shape():
    spec = spec_for("TYPE_FP32", "[ 1 ]", max_batch_size=8, extra="reshape: { shape: [ ] }")
    v = validate_infer(request([tensor("T", "FP32", [5, 1])], [f32(5, 1).tobytes()]), spec)
    assert list(v.inputs[0].shape) == [5]


@pytest.mark.parametrize("which,value", [("int64_param", 7), ("uint64_param", 2**40)])
def test_priority_and_timeout_extracted(which, value):
    inputs, raws = good_inputs()
    v = validate_infer(
        request(inputs, raws, priority=(which, value), timeout=(which, value + 1)), BATCHED
    )
    assert v.priority == value
    assert v.timeout_us == value + 1


def test_zero_priority_and_unrelated_params_accepted():
    inputs, raws = good_inputs()
    v = validate_infer(
        request(
            inputs,
            raws,
            priority=("int64_param", 0),
            custom=("string_param", "x"),
            binary_data_output=("bool_param", True),
        ),
        BATCHED,
    )
    assert v.priority == 0 and v.timeout_us == 0


@pytest.mark.parametrize(
    "which,value", [("int64_param", 42), ("uint64_param", 2**63), ("string_param", "corr-1")]
)
def test_sequence_params_accepted(which, value):
    inputs, raws = good_inputs()
    v = validate_infer(
        request(
            inputs,
            raws,
            sequence_id=(which, value),
            sequence_start=("bool_param", True),
            sequence_end=("bool_param", False),
        ),
        BATCHED,
    )
    assert v.batch_size == 2
