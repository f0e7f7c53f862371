"""The HTTP front's pure codec: KServe v2 JSON / binary bodies <-> inference.* messages."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from services.gateway.http import codec
from stageserve.errors import StageError, http_status, reason_of
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc
from stageserve.tensors import split_bytes_elements


def _body(doc: dict, *blobs: bytes) -> tuple[bytes, int]:
    head = json.dumps(doc).encode()
    return head + b"".join(blobs), len(head)


def test_json_and_binary_inputs_become_raw_contents_in_order() -> None:
    a = np.arange(4, dtype=np.float32)
    body, n = _body(
        {
            "id": "x",
            "parameters": {"priority": 2, "binary_data_output": True, "sequence_start": True},
            "inputs": [
                {"name": "A", "shape": [4], "datatype": "FP32", "data": [0, 1, 2, 3]},
                {
                    "name": "B",
                    "shape": [2, 2],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                },
                {"name": "S", "shape": [2], "datatype": "BYTES", "data": ["hi", ""]},
            ],
            "outputs": [{"name": "O", "parameters": {"binary_data": False, "classification": 0}}],
        },
        a.tobytes(),
    )
    parsed = codec.parse_infer(body, n, "m", "3")
    r = parsed.request
    assert (r.model_name, r.model_version, r.id) == ("m", "3", "x")
    assert r.parameters["priority"].int64_param == 2
    assert r.parameters["sequence_start"].bool_param is True
    assert "binary_data_output" not in r.parameters  # HTTP-only, never reaches the dataplane
    assert [t.name for t in r.inputs] == ["A", "B", "S"]
    assert list(r.inputs[1].shape) == [2, 2] and "binary_data_size" not in r.inputs[1].parameters
    assert not r.raw_input_contents  # the bytes travel beside the message
    assert parsed.raw[0] == a.tobytes() == parsed.raw[1]
    assert split_bytes_elements(parsed.raw[2]) == [b"hi", b""]
    assert parsed.binary_default and not parsed.wants_binary("O") and parsed.wants_binary("P")
    assert "binary_data" not in r.outputs[0].parameters
    assert r.outputs[0].parameters["classification"].int64_param == 0


def test_nested_json_data_is_row_major_and_typed() -> None:
    raw = codec.json_to_raw([[1, 2], [3, 2**64 - 1]], "X", "UINT64", [2, 2], "m")
    assert np.frombuffer(raw, dtype="<u8").tolist() == [1, 2, 3, 2**64 - 1]
    raw = codec.json_to_raw([True, False], "X", "BOOL", [2], "m")
    assert raw == b"\x01\x00"


@pytest.mark.parametrize(
    ("data", "datatype", "shape", "message"),
    [
        ([1, 2, 3], "INT32", [2], "needs 2 elements, 'data' has 3"),
        ([1.5, 2], "INT32", [2], "must be integers"),
        (["a", 1], "BYTES", [2], "must be JSON strings"),
        ([1, 0], "BOOL", [2], "true or false"),
        ([1.0, 2.0], "FP16", [2], "not supported in JSON"),
        ([300], "UINT8", [1], "m"),
        ([1, "x"], "FP32", [2], "must be JSON numbers"),
    ],
)
def test_bad_json_data_is_tritons_500(data, datatype, shape, message) -> None:
    with pytest.raises(StageError) as err:
        codec.json_to_raw(data, "X", datatype, shape, "m")
    assert err.value.code.name == "INTERNAL" and message in err.value.message
    assert err.value.message.startswith("Unable to parse 'data' of input 'X'")


@pytest.mark.parametrize(
    ("body", "length", "message"),
    [
        (b"[1]", None, "must be an object"),
        (b"{", None, "failed to parse"),
        (b'{"inputs": []}', 99, "outside the body"),
        (b'{"inputs": []}abc', 14, "no input claims"),
        (
            b'{"inputs": [{"name": "A", "shape": [1], "datatype": "INT8",'
            b' "parameters": {"binary_data_size": 4}}]}ab',
            100,
            "goes past",
        ),
        (b'{"inputs": [{"name": "A", "shape": [1], "datatype": "INT8"}]}', None, "no 'data'"),
        (b'{"inputs": [{"name": "A", "shape": "1", "datatype": "INT8"}]}', None, "integer 'shape'"),
        (b'{"inputs": [], "outputs": [{}]}', None, "needs a 'name'"),
        (b'{"inputs": [], "parameters": {"p": [1]}}', None, "bool, number or string"),
    ],
)
def test_malformed_bodies(body: bytes, length: int | None, message: str) -> None:
    with pytest.raises(StageError) as err:
        codec.parse_infer(body, length, "m", "")
    assert message in err.value.message


def test_binary_input_with_only_the_header_length() -> None:
    body, n = _body(
        {"inputs": [{"name": "A", "shape": [2], "datatype": "INT8"}]},
    )
    with pytest.raises(StageError, match="no 'data' and no binary data"):
        codec.parse_infer(body, n, "m", "")


def test_encode_mixes_json_binary_and_shared_memory_outputs() -> None:
    request = gs.ModelInferRequest()
    request.outputs.add(name="J").parameters["binary_data"].bool_param = False
    shm = request.outputs.add(name="S")
    shm.parameters["shared_memory_region"].string_param = "r"
    shm.parameters["shared_memory_byte_size"].int64_param = 8
    parsed = codec.ParsedInfer(request, True, {"J": False})
    response = gs.ModelInferResponse(model_name="m", model_version="1", id="q")
    ints = np.array([1, -2], dtype=np.int32).tobytes()
    strings = b"\x02\x00\x00\x00hi"
    for name, dt in (("J", "INT32"), ("S", "INT32"), ("B", "BYTES")):
        response.outputs.add(name=name, datatype=dt, shape=[2] if dt == "INT32" else [1])
    response.raw_output_contents.extend([ints, b"", strings])
    body, n = codec.encode_infer(response, parsed)
    doc = json.loads(body[:n])
    assert doc["id"] == "q" and doc["model_version"] == "1"
    j, s, b = doc["outputs"]
    assert j["data"] == [1, -2]
    assert s["parameters"] == {"shared_memory_region": "r", "shared_memory_byte_size": 8}
    assert b["parameters"] == {"binary_data_size": len(strings)} and body[n:] == strings
    # the outputs' bytes given apart (an InferAnswer's): the same body
    bare = gs.ModelInferResponse(model_name="m", model_version="1", id="q")
    bare.outputs.extend(response.outputs)
    assert codec.encode_infer(bare, parsed, [ints, b"", strings]) == (body, n)


def test_json_only_response_has_no_header_length() -> None:
    request = gs.ModelInferRequest()
    response = gs.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="B", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(b"\x03\x00\x00\x00abc")
    body, n = codec.encode_infer(response, codec.ParsedInfer(request, False))
    assert n is None and json.loads(body)["outputs"][0]["data"] == ["abc"]


def test_bf16_output_in_json_is_its_float_value() -> None:
    words = (np.array([1.5, -2.0], dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    assert codec.raw_to_json(words.tobytes(), "BF16") == [1.5, -2.0]


def test_proto_json_prints_64_bit_integers_as_numbers() -> None:
    config = mc.ModelConfig(name="m", max_batch_size=8)
    config.input.add(name="I", data_type=mc.TYPE_FP32, dims=[-1, 16])
    doc = codec.proto_json(config)
    assert doc["input"][0]["dims"] == [-1, 16] and doc["max_batch_size"] == 8
    stats = gs.ModelStatisticsResponse()
    stats.model_stats.add(name="m", version="1", inference_count=2**40)
    assert codec.proto_json(stats)["model_stats"][0]["inference_count"] == 2**40


def test_load_request_decodes_files_and_keeps_config() -> None:
    body = json.dumps(
        {
            "parameters": {
                "config": "{}",
                "file:1/model.onnx": base64.b64encode(b"\x00\x01").decode(),
            }
        }
    ).encode()
    r = codec.load_request("m", body)
    assert r.model_name == "m" and r.parameters["config"].string_param == "{}"
    assert r.parameters["file:1/model.onnx"].bytes_param == b"\x00\x01"
    with pytest.raises(StageError, match="not valid base64"):
        codec.load_request("m", b'{"parameters": {"file:x": "!!"}}')
    assert not codec.load_request("m", b"").parameters


def test_generate_fills_dims_with_batch_one() -> None:
    from stageserve.config import parse_config_text, to_spec

    spec = to_spec(
        parse_config_text(
            'name: "g" platform: "onnxruntime_onnx" max_batch_size: 4 '
            'input [ { name: "A" data_type: TYPE_FP32 dims: [ 2, -1 ] },'
            ' { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]'
            ' output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]'
        )
    )
    r = codec.parse_generate(b'{"A": [1, 2, 3, 4], "S": "hi", "x": [1]}', spec, "")
    assert [list(t.shape) for t in r.inputs] == [[1, 2, 2], [1, 1]]
    assert split_bytes_elements(r.raw_input_contents[1]) == [b"hi"]
    with pytest.raises(StageError, match="can not convert input 'A'"):
        codec.parse_generate(b'{"A": [1, 2, 3]}', spec, "")
    with pytest.raises(StageError, match="can not convert input 'A'"):
        codec.parse_generate(b'{"A": [[1, 2], [3, 4]]}', spec, "")
    response = gs.ModelInferResponse(model_name="g", model_version="1")
    response.outputs.add(name="O", datatype="FP32", shape=[1, 1])
    response.raw_output_contents.append(np.float32(2.5).tobytes())
    assert codec.encode_generate(response) == {"O": 2.5, "model_name": "g", "model_version": "1"}


def test_status_codes_follow_tritons_http_mapping() -> None:
    import grpc

    assert http_status(reason_of(grpc.StatusCode.INVALID_ARGUMENT)) == 400
    assert http_status(reason_of(grpc.StatusCode.NOT_FOUND)) == 404
    assert http_status(reason_of(grpc.StatusCode.UNAVAILABLE)) == 503
    assert http_status(reason_of(grpc.StatusCode.INTERNAL)) == 500
    assert http_status(reason_of(grpc.StatusCode.UNIMPLEMENTED)) == 400
