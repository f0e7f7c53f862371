"""A ModelInfer request with its raw inputs apart from the protobuf message.

Parsing a request copies each `raw_input_contents` entry into protobuf,
and each read of the entry copies it out again. On the own HTTP/2 front
ModelInfer's deserializer splits the message first: the raw inputs stay
views of the received bytes, and protobuf parses only the other fields.
Validation reads the views (validation.py's `raw_contents`, as the HTTP
front passes its binary inputs), and a large input goes from the view
into the gateway's tensor region. For a 49 KB input that is two copies
less, and the parse takes 2.3 us against 4.5 (in-process, timeit).

Every top-level field of ModelInferRequest is length-delimited. A message
with any other wire type, or one whose lengths overrun, is parsed whole,
so protobuf answers for it as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from stageserve.generated import grpc_service_pb2 as gs

#: raw_input_contents' field number; every top-level field's wire type is 2.
RAW_INPUT_FIELD = 7
LENGTH_DELIMITED = 2


@dataclass(frozen=True, slots=True)
class InferCall:
    """`request` without raw_input_contents when `raws` holds them, in
    order; `raws` None: they are in the request (a message parsed whole)."""

    request: gs.ModelInferRequest
    raws: list[memoryview] | None


def parse_infer_request(data: bytes) -> InferCall:
    """The deserializer of ModelInfer on the own HTTP/2 front."""
    if not isinstance(data, bytes):  # the views must outlive any buffer reuse
        data = bytes(data)
    split = _split(data)
    if split is None:
        return InferCall(gs.ModelInferRequest.FromString(data), None)
    rest, raws = split
    return InferCall(gs.ModelInferRequest.FromString(rest), raws)


def _split(data: bytes) -> tuple[bytes, list[memoryview]] | None:
    """(the other fields' bytes, the raw inputs' views); None: parse it whole
    (no raw input, a wire type other than 2, or a length past the end)."""
    view = memoryview(data)
    end = len(view)
    at = kept_from = 0
    kept: list[memoryview] = []
    raws: list[memoryview] = []
    while at < end:
        start = at
        tag, at = _varint(view, at, end)
        if tag & 7 != LENGTH_DELIMITED:
            return None
        size, at = _varint(view, at, end)
        if at < 0 or at + size > end:
            return None
        if tag >> 3 == RAW_INPUT_FIELD:
            if start > kept_from:
                kept.append(view[kept_from:start])
            raws.append(view[at : at + size])
            kept_from = at + size
        at += size
    if not raws:
        return None
    if kept_from < end:
        kept.append(view[kept_from:end])
    return b"".join(kept), raws


def _varint(view: memoryview, at: int, end: int) -> tuple[int, int]:
    """(value, the position after it); the position is -1 past the end, and
    then the value's wire type reads as 7 (not length-delimited)."""
    value = shift = 0
    while at < end and shift < 64:
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return 7, -1
