"""stageserve/h2grpc/connection.py: the server side of an HTTP/2 connection, bytes in and out.

A client is played by hand: the preface, frames built with wire.frame and header blocks
from hpack's own encoder; what the server writes is parsed back into frames.
"""

from __future__ import annotations

import gzip
import zlib

import hpack
import pytest

from stageserve.h2grpc import wire
from stageserve.h2grpc.connection import (
    END,
    GOAWAY,
    MESSAGE,
    REQUEST,
    RESET,
    STREAM_WINDOW,
    ProtocolError,
    ServerConnection,
)

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("x-key", "value"),
]


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each frame in `data`."""
    out = []
    at = 0
    while at < len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        kind, flags = data[at + 3], data[at + 4]
        sid = int.from_bytes(data[at + 5 : at + 9], "big") & 0x7FFFFFFF
        out.append((kind, flags, sid, data[at + 9 : at + 9 + length]))
        at += 9 + length
    assert at == len(data)
    return out


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(body).to_bytes(4, "big") + body


def settings(**values: int) -> bytes:
    keys = {
        "initial_window": wire.SETTINGS_INITIAL_WINDOW_SIZE,
        "max_frame": wire.SETTINGS_MAX_FRAME_SIZE,
    }
    payload = b"".join(keys[k].to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items())
    return wire.frame(wire.SETTINGS, 0, 0, payload)


class Client:
    def __init__(self) -> None:
        self.server = ServerConnection()
        self.encoder = hpack.Encoder()
        greeting = frames(self.server.data_to_send())
        assert greeting[0][0] == wire.SETTINGS
        self.events = self.server.receive(wire.PREFACE + settings())
        self.sent = frames(self.server.data_to_send())  # its SETTINGS ack

    def headers(self, sid: int, end_stream: bool = False, extra: list | None = None) -> bytes:
        block = self.encoder.encode(REQUEST_HEADERS + (extra or []))
        flags = wire.END_HEADERS | (wire.END_STREAM if end_stream else 0)
        return wire.frame(wire.HEADERS, flags, sid, block)

    def send(self, data: bytes) -> list:
        return self.server.receive(data)

    def output(self) -> list[tuple[int, int, int, bytes]]:
        return frames(self.server.data_to_send())


def test_server_greets_with_settings_and_a_larger_connection_window() -> None:
    server = ServerConnection()
    (kind, flags, sid, payload), (wkind, _, wsid, increment) = frames(server.data_to_send())
    assert (kind, flags, sid) == (wire.SETTINGS, 0, 0)
    entries = {
        int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(payload[i + 2 : i + 6], "big")
        for i in range(0, len(payload), 6)
    }
    assert entries[wire.SETTINGS_INITIAL_WINDOW_SIZE] == STREAM_WINDOW
    assert entries[wire.SETTINGS_ENABLE_PUSH] == 0
    assert (wkind, wsid) == (wire.WINDOW_UPDATE, 0)
    assert int.from_bytes(increment, "big") > 0


def test_a_unary_request_gives_request_message_and_end_events() -> None:
    client = Client()
    body = b"\x01\x02\x03"
    events = client.send(
        client.headers(1) + wire.frame(wire.DATA, wire.END_STREAM, 1, grpc_message(body))
    )
    assert [e[0] for e in events] == [REQUEST, MESSAGE, END]
    headers = dict(events[0][2])
    assert headers[b":path"] == b"/inference.GRPCInferenceService/ModelInfer"
    assert headers[b"x-key"] == b"value"
    assert events[1] == (MESSAGE, 1, (False, body))
    assert events[2] == (END, 1, None)


def test_frames_split_across_reads_and_messages_across_frames() -> None:
    client = Client()
    body = bytes(range(256)) * 100
    message = grpc_message(body, compressed=True)
    data = (
        client.headers(3)
        + wire.frame(wire.DATA, 0, 3, message[:7])
        + wire.frame(wire.DATA, 0, 3, message[7:20000])
        + wire.frame(wire.DATA, wire.END_STREAM, 3, message[20000:])
    )
    events = []
    for at in range(0, len(data), 997):  # the socket hands the bytes over in pieces
        events += client.send(data[at : at + 997])
    assert [e[0] for e in events] == [REQUEST, MESSAGE, END]
    assert events[1][2] == (True, body)


def test_two_messages_in_one_frame_on_a_stream() -> None:
    client = Client()
    data = client.headers(5) + wire.frame(
        wire.DATA, 0, 5, grpc_message(b"first") + grpc_message(b"second")
    )
    events = client.send(data)
    assert [e[2] for e in events if e[0] == MESSAGE] == [(False, b"first"), (False, b"second")]
    assert not [e for e in events if e[0] == END]


def test_continuation_padding_and_priority() -> None:
    client = Client()
    block = client.encoder.encode(REQUEST_HEADERS)
    pad = 4
    first = bytes((pad,)) + b"\x00\x00\x00\x00\x10" + block[:10] + b"\x00" * pad
    data = (
        wire.frame(wire.HEADERS, wire.PADDED | wire.PRIORITY_FLAG, 7, first)
        + wire.frame(wire.CONTINUATION, 0, 7, block[10:20])
        + wire.frame(wire.CONTINUATION, wire.END_HEADERS, 7, block[20:])
        + wire.frame(
            wire.DATA, wire.PADDED | wire.END_STREAM, 7, b"\x03" + grpc_message(b"x") + b"\x00" * 3
        )
    )
    events = client.send(data)
    assert [e[0] for e in events] == [REQUEST, MESSAGE, END]
    assert dict(events[0][2])[b":path"].endswith(b"/ModelInfer")
    assert events[1][2] == (False, b"x")


def test_a_header_block_interrupted_by_another_frame_is_a_connection_error() -> None:
    client = Client()
    block = client.encoder.encode(REQUEST_HEADERS)
    with pytest.raises(ProtocolError) as err:
        client.send(wire.frame(wire.HEADERS, 0, 1, block[:5]) + wire.frame(wire.DATA, 0, 1, b""))
    assert err.value.code == wire.PROTOCOL_ERROR


def test_a_bad_preface_is_refused() -> None:
    with pytest.raises(ProtocolError):
        ServerConnection().receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_response_frames_and_trailers_only() -> None:
    client = Client()
    client.send(client.headers(1, end_stream=True))
    client.server.send_headers(1, wire.RESPONSE_HEADERS)
    client.server.send_message(1, b"answer")
    client.server.send_headers(1, wire.OK_TRAILERS, end_stream=True)
    out = client.output()
    assert [(k, f, s) for k, f, s, _ in out] == [
        (wire.HEADERS, wire.END_HEADERS, 1),
        (wire.DATA, 0, 1),
        (wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1),
    ]
    assert out[1][3] == grpc_message(b"answer")
    decoder = hpack.Decoder()
    assert decoder.decode(out[0][3]) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-accept-encoding", "identity, deflate, gzip"),
    ]
    assert decoder.decode(out[2][3]) == [("grpc-status", "0")]
    assert not client.server.is_open(1)
    # Nothing more goes out on a finished stream.
    client.server.send_message(1, b"late")
    assert client.output() == []


def test_status_message_is_percent_encoded() -> None:
    block = wire.trailers(3, "naïve 100% sure\n", [("k-bin", b"\x00\xff"), ("k", "v")])
    fields = hpack.Decoder().decode(block, raw=True)
    assert fields == [
        (b"grpc-status", b"3"),
        (b"grpc-message", b"na%C3%AFve 100%25 sure%0A"),
        (b"k-bin", b"AP8"),
        (b"k", b"v"),
    ]


def test_output_waits_for_the_client_window_and_keeps_order_with_trailers() -> None:
    client = Client()
    client.send(settings(initial_window=10))
    client.output()
    client.send(client.headers(1, end_stream=True))
    client.server.send_headers(1, wire.RESPONSE_HEADERS)
    client.server.send_message(1, b"a" * 30)  # 35 bytes with the prefix, 10 fit
    client.server.send_headers(1, wire.OK_TRAILERS, end_stream=True)
    out = client.output()
    assert [(k, len(p)) for k, _, _, p in out] == [
        (wire.HEADERS, len(wire.RESPONSE_HEADERS)),
        (wire.DATA, 10),
    ]
    client.send(wire.frame(wire.WINDOW_UPDATE, 0, 1, (20).to_bytes(4, "big")))
    assert [(k, len(p)) for k, _, _, p in client.output() if k != wire.SETTINGS] == [
        (wire.DATA, 20)
    ]
    assert client.server.is_open(1) is False  # ended here, frames still queued
    # A larger initial window opens every stream's window by the difference.
    client.send(settings(initial_window=100))
    rest = [
        (k, f, p) for k, f, _, p in client.output() if not (k == wire.SETTINGS and f & wire.ACK)
    ]
    assert [(k, f) for k, f, _ in rest] == [
        (wire.DATA, 0),
        (wire.HEADERS, wire.END_HEADERS | wire.END_STREAM),
    ]
    assert len(rest[0][2]) == 5


def test_output_waits_for_the_connection_window() -> None:
    client = Client()
    client.send(settings(initial_window=1 << 20))  # streams may take more than the connection
    client.send(client.headers(1, end_stream=True))
    client.server.send_message(1, b"z" * 70_000)  # above the connection's 65,535
    sent = sum(len(p) for k, _, _, p in client.output() if k == wire.DATA)
    assert sent == wire.DEFAULT_WINDOW
    client.send(wire.frame(wire.WINDOW_UPDATE, 0, 0, (10_000).to_bytes(4, "big")))
    rest = sum(len(p) for k, _, _, p in client.output() if k == wire.DATA)
    assert sent + rest == 70_005


@pytest.mark.parametrize(
    ("length", "sizes"),
    [(40_000, [16_384, 16_384, 40_005 - 32_768]), (2 * 16_384 - 5, [16_384, 16_384])],
)
def test_large_output_is_cut_at_the_clients_max_frame_size(length: int, sizes: list[int]) -> None:
    client = Client()
    client.send(client.headers(1, end_stream=True))
    body = (bytes(range(251)) * (length // 251 + 1))[:length]  # no period of a frame's size
    client.server.send_message(1, body)
    data = [p for k, _, _, p in client.output() if k == wire.DATA]
    assert [len(p) for p in data] == sizes
    assert b"".join(data) == grpc_message(body)


def test_inbound_windows_are_refilled() -> None:
    client = Client()
    client.send(client.headers(1))
    chunk = b"\x00" * 1_000_000
    updates = []
    for _ in range(12):  # 12 MB on one stream: past half its 16 MiB window
        client.send(wire.frame(wire.DATA, 0, 1, chunk))
        updates += [
            (s, int.from_bytes(p, "big"))
            for k, _, s, p in client.output()
            if k == wire.WINDOW_UPDATE
        ]
    assert updates and updates[0][0] == 1 and updates[0][1] >= STREAM_WINDOW // 2


def test_ping_is_answered_and_settings_acknowledged() -> None:
    client = Client()
    client.send(wire.frame(wire.PING, 0, 0, b"12345678") + settings(max_frame=20_000))
    out = client.output()
    assert (wire.PING, wire.ACK, 0, b"12345678") in out
    assert (wire.SETTINGS, wire.ACK, 0, b"") in out


def test_reset_and_goaway_from_the_client() -> None:
    client = Client()
    client.send(client.headers(1))
    events = client.send(
        wire.frame(wire.RST_STREAM, 0, 1, wire.CANCEL.to_bytes(4, "big"))
        + wire.frame(wire.GOAWAY, 0, 0, (1).to_bytes(4, "big") + (0).to_bytes(4, "big"))
    )
    assert events == [(RESET, 1, wire.CANCEL), (GOAWAY, 0, (1, 0))]
    client.server.send_message(1, b"after the reset")
    assert client.output() == []
    # Data for the reset stream is dropped, and still counts for the connection.
    assert client.send(wire.frame(wire.DATA, 0, 1, grpc_message(b"late"))) == []


def test_server_reset_and_goaway_frames() -> None:
    client = Client()
    client.send(client.headers(9))
    client.server.reset(9, wire.REFUSED_STREAM)
    client.server.goaway()
    (rk, _, rs, rp), (gk, _, gs, gp) = client.output()
    assert (rk, rs, int.from_bytes(rp, "big")) == (wire.RST_STREAM, 9, wire.REFUSED_STREAM)
    assert (gk, gs) == (wire.GOAWAY, 0)
    assert int.from_bytes(gp[:4], "big") == 9  # the last stream it saw


def test_headers_on_a_finished_stream_keep_hpack_in_step() -> None:
    client = Client()
    client.send(client.headers(1, end_stream=True))
    client.server.send_headers(1, wire.OK_TRAILERS, end_stream=True)
    # A late header block for stream 1 changes the shared table; stream 3 must decode.
    late = client.encoder.encode([("x-late", "1")])
    events = client.send(
        wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1, late)
        + client.headers(3, end_stream=True, extra=[("x-late", "1")])
    )
    assert [(e[0], e[1]) for e in events] == [(REQUEST, 3), (END, 3)]
    assert dict(events[0][2])[b"x-late"] == b"1"


def test_oversized_and_malformed_frames_are_connection_errors() -> None:
    client = Client()
    with pytest.raises(ProtocolError) as err:
        client.send(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01")  # 2 MiB frame
    assert err.value.code == wire.FRAME_SIZE_ERROR
    client = Client()
    with pytest.raises(ProtocolError):
        client.send(wire.frame(wire.PING, 0, 0, b"short"))
    client = Client()
    with pytest.raises(ProtocolError):
        client.send(wire.frame(wire.HEADERS, wire.END_HEADERS, 2, b""))  # even: a server's id
    client = Client()
    with pytest.raises(ProtocolError) as err:
        client.send(wire.frame(wire.HEADERS, wire.END_HEADERS, 1, b"\xff\xff\xff\xff"))
    assert err.value.code == wire.COMPRESSION_ERROR


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("100m", 0.1), ("5S", 5.0), ("2M", 120.0), ("1H", 3600.0), ("250u", 250e-6), ("7n", 7e-9)],
)
def test_grpc_timeout(value: str, seconds: float) -> None:
    assert wire.parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "m", "10", "10x", "-5S", "123456789S"])
def test_grpc_timeout_malformed(value: str) -> None:
    assert wire.parse_timeout(value) is None


def test_hpack_integers() -> None:
    assert wire.hpack_int(10, 5, 0) == b"\x0a"
    assert wire.hpack_int(1337, 5, 0) == b"\x1f\x9a\x0a"  # RFC 7541 C.1.2
    assert wire.hpack_int(42, 8, 0) == b"\x2a"
    long_value = "v" * 300
    assert hpack.Decoder().decode(wire.hpack_literal(b"k", long_value.encode())) == [
        ("k", long_value)
    ]


def test_repeated_indexed_blocks_decode_as_the_table_says() -> None:
    """A block of indexed fields only is remembered; a block that changes HPACK's table
    makes the same bytes mean other headers, and the connection must follow the table."""
    client = Client()
    mirror = hpack.Decoder()  # what the headers are, decoded afresh each time

    def request(sid: int, block: bytes) -> list:
        expected = mirror.decode(block, raw=True)
        events = client.send(
            wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, sid, block)
        )
        assert events[0][0] == REQUEST
        assert list(events[0][2]) == list(expected)
        return list(expected)

    request(1, client.encoder.encode(REQUEST_HEADERS))  # literals: they enter the table
    indexed = client.encoder.encode(REQUEST_HEADERS)
    assert all(byte & 0x80 for byte in indexed[:1])
    first = request(3, indexed)
    assert request(5, indexed) == first
    request(7, client.encoder.encode([*REQUEST_HEADERS, ("x-new", "shifts the table")]))
    shifted = request(9, indexed)  # the same bytes, now naming other entries
    assert shifted != first


def test_a_large_header_list_decodes_whole_and_keeps_hpack_in_step() -> None:
    """Over hpack's default 64 KiB list limit: decoded (the server then
    refuses the call alone, server.py), and the next block, which indexes the
    big field from the shared table, decodes as the table says."""
    client = Client()
    big = [("x-big", "a" * 100_000)]
    head = client.headers(1, end_stream=True, extra=big)  # (one frame: within max frame)
    events = client.send(head + client.headers(3, end_stream=True, extra=big))
    assert [(e[0], e[1]) for e in events] == [(REQUEST, 1), (END, 1), (REQUEST, 3), (END, 3)]
    assert dict(events[2][2])[b"x-big"] == b"a" * 100_000


def test_a_header_block_over_a_mebibyte_is_a_connection_error() -> None:
    client = Client()
    big = [("x-big", "a" * (1024 * 1024 + 1))]
    block = client.encoder.encode(REQUEST_HEADERS + big, huffman=False)
    data = wire.frame(wire.HEADERS, 0, 1, block[:1000])
    for at in range(1000, len(block), 500_000):
        data += wire.frame(wire.CONTINUATION, 0, 1, block[at : at + 500_000])
    with pytest.raises(ProtocolError) as err:
        client.send(data)
    assert err.value.code == wire.COMPRESSION_ERROR


def test_a_compressed_message_is_flagged_under_its_encoding_header() -> None:
    client = Client()
    client.send(client.headers(1, end_stream=True))
    client.server.send_headers(1, wire.ENCODED_RESPONSE_HEADERS[b"gzip"])
    packed = wire.compress(b"gzip", bytes(4096))
    assert packed is not None
    client.server.send_message(1, packed, compressed=True)
    out = client.output()
    assert ("grpc-encoding", "gzip") in list(hpack.Decoder().decode(out[0][3]))
    assert out[1][3] == grpc_message(packed, compressed=True)


# grpc-accept-encoding -> algorithm, per level, as Triton 2.51 answered a raw
# HTTP/2 client (tests/integration/test_grpc_response_compression.py checks it live)
ENCODINGS = {
    "low": {
        "identity,deflate,gzip": "gzip",
        "identity,gzip": "gzip",
        "identity,deflate": "deflate",
    },
    "medium": {
        "identity,deflate,gzip": "deflate",
        "identity,gzip": "gzip",
        "identity,deflate": "deflate",
    },
    "high": {
        "identity,deflate,gzip": "deflate",
        "identity,gzip": "gzip",
        "identity,deflate": "deflate",
    },
}


@pytest.mark.parametrize("level", ["none", "low", "medium", "high"])
def test_response_encoding_per_level_and_accepted_set(level: str) -> None:
    for accepted in ("identity,deflate,gzip", "identity,gzip", "identity,deflate", "identity"):
        want = ENCODINGS.get(level, {}).get(accepted)
        got = wire.response_encoding(level, accepted.encode())
        assert got == (want.encode() if want else None), (level, accepted)
    assert wire.response_encoding(level, None) is None  # no grpc-accept-encoding


def test_compress_round_trips_and_keeps_a_message_it_would_lengthen() -> None:
    body = bytes(8192)
    packed_gzip = wire.compress(b"gzip", body)
    packed_deflate = wire.compress(b"deflate", body)
    assert packed_gzip is not None and gzip.decompress(packed_gzip) == body
    assert packed_deflate is not None and zlib.decompress(packed_deflate) == body  # zlib format
    assert wire.compress(b"gzip", b"\x08\x01") is None  # 2 bytes: compressing lengthens


def test_goaway_may_name_any_last_stream_and_the_server_may_ping() -> None:
    client = Client()
    client.send(client.headers(1, end_stream=True))
    client.server.goaway(last_stream_id=2**31 - 1)
    client.server.ping()
    client.server.goaway()
    out = client.output()
    assert [(k, s) for k, _, s, _ in out] == [(wire.GOAWAY, 0), (wire.PING, 0), (wire.GOAWAY, 0)]
    assert out[0][3][:4] == (2**31 - 1).to_bytes(4, "big")  # a notice: no last stream yet
    assert out[1][1] == 0 and len(out[1][3]) == 8  # a PING asking for its ACK
    assert out[2][3][:4] == (1).to_bytes(4, "big")  # the last stream taken
