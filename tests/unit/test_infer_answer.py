"""services/gateway/infer_answer.py: an answer's parts are the whole message's bytes."""

from __future__ import annotations

import os

import pytest

from services.gateway.infer_answer import PARTS_FROM, InferAnswer
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.h2grpc.wire import MessageParts


def _answer(raws: list[bytes]) -> InferAnswer:
    response = gs.ModelInferResponse(model_name="m", model_version="3", id="req-7")
    response.parameters["sequence_id"].int64_param = 42
    response.parameters["note"].string_param = "x"
    for i, raw in enumerate(raws):
        response.outputs.add(name=f"OUT{i}", datatype="FP32", shape=[1, len(raw) // 4])
    return InferAnswer(response, raws)


@pytest.mark.parametrize(
    "raws",
    [
        [],
        [b""],
        [bytes(range(16))],
        [os.urandom(127), os.urandom(128), b"", os.urandom(49152)],
        [os.urandom(49152), os.urandom(300)],
        [os.urandom(3 << 20)],
    ],
    ids=["no-output", "empty", "small", "mixed", "large-first", "3-mib"],
)
def test_the_parts_joined_are_the_whole_messages_bytes(raws: list[bytes]) -> None:
    parts = _answer(raws).parts()
    large = sum(map(len, raws)) >= PARTS_FROM  # a small answer is one bytes
    assert isinstance(parts, MessageParts if large else bytes)
    joined = b"".join(parts) if isinstance(parts, MessageParts) else parts
    if isinstance(parts, MessageParts):
        assert parts.byte_size() == len(joined)
    whole = _answer(raws).message()
    assert list(whole.raw_output_contents) == raws
    assert joined == whole.SerializeToString()
    assert gs.ModelInferResponse.FromString(joined) == whole


def test_the_raw_outputs_go_out_as_the_same_objects() -> None:
    """A large output is not copied into the parts (the frames slice it)."""
    raw = os.urandom(49152)
    parts = _answer([raw]).parts()
    assert any(part is raw for part in parts)
