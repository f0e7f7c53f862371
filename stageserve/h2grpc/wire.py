"""HTTP/2 and gRPC wire details the server writes: frame headers, HPACK
literals, gRPC status trailers, the grpc-timeout header.

The server's header blocks use only HPACK's static table and literals
without indexing (RFC 7541 6.2.2), so a block's bytes depend on nothing but
its headers and can be built once: the response headers and the OK trailers
of every call are two constants.
"""

from __future__ import annotations

import base64
import gzip
import zlib
from collections.abc import Iterable

# Frame types (RFC 9113 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Settings.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# Error codes (RFC 9113 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x6, 0x7, 0x8, 0x9

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1


class MessageParts(tuple):
    """One gRPC message as several buffers, in order: a serializer's answer
    whose large pieces (a tensor's bytes) go into DATA frames as they are,
    never joined into one message in Python."""

    __slots__ = ()

    def byte_size(self) -> int:
        return sum(len(part) for part in self)


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return bytes(
        (length >> 16 & 0xFF, length >> 8 & 0xFF, length & 0xFF, kind, flags)
    ) + stream_id.to_bytes(4, "big")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frame_header(len(payload), kind, flags, stream_id) + payload


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1: `value` in a `prefix_bits` prefix whose high bits are `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


STATUS_200 = b"\x88"  # static table index 8, ":status: 200"
# The header fields and values Triton 2.51's C++ gRPC server answers with, in
# its order (tests/integration/test_grpc_response_compression.py): a
# trailers-only answer carries no grpc-accept-encoding there.
TRAILERS_ONLY_HEADERS = STATUS_200 + hpack_literal(b"content-type", b"application/grpc")
_ACCEPTED = hpack_literal(b"grpc-accept-encoding", b"identity, deflate, gzip")
RESPONSE_HEADERS = TRAILERS_ONLY_HEADERS + _ACCEPTED


#: A response's headers naming the algorithm its messages are compressed with.
ENCODED_RESPONSE_HEADERS = {
    algorithm: TRAILERS_ONLY_HEADERS + hpack_literal(b"grpc-encoding", algorithm) + _ACCEPTED
    for algorithm in (b"gzip", b"deflate")
}

#: Triton's --grpc-infer-response-compression-level values that compress.
COMPRESSING_LEVELS = ("low", "medium", "high")


def response_encoding(level: str, accepted: bytes | None) -> bytes | None:
    """The algorithm an answer is compressed with at `level` for a client
    whose grpc-accept-encoding is `accepted`, as Triton 2.51 (grpc's C++
    core) chooses it: measured with a raw HTTP/2 client, both fronts in
    tests/integration/test_grpc_response_compression.py. A client accepting
    both gets gzip at low and deflate at medium and high; one accepting one
    of them gets that one; None: not compressed."""
    if level not in COMPRESSING_LEVELS or not accepted:
        return None
    offered = {a.strip() for a in accepted.split(b",")}
    usable = [a for a in (b"gzip", b"deflate") if a in offered]
    if len(usable) == 2:
        return b"gzip" if level == "low" else b"deflate"
    return usable[0] if usable else None


def compress(algorithm: bytes, message: bytes) -> bytes | None:
    """`message` compressed (gzip, or deflate: zlib's format), or None where
    that would make it longer: grpc then sends it as it is (flag 0) under the
    same grpc-encoding header, as Triton does with a small answer."""
    out = (gzip.compress if algorithm == b"gzip" else zlib.compress)(message)
    return out if len(out) <= len(message) else None


def _percent_encode(message: str) -> bytes:
    """gRPC's grpc-message encoding: UTF-8, then %XX for bytes outside 0x20-0x7E and '%'."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def metadata_fields(metadata: Iterable[tuple[str, str | bytes]]) -> bytes:
    """Custom metadata as literals: keys ending in -bin carry base64 (unpadded) bytes."""
    out = bytearray()
    for key, value in metadata:
        name = key.lower().encode("ascii")
        if key.endswith("-bin"):
            raw = value if isinstance(value, bytes) else value.encode("utf-8")
            encoded = base64.b64encode(raw).rstrip(b"=")
        else:
            encoded = value.encode("ascii") if isinstance(value, str) else value
        out += hpack_literal(name, encoded)
    return bytes(out)


def trailers(
    code: int, message: str = "", metadata: Iterable[tuple[str, str | bytes]] = ()
) -> bytes:
    block = hpack_literal(b"grpc-status", str(code).encode("ascii"))
    if message:
        block += hpack_literal(b"grpc-message", _percent_encode(message))
    return block + metadata_fields(metadata)


OK_TRAILERS = trailers(0)

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float | None:
    """grpc-timeout ("100m", "5S", ...) in seconds; None when malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def decode_metadata_value(key: str, value: bytes) -> str | bytes:
    """A received header's value as grpc's invocation_metadata gives it:
    bytes for -bin keys (base64 decoded, padding optional), str otherwise."""
    if key.endswith("-bin"):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value.decode("latin-1")
