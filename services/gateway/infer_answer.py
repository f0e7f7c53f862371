"""A ModelInfer answer with its raw outputs apart from the protobuf message.

Each bytes field protobuf holds is a copy: an output appended to
`raw_output_contents` is copied into the message, and serializing copies
it again. The own HTTP/2 front writes an answer with a large output as
`parts()`: the message with the outputs before it, serialized, then each
output's field header and its bytes as they are; the frames slice those
bytes and the socket takes them with one writev
(stageserve/h2grpc/connection.py). For a 49 KB output that is two copies
less per answer (in-process, 7.4 -> 3.3 us for building and serializing
the answer).

`raw_output_contents` (field 6) is ModelInferResponse's last field, so the
parts joined are the bytes SerializeToString gives for the whole message.
"""

from __future__ import annotations

from dataclasses import dataclass

from stageserve.generated import grpc_service_pb2 as gs
from stageserve.h2grpc.wire import MessageParts

#: raw_output_contents' tag: field 6, length-delimited.
RAW_OUTPUT_TAG = bytes([6 << 3 | 2])
#: A raw output of at least this many bytes, and those after it, go out as parts.
PARTS_FROM = 16 * 1024


@dataclass(slots=True)
class InferAnswer:
    """`response` with the raw outputs before the first large one (of
    PARTS_FROM bytes or more) in its raw_output_contents; `raws` that one
    and those after it, in order."""

    response: gs.ModelInferResponse
    raws: list[bytes]

    def message(self) -> gs.ModelInferResponse:
        """The whole message (the raw outputs copied into it)."""
        self.response.raw_output_contents.extend(self.raws)
        return self.response

    def all_raws(self) -> list[bytes]:
        """Every raw output, in order: those in the message, then `raws`."""
        return [*self.response.raw_output_contents, *self.raws]

    def parts(self) -> MessageParts:
        """The whole message's serialized bytes, as pieces."""
        pieces: list[bytes] = [self.response.SerializeToString()]
        for raw in self.raws:
            pieces += (RAW_OUTPUT_TAG + _varint(len(raw)), raw)
        return MessageParts(pieces)


#: What the dataplane answers: the message itself, its raw outputs in it,
#: when every one is small (under PARTS_FROM bytes: for a 64-byte output
#: the pieces cost 2 us more than the copies they save, and an object per
#: answer 0.5 us more); an InferAnswer when one is large.
Answer = gs.ModelInferResponse | InferAnswer


def whole(answer: Answer) -> gs.ModelInferResponse:
    """The answer as one message."""
    return answer.message() if isinstance(answer, InferAnswer) else answer


def serialize(answer: Answer) -> bytes | MessageParts:
    """ModelInfer's serializer on the own HTTP/2 front."""
    return answer.parts() if isinstance(answer, InferAnswer) else answer.SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
