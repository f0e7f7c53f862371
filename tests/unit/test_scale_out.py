"""`stageserve up --gateways N|auto`: the count, and the flags each gateway gets."""

from __future__ import annotations

import argparse

import pytest

from stageserve.cli import build_parser
from stageserve.scale_out import auto_gateways, gateway_count, parse_gateways
from stageserve.settings import StackSettings, settings_from


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (16, 8), (64, 8)]
)
def test_auto_is_one_gateway_per_two_cores_capped(cores: int, expected: int) -> None:
    assert auto_gateways(cores, StackSettings()) == expected


def test_auto_follows_its_settings() -> None:
    assert auto_gateways(16, StackSettings(auto_gateway_cores=2, auto_gateways_max=6)) == 6
    assert auto_gateways(6, StackSettings(auto_gateway_cores=0)) == 6  # 0 per: at least 1 core


def test_auto_settings_from_the_environment() -> None:
    env = {"STAGESERVE_STACK_AUTO_GATEWAY_CORES": "2", "STAGESERVE_STACK_AUTO_GATEWAYS_MAX": "3"}
    stack = settings_from({}, env).stack
    assert gateway_count("auto", stack, cores=16) == 3


def test_a_count_is_taken_as_given() -> None:
    assert gateway_count(3, StackSettings(), cores=2) == 3
    with pytest.raises(ValueError, match="--gateways"):
        gateway_count(0, StackSettings())


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_gateways(bad)


def test_up_takes_gateways_and_the_gateway_tritons_reuse_flags() -> None:
    parser = build_parser()
    # auto by default: with several, `up` serves --metrics-port with their merge
    assert parser.parse_args(["up"]).gateways == "auto"
    assert parser.parse_args(["up", "--gateways", "auto"]).gateways == "auto"
    assert parser.parse_args(["up", "--gateways", "2"]).gateways == 2
    gw = ["gateway", "--model-repository", "/m", "--redis-url", "redis://x"]
    args = parser.parse_args([*gw, "--reuse-grpc-port", "true", "--reuse-http-port", "1"])
    settings = settings_from(args, {}).gateway
    assert settings.reuse_grpc_port and settings.reuse_http_port
    plain = settings_from(parser.parse_args(gw), {}).gateway
    assert not plain.reuse_grpc_port and not plain.reuse_http_port


def test_the_http_front_shares_its_port_only_when_asked() -> None:
    from services.gateway.http.server import _listen

    first = _listen("127.0.0.1", 0, reuse_port=True)
    try:
        port = first.getsockname()[1]
        second = _listen("127.0.0.1", port, reuse_port=True)
        second.close()
        with pytest.raises(OSError):  # without it the bind fails, as Triton's does
            _listen("127.0.0.1", port).close()
    finally:
        first.close()
    alone = _listen("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            _listen("127.0.0.1", alone.getsockname()[1], reuse_port=True).close()
    finally:
        alone.close()


def test_a_startup_failure_is_summarized_once_however_many_gateways_saw_it() -> None:
    import io
    import json

    from stageserve.launcher import Child, Stack, print_startup_summary

    failure = {"model": "broken", "version": "", "reason": "bad config"}
    other = {"model": "other", "version": "1", "reason": "no backend"}
    stack = Stack()
    stack.children = [
        Child("gateway", proc=None, startup_failures=[failure, other]),  # type: ignore[arg-type]
        Child("gateway-1", proc=None, startup_failures=[failure]),  # type: ignore[arg-type]
    ]
    out = io.StringIO()
    print_startup_summary(stack, out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {"event": "model not loaded", **failure},
        {"event": "model not loaded", **other},
    ]


def test_grpc_shares_a_port_unless_told_not_to() -> None:
    """Why the gateway sets grpc.so_reuseport from --reuse-grpc-port, 0 included:
    grpc core shares a port by default, so a second gateway on a taken port
    would silently split its connections instead of failing the bind."""
    from concurrent import futures

    import grpc

    from stageserve.net import free_port

    address = f"127.0.0.1:{free_port()}"
    servers = []

    def bind(options: list[tuple[str, int]]) -> bool:
        server = grpc.server(futures.ThreadPoolExecutor(1), options=options)
        servers.append(server)
        try:
            return server.add_insecure_port(address) != 0
        except RuntimeError:  # "Failed to bind to address"
            return False

    try:
        assert bind([("grpc.so_reuseport", 1)])
        assert bind([])  # grpc's default joins it
        assert bind([("grpc.so_reuseport", 1)])
        assert not bind([("grpc.so_reuseport", 0)])  # --reuse-grpc-port false: refused
    finally:
        for server in servers:
            server.stop(None)
