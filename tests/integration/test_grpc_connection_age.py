"""Triton's --grpc-max-connection-age against real Triton 2.51, seen by a raw
HTTP/2 client: an idle connection is ended at its age (a GOAWAY announcing
the end, a PING, a GOAWAY naming the last stream, then the close), and one
with a call in flight lets that call finish first."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import hpack
from tritonclient.grpc import service_pb2

from bench.references import wait_ready
from stageserve.h2grpc import wire
from stageserve.launcher import Stack, start_services
from tests.integration.helpers import triton_grpc, write_echo

AGE_MS = 1000
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _slow_call(url: str) -> bytes:
    """HEADERS and DATA of an echo call that takes 1 s (a negative input)."""
    request = service_pb2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="IN", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append((-1).to_bytes(4, "little", signed=True))
    body = request.SerializeToString()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", INFER),
        (":authority", url),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    block = hpack.Encoder().encode(headers)
    message = b"\0" + len(body).to_bytes(4, "big") + body
    return wire.frame(wire.HEADERS, wire.END_HEADERS, 1, block) + wire.frame(
        wire.DATA, wire.END_STREAM, 1, message
    )


def _watch(url: str, call_at_s: float | None) -> list[tuple[float, str, int]]:
    """(seconds since connecting, what, a number) of what the server does
    within 4 s: GOAWAY (its last stream id), PING, the call's end (END_STREAM
    on stream 1) and the close."""
    host, port = url.rsplit(":", 1)
    seen: list[tuple[float, str, int]] = []
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(0.05)
        sock.sendall(wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0, b""))
        start = time.monotonic()
        buffer = bytearray()
        while (now := time.monotonic() - start) < 4.0:
            if call_at_s is not None and now >= call_at_s:
                sock.sendall(_slow_call(url))
                call_at_s = None
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:  # closed while our last ACK was on its way
                data = b""
            if not data:
                seen.append((round(now, 2), "closed", 0))
                break
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                length = int.from_bytes(buffer[:3], "big")
                kind, flags = buffer[3], buffer[4]
                sid = int.from_bytes(buffer[5:9], "big")
                payload = bytes(buffer[9 : 9 + length])
                del buffer[: 9 + length]
                if kind == wire.GOAWAY:
                    seen.append((round(now, 2), "goaway", int.from_bytes(payload[:4], "big")))
                elif kind == wire.PING and not flags & wire.ACK:
                    seen.append((round(now, 2), "ping", 0))
                    sock.sendall(wire.frame(wire.PING, wire.ACK, 0, payload))
                elif kind == wire.SETTINGS and not flags & wire.ACK:
                    sock.sendall(wire.frame(wire.SETTINGS, wire.ACK, 0, b""))
                elif sid == 1 and flags & wire.END_STREAM:
                    seen.append((round(now, 2), "call ended", 1))
    return seen


def _both(url: str) -> tuple[list, list]:
    return _watch(url, None), _watch(url, 0.6)


def _shape(seen: list[tuple[float, str, int]]) -> list[tuple[str, int]]:
    """From the first GOAWAY on (grpc's own PINGs before it, its bandwidth
    probes, are not the age's)."""
    shape = [(what, number) for _, what, number in seen]
    first = next((i for i, (what, _) in enumerate(shape) if what == "goaway"), len(shape))
    return shape[first:]


def _goaway_at(seen: list[tuple[float, str, int]]) -> float:
    return next(at for at, what, _ in seen if what == "goaway")


def _ended_at(seen: list[tuple[float, str, int]]) -> float:
    return next(at for at, what, _ in seen if what == "call ended")


def test_an_aged_connection_ends_as_tritons_do(tmp_path: Path) -> None:
    repo = write_echo(tmp_path / "repo", max_batch_size=4)
    flag = f"--grpc-max-connection-age={AGE_MS}"
    with triton_grpc(repo, tmp_path / "triton", ["echo"], flag) as url:
        triton_idle, triton_busy = _both(url)
    last = 2**31 - 1
    assert _shape(triton_idle) == [("goaway", last), ("ping", 0), ("goaway", 0), ("closed", 0)]
    assert _shape(triton_busy) == [
        ("goaway", last),
        ("ping", 0),
        ("goaway", 1),
        ("call ended", 1),
        ("closed", 0),
    ]
    stack = Stack()
    try:
        services = start_services(stack, repo, device="cpu", gateway_extra=[flag])
        wait_ready(services.gateway.address, ["echo"], 60)
        ours_idle, ours_busy = _both(services.gateway.address)
    finally:
        stack.stop()
    assert _shape(ours_idle) == _shape(triton_idle)
    assert _shape(ours_busy) == _shape(triton_busy)
    for seen in (ours_idle, ours_busy):
        assert 0.85 <= _goaway_at(seen) <= 2.0, seen  # the age, with grpc's jitter
    assert _ended_at(ours_busy) >= 1.5, ours_busy  # the call (1 s from 0.6 s) finished first
