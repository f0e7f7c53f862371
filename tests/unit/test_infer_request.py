"""services/gateway/infer_request.py: a request split from its raw inputs
parses to what protobuf parses the whole message to."""

from __future__ import annotations

import os

import pytest
from google.protobuf.message import DecodeError

from services.gateway.infer_request import InferCall, parse_infer_request
from stageserve.generated import grpc_service_pb2 as gs


def _request(raws: list[bytes]) -> gs.ModelInferRequest:
    request = gs.ModelInferRequest(model_name="m", model_version="2", id="req-1")
    request.parameters["sequence_id"].int64_param = 9
    for i, raw in enumerate(raws):
        request.inputs.add(name=f"IN{i}", datatype="UINT8", shape=[len(raw)])
    request.outputs.add(name="OUT0")
    request.raw_input_contents.extend(raws)
    return request


def _joined(call: InferCall) -> gs.ModelInferRequest:
    """The call as one message again."""
    whole = gs.ModelInferRequest()
    whole.CopyFrom(call.request)
    if call.raws is not None:
        assert not call.request.raw_input_contents
        whole.raw_input_contents.extend(bytes(raw) for raw in call.raws)
    return whole


@pytest.mark.parametrize(
    "raws",
    [[b"\x01\x02"], [b""], [os.urandom(127), os.urandom(128), os.urandom(49152)], [bytes(3 << 20)]],
    ids=["small", "empty", "three", "3-mib"],
)
def test_a_split_request_is_the_whole_message(raws: list[bytes]) -> None:
    data = _request(raws).SerializeToString()
    call = parse_infer_request(data)
    assert call.raws is not None and [bytes(raw) for raw in call.raws] == raws
    assert all(raw.obj is data for raw in call.raws)  # views of the message, not copies
    assert _joined(call) == gs.ModelInferRequest.FromString(data)


def test_fields_after_and_between_the_raw_inputs_are_kept_in_order() -> None:
    """Fields in any order (a client may write them so): a raw input between
    two inputs, the model name written twice (the last one wins)."""
    first = gs.ModelInferRequest(model_name="old", raw_input_contents=[b"a"])
    first.inputs.add(name="A", datatype="UINT8", shape=[1])
    second = gs.ModelInferRequest(model_name="new", raw_input_contents=[b"bc"])
    second.inputs.add(name="B", datatype="UINT8", shape=[2])
    data = first.SerializeToString() + second.SerializeToString()
    call = parse_infer_request(data)
    assert call.request.model_name == "new"
    assert [i.name for i in call.request.inputs] == ["A", "B"]
    assert call.raws is not None and [bytes(r) for r in call.raws] == [b"a", b"bc"]
    assert _joined(call) == gs.ModelInferRequest.FromString(data)


def test_without_raw_inputs_or_with_another_wire_type_the_message_is_parsed_whole() -> None:
    plain = gs.ModelInferRequest(model_name="m")
    plain.inputs.add(name="A", datatype="INT32", shape=[1]).contents.int_contents.append(5)
    call = parse_infer_request(plain.SerializeToString())
    assert call.raws is None and call.request == plain
    # an unknown varint field (field 15, wire type 0) beside a raw input
    odd = _request([b"xy"]).SerializeToString() + bytes([15 << 3 | 0, 1])
    call = parse_infer_request(odd)
    assert call.raws is None
    assert list(call.request.raw_input_contents) == [b"xy"]


@pytest.mark.parametrize("cut", [1, 7, 20])
def test_a_truncated_message_fails_as_protobuf_fails_it(cut: int) -> None:
    data = _request([os.urandom(40)]).SerializeToString()[:-cut]
    with pytest.raises(DecodeError):
        gs.ModelInferRequest.FromString(data)
    with pytest.raises(DecodeError):
        parse_infer_request(data)
