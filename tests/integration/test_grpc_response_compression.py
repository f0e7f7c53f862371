"""Triton's --grpc-infer-response-compression-level against real Triton 2.51:
which grpc-encoding a ModelInfer / ModelStreamInfer answer carries for each
grpc-accept-encoding a client sends, whether its message is compressed (a
large answer is, a small one is not), and that other methods stay
uncompressed. A raw HTTP/2 client shows the headers and the message's flag
byte (grpcio hides both); tritonclient then reads a compressed answer."""

from __future__ import annotations

import socket
import zlib
from pathlib import Path

import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from bench.references import wait_ready
from stageserve.h2grpc import wire
from stageserve.launcher import Stack, start_services
from tests.integration.helpers import RPC_TIMEOUT_S, triton_grpc, write_echo

ACCEPTS = ("identity,deflate,gzip", "identity,gzip", "identity,deflate", "identity", None)
SERVICE = "/inference.GRPCInferenceService/"


def _frames(sock: socket.socket, buffer: bytearray) -> tuple[int, int, int, bytes]:
    while True:
        if len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) >= 9 + length:
                kind, flags = buffer[3], buffer[4]
                sid = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[9 : 9 + length])
                del buffer[: 9 + length]
                return kind, flags, sid, payload
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buffer += data


def raw_call(
    url: str, method: str, body: bytes, accept: str | None, blocks: list | None = None
) -> tuple[str | None, int, bytes, str]:
    """One call: (the answer's grpc-encoding, its message's flag byte, the
    message decompressed, grpc-status); `blocks` gets its header blocks."""
    host, port = url.rsplit(":", 1)
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", SERVICE + method),
        (":authority", url),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if accept is not None:
        headers.append(("grpc-accept-encoding", accept))
    message = b"\0" + len(body).to_bytes(4, "big") + body
    with socket.create_connection((host, int(port)), timeout=RPC_TIMEOUT_S) as sock:
        sock.sendall(
            wire.PREFACE
            + wire.frame(wire.SETTINGS, 0, 0, b"")
            + wire.frame(wire.HEADERS, wire.END_HEADERS, 1, encoder.encode(headers))
            + wire.frame(wire.DATA, wire.END_STREAM, 1, message)
        )
        buffer = bytearray()
        blocks = [] if blocks is None else blocks
        data = b""
        while True:
            kind, flags, sid, payload = _frames(sock, buffer)
            if kind == wire.SETTINGS and not flags & 1:
                sock.sendall(wire.frame(wire.SETTINGS, 1, 0, b""))  # ACK
            if sid != 1:
                continue
            if kind == wire.HEADERS:
                blocks.append([(str(k), str(v)) for k, v in decoder.decode(payload)])
            elif kind == wire.DATA:
                data += payload
            if flags & wire.END_STREAM:
                break
    first, last = dict(blocks[0]), dict(blocks[-1])
    encoding = first.get("grpc-encoding")
    flag = data[0] if data else -1
    answer = data[5:]
    if flag == 1:
        answer = zlib.decompress(answer, wbits=31 if encoding == "gzip" else 15)
    return encoding, flag, answer, last["grpc-status"]


def _echo_request(count: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="IN", datatype="INT32", shape=[1, count])
    request.raw_input_contents.append(bytes(4 * count))
    return request.SerializeToString()


def _observe(url: str) -> dict[tuple[str, str, str | None], tuple[str | None, int, str]]:
    """(method, size, accept) -> (grpc-encoding, message flag, grpc-status),
    each answer's bytes checked to be the whole answer."""
    seen = {}
    for accept in ACCEPTS:
        for size, count in (("small", 1), ("large", 2048)):
            for method in ("ModelInfer", "ModelStreamInfer"):
                encoding, flag, answer, status = raw_call(url, method, _echo_request(count), accept)
                if method == "ModelInfer":
                    parsed = service_pb2.ModelInferResponse.FromString(answer)
                else:
                    parsed = service_pb2.ModelStreamInferResponse.FromString(answer).infer_response
                assert parsed.raw_output_contents[0] == bytes(4 * count)
                seen[(method, size, accept)] = (encoding, flag, status)
        meta = raw_call(url, "ServerMetadata", b"", accept)
        seen[("ServerMetadata", "small", accept)] = (meta[0], meta[1], meta[3])
    return seen


def _header_blocks(url: str) -> list[list[tuple[str, str]]]:
    """Every header block of a compressed answer, an uncompressed one and a
    trailers-only error, fields in order."""
    blocks: list[list[tuple[str, str]]] = []
    raw_call(url, "ModelInfer", _echo_request(2048), "identity,deflate,gzip", blocks)
    raw_call(url, "ServerLive", b"", "identity,deflate,gzip", blocks)
    unknown = service_pb2.ModelInferRequest(model_name="nope").SerializeToString()
    raw_call(url, "ModelInfer", unknown, "identity,deflate,gzip", blocks)
    return blocks


def _repository(root: Path) -> Path:
    repo = write_echo(root, max_batch_size=4)
    config = repo / "echo" / "config.pbtxt"
    config.write_text(config.read_text().replace("dims: [ 1 ]", "dims: [ -1 ]"))
    return repo


@pytest.mark.parametrize("level", ["low", "high"])
def test_infer_answers_compress_as_tritons_do(tmp_path: Path, level: str) -> None:
    flag = f"--grpc-infer-response-compression-level={level}"
    repo = _repository(tmp_path / "repo")
    with triton_grpc(repo, tmp_path / "triton", ["echo"], flag) as url:
        triton = _observe(url)
        triton_blocks = _header_blocks(url)
    # what Triton answered: both infer methods, a large answer compressed
    both = "gzip" if level == "low" else "deflate"
    assert triton[("ModelInfer", "large", "identity,deflate,gzip")] == (both, 1, "0")
    assert triton[("ModelStreamInfer", "large", "identity,gzip")] == ("gzip", 1, "0")
    assert triton[("ModelInfer", "small", "identity,deflate")] == ("deflate", 0, "0")
    assert triton[("ModelInfer", "large", "identity")] == (None, 0, "0")
    assert triton[("ServerMetadata", "small", "identity,deflate,gzip")] == (None, 0, "0")
    stack = Stack()
    try:
        services = start_services(stack, repo, device="cpu", gateway_extra=[flag])
        wait_ready(services.gateway.address, ["echo"], 60)
        ours = _observe(services.gateway.address)
        ours_blocks = _header_blocks(services.gateway.address)
        with grpcclient.InferenceServerClient(services.gateway.address) as client:
            inp = grpcclient.InferInput("IN", [1, 2048], "INT32")
            data = np.arange(2048, dtype=np.int32).reshape(1, 2048)
            inp.set_data_from_numpy(data)
            out = client.infer("echo", [inp], client_timeout=RPC_TIMEOUT_S).as_numpy("OUT")
            np.testing.assert_array_equal(out, data)
    finally:
        stack.stop()
    assert ours == triton
    assert ours_blocks == triton_blocks


def test_without_the_flag_nothing_is_compressed(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    stack = Stack()
    try:
        services = start_services(stack, repo, device="cpu")
        wait_ready(services.gateway.address, ["echo"], 60)
        body = _echo_request(2048)
        answer = raw_call(services.gateway.address, "ModelInfer", body, "identity,deflate,gzip")
    finally:
        stack.stop()
    assert answer[0] is None and answer[1] == 0 and answer[3] == "0"
    parsed = service_pb2.ModelInferResponse.FromString(answer[2])
    assert parsed.raw_output_contents[0] == bytes(4 * 2048)
