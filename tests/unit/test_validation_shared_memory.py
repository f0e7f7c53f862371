"""stageserve/validation.py with inputs and outputs in shared memory:
parameter parsing, raw_input_contents alignment, Triton's refusals."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from stageserve.config import parse_config_text, to_spec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.validation import SharedRef, validate_infer

SPEC = to_spec(
    parse_config_text(
        """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "B" data_type: TYPE_INT32 dims: [ 2 ] }
]
output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""
    )
)
A = np.array([[1.5, 2.5]], np.float32).tobytes()
B = np.array([[7, 8]], np.int32).tobytes()


def _request(shared_a: dict | None = None) -> gs.ModelInferRequest:
    r = gs.ModelInferRequest(model_name="m")
    a = r.inputs.add(name="A", datatype="FP32", shape=[1, 2])
    r.inputs.add(name="B", datatype="INT32", shape=[1, 2])
    for key, value in (shared_a or {}).items():
        if isinstance(value, str):
            a.parameters[key].string_param = value
        else:
            a.parameters[key].int64_param = value
    return r


def _in_region(**extra) -> dict:
    return {"shared_memory_region": "in", "shared_memory_byte_size": 8, **extra}


def test_an_input_in_shared_memory_is_read_and_raw_contents_belong_to_the_others() -> None:
    seen: list[SharedRef] = []

    def read(ref: SharedRef) -> bytes:
        seen.append(ref)
        return A

    r = _request(_in_region(shared_memory_offset=64))
    r.raw_input_contents.append(B)  # the only raw entry is B's, as Triton counts them
    v = validate_infer(r, SPEC, read)
    assert seen == [SharedRef("in", 64, 8)]
    assert [t.raw for t in v.inputs] == [A, B]


def test_raw_contents_for_every_input_are_refused_when_one_is_in_shared_memory() -> None:
    r = _request(_in_region())
    r.raw_input_contents.extend([A, B])
    with pytest.raises(StageError, match="expected 1 raw input contents"):
        validate_infer(r, SPEC, lambda ref: A)


def test_wrong_byte_size_from_the_region_is_refused_like_raw() -> None:
    r = _request(_in_region())
    r.raw_input_contents.append(B)
    with pytest.raises(StageError, match="input byte size mismatch for input 'A'"):
        validate_infer(r, SPEC, lambda ref: A + b"\x00")


def test_contents_together_with_shared_memory_are_refused() -> None:
    r = _request(_in_region())
    r.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    r.inputs[1].contents.int_contents.extend([7, 8])
    with pytest.raises(StageError, match="unexpected 'content' provided when using shared memory"):
        validate_infer(r, SPEC, lambda ref: A)


@pytest.mark.parametrize(
    "params, words",
    [
        ({"shared_memory_region": "in"}, "'shared_memory_byte_size' must be given"),
        ({"shared_memory_region": 3, "shared_memory_byte_size": 8}, "expected string"),
        (
            {"shared_memory_region": "in", "shared_memory_byte_size": "8"},
            "'shared_memory_byte_size' of input 'A'",
        ),
        (_in_region(shared_memory_offset=-1), "must not be negative"),
    ],
)
def test_malformed_shared_memory_parameters_are_invalid(params: dict, words: str) -> None:
    r = _request(params)
    r.raw_input_contents.append(B)
    with pytest.raises(StageError, match=words) as exc:
        validate_infer(r, SPEC, lambda ref: A)
    assert exc.value.code.name == "INVALID_ARGUMENT"


def test_region_errors_from_the_reader_reach_the_client_unchanged() -> None:
    def missing(ref: SharedRef) -> bytes:
        raise StageError(
            grpc.StatusCode.NOT_FOUND, f"Unable to find shared memory region: '{ref.region}'"
        )

    r = _request(_in_region())
    r.raw_input_contents.append(B)
    with pytest.raises(StageError, match="Unable to find shared memory region: 'in'") as exc:
        validate_infer(r, SPEC, missing)
    assert exc.value.code.name == "NOT_FOUND"


def test_requested_outputs_in_shared_memory_are_returned_by_name() -> None:
    r = _request()
    r.raw_input_contents.extend([A, B])
    out = r.outputs.add(name="O")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = 8
    out.parameters["shared_memory_offset"].uint64_param = 16
    v = validate_infer(r, SPEC)
    assert v.outputs == ["O"] and v.shared_outputs == {"O": SharedRef("out", 16, 8)}


def test_without_a_reader_shared_memory_inputs_are_refused() -> None:
    r = _request(_in_region())
    r.raw_input_contents.append(B)
    with pytest.raises(StageError, match="cannot be read here"):
        validate_infer(r, SPEC)
