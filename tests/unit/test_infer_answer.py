"""services/gateway/infer_answer.py: an answer's parts are the whole message's bytes."""

from __future__ import annotations

import os

import pytest

from services.gateway.infer_answer import PARTS_FROM, InferAnswer, serialize, whole
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.h2grpc.wire import MessageParts


def _response(raws: list[bytes]) -> gs.ModelInferResponse:
    response = gs.ModelInferResponse(model_name="m", model_version="3", id="req-7")
    response.parameters["sequence_id"].int64_param = 42
    response.parameters["note"].string_param = "x"
    for i, raw in enumerate(raws):
        response.outputs.add(name=f"OUT{i}", datatype="FP32", shape=[1, len(raw) // 4])
    return response


def _answer(raws: list[bytes]) -> gs.ModelInferResponse | InferAnswer:
    """As the dataplane builds it: the outputs before the first large one in
    the message, that one and the rest apart."""
    response = _response(raws)
    first = next((i for i, raw in enumerate(raws) if len(raw) >= PARTS_FROM), None)
    if first is None:
        response.raw_output_contents.extend(raws)
        return response
    response.raw_output_contents.extend(raws[:first])
    return InferAnswer(response, raws[first:])


@pytest.mark.parametrize(
    "raws",
    [
        [],
        [b""],
        [bytes(range(16))],
        [os.urandom(127), os.urandom(128), b"", os.urandom(49152)],
        [os.urandom(49152), os.urandom(300)],
        [os.urandom(300), os.urandom(49152)],
        [os.urandom(3 << 20)],
    ],
    ids=["no-output", "empty", "small", "mixed", "large-first", "small-first", "3-mib"],
)
def test_the_serialized_answer_is_the_whole_messages_bytes(raws: list[bytes]) -> None:
    large = any(len(raw) >= PARTS_FROM for raw in raws)
    answer = _answer(raws)
    # a small answer is the message itself, a large one its parts
    assert isinstance(answer, InferAnswer if large else gs.ModelInferResponse)
    wire = serialize(answer)
    assert isinstance(wire, MessageParts if large else bytes)
    joined = b"".join(wire) if isinstance(wire, MessageParts) else wire
    if isinstance(wire, MessageParts):
        assert wire.byte_size() == len(joined)
    if isinstance(answer, InferAnswer):
        assert answer.all_raws() == raws  # what the HTTP front encodes
    message = whole(_answer(raws))
    assert list(message.raw_output_contents) == raws
    assert joined == message.SerializeToString()
    assert gs.ModelInferResponse.FromString(joined) == message


def test_the_raw_outputs_go_out_as_the_same_objects() -> None:
    """A large output is not copied into the parts (the frames slice it)."""
    raw = os.urandom(49152)
    wire = serialize(_answer([raw]))
    assert any(part is raw for part in wire)
