"""Parsing Triton's security flags (stageserve/security_options.py)."""

from __future__ import annotations

import pytest

from stageserve.cli import _gateway_argv, _settings, build_parser
from stageserve.security_options import (
    parse_http_restriction,
    parse_restriction,
    restrictions_from,
    tls_from,
)
from stageserve.settings import GatewaySettings


def test_a_restriction_names_groups_and_a_prefixed_header() -> None:
    r = parse_restriction("model-repository,shared-memory:Admin-Key=s3cret")
    assert r.groups == {"model-repository", "shared-memory"}
    assert (r.header, r.value) == ("triton-grpc-protocol-admin-key", "s3cret")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model-repository:admin-key", "option format is '<config name>:<setting>=<value>'"),
        ("model-repository", "option format is"),
        (":k=v", "option format is"),
        ("bogus:k=v", "unknown restricted protocol 'bogus'"),
    ],
)
def test_malformed_restrictions_get_tritons_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_restriction(text)


def _gateway_child(up_argv: list[str], tmp_path) -> tuple[GatewaySettings, GatewaySettings]:
    """`up`'s gateway section, and the one its gateway child parses from the
    flags `up` writes again from the tree."""
    parser = build_parser()
    up = _settings(parser, parser.parse_args(up_argv)).gateway
    child_argv = ["gateway", "--model-repository", str(tmp_path), "--redis-url", "redis://x"]
    child = _settings(parser, parser.parse_args([*child_argv, *_gateway_argv(up)])).gateway
    return up, child


def test_flags_parse_and_travel_to_the_gateway_child(tmp_path) -> None:
    up, child = _gateway_child(
        [
            "up",
            "--grpc-use-ssl",
            "--grpc-server-cert", str(tmp_path / "s.crt"),
            "--grpc-server-key", str(tmp_path / "s.key"),
            "--grpc-restricted-protocol=statistics,health:Admin-Key=a=b:c",
        ],
        tmp_path,
    )  # fmt: skip
    tls = up.public_tls
    assert tls is not None and not tls.mutual and tls.root_cert is None
    (rule,) = up.grpc_restrictions
    assert rule.groups == {"statistics", "health"}
    assert (rule.header, rule.value) == ("triton-grpc-protocol-admin-key", "a=b:c")
    assert child.public_tls == tls and child.grpc_restrictions == up.grpc_restrictions
    assert child.http_restrictions == ()


def test_mutual_tls_travels_to_the_gateway_child(tmp_path) -> None:
    up, child = _gateway_child(
        [
            "up",
            "--grpc-use-ssl-mutual",
            "--grpc-server-cert", str(tmp_path / "s.crt"),
            "--grpc-server-key", str(tmp_path / "s.key"),
            "--grpc-root-cert", str(tmp_path / "ca.crt"),
        ],
        tmp_path,
    )  # fmt: skip
    assert up.public_tls is not None and up.public_tls.mutual
    assert child.public_tls == up.public_tls


def test_inconsistent_flags_are_refused(tmp_path) -> None:
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="needs --grpc-server-cert"):
        tls_from(parse(["up", "--grpc-use-ssl=true"]))
    with pytest.raises(ValueError, match="needs --grpc-root-cert"):
        tls_from(
            parse(
                ["up", "--grpc-use-ssl-mutual", "--grpc-server-cert", "a", "--grpc-server-key", "b"]
            )
        )
    with pytest.raises(ValueError, match="more than once"):
        restrictions_from(
            parse(["up", "--grpc-restricted-protocol=statistics:a=1",
                   "--grpc-restricted-protocol=statistics:b=2"])
        )  # fmt: skip
    assert tls_from(parse(["up", "--grpc-use-ssl=false"])) is None


def test_an_http_restriction_uses_the_key_itself_as_header() -> None:
    r = parse_http_restriction("inference,health:Admin-Key=s3cret")
    assert r.groups == {"inference", "health"}
    assert (r.header, r.value) == ("admin-key", "s3cret")
    with pytest.raises(ValueError, match="--http-restricted-api option format is"):
        parse_http_restriction("inference")


def test_http_restrictions_travel_to_the_gateway_child(tmp_path) -> None:
    up, child = _gateway_child(["up", "--http-restricted-api=statistics:k=v"], tmp_path)
    assert child.http_restrictions == up.http_restrictions
    assert [r.header for r in up.http_restrictions] == ["k"]
    assert child.grpc_restrictions == () and child.public_tls is None
