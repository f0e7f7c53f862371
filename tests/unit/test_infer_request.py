"""services/gateway/infer_request.py: a request split from its raw inputs
parses to what protobuf parses the whole message to."""

from __future__ import annotations

import os

import pytest
from google.protobuf.message import DecodeError

from services.gateway.infer_request import SPLIT_FROM, InferCall, parse_infer_request
from stageserve.generated import grpc_service_pb2 as gs

#: An input that makes a message large enough to be split.
BIG = os.urandom(SPLIT_FROM)


def _request(raws: list[bytes]) -> gs.ModelInferRequest:
    request = gs.ModelInferRequest(model_name="m", model_version="2", id="req-1")
    request.parameters["sequence_id"].int64_param = 9
    for i, raw in enumerate(raws):
        request.inputs.add(name=f"IN{i}", datatype="UINT8", shape=[len(raw)])
    request.outputs.add(name="OUT0")
    request.raw_input_contents.extend(raws)
    return request


def _split(data: bytes) -> InferCall:
    call = parse_infer_request(data)
    assert isinstance(call, InferCall)
    assert not call.request.raw_input_contents
    return call


def _joined(call: InferCall) -> gs.ModelInferRequest:
    """The call as one message again."""
    whole = gs.ModelInferRequest()
    whole.CopyFrom(call.request)
    whole.raw_input_contents.extend(bytes(raw) for raw in call.raws)
    return whole


@pytest.mark.parametrize(
    "raws",
    [[BIG], [b"", BIG], [os.urandom(127), os.urandom(128), BIG], [bytes(3 << 20)]],
    ids=["one", "empty-first", "three", "3-mib"],
)
def test_a_split_request_is_the_whole_message(raws: list[bytes]) -> None:
    data = _request(raws).SerializeToString()
    call = _split(data)
    assert [bytes(raw) for raw in call.raws] == raws
    assert all(raw.obj is data for raw in call.raws)  # views of the message, not copies
    assert _joined(call) == gs.ModelInferRequest.FromString(data)


def test_fields_after_and_between_the_raw_inputs_are_kept_in_order() -> None:
    """Fields in any order (a client may write them so): a raw input between
    two inputs, the model name written twice (the last one wins)."""
    first = gs.ModelInferRequest(model_name="old", raw_input_contents=[BIG])
    first.inputs.add(name="A", datatype="UINT8", shape=[len(BIG)])
    second = gs.ModelInferRequest(model_name="new", raw_input_contents=[b"bc"])
    second.inputs.add(name="B", datatype="UINT8", shape=[2])
    data = first.SerializeToString() + second.SerializeToString()
    call = _split(data)
    assert call.request.model_name == "new"
    assert [i.name for i in call.request.inputs] == ["A", "B"]
    assert [bytes(r) for r in call.raws] == [BIG, b"bc"]
    assert _joined(call) == gs.ModelInferRequest.FromString(data)


def test_a_small_message_or_one_without_raw_inputs_is_parsed_whole() -> None:
    small = _request([b"\x01\x02"])
    assert parse_infer_request(small.SerializeToString()) == small
    typed = gs.ModelInferRequest(model_name="m")
    typed.inputs.add(name="A", datatype="INT32", shape=[1]).contents.int_contents.extend(
        range(SPLIT_FROM)
    )
    data = typed.SerializeToString()
    assert len(data) >= SPLIT_FROM
    assert parse_infer_request(data) == typed


@pytest.mark.parametrize(
    "extra",
    [bytes([15 << 3 | 0, 1]), bytes([0xA2, 0x01, 0])],
    ids=["varint-field", "two-byte-tag"],
)
def test_an_unexpected_field_makes_it_parse_whole(extra: bytes) -> None:
    """A field of another wire type, or a tag of two bytes (field 20): the
    message is parsed whole and keeps its raw inputs."""
    data = _request([BIG]).SerializeToString() + extra
    parsed = parse_infer_request(data)
    assert isinstance(parsed, gs.ModelInferRequest)
    assert list(parsed.raw_input_contents) == [BIG]


@pytest.mark.parametrize("cut", [1, 7, 20, len(BIG) + 3])
def test_a_truncated_message_fails_as_protobuf_fails_it(cut: int) -> None:
    data = (_request([BIG]).SerializeToString() + _request([b"abc"]).SerializeToString())[:-cut]
    with pytest.raises(DecodeError):
        gs.ModelInferRequest.FromString(data)
    with pytest.raises(DecodeError):
        parse_infer_request(data)
