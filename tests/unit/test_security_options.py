"""Parsing Triton's security flags (stageserve/security_options.py)."""

from __future__ import annotations

import pytest

from stageserve.cli import build_parser
from stageserve.security_options import (
    gateway_flags,
    http_restrictions_from,
    parse_http_restriction,
    parse_restriction,
    restrictions_from,
    tls_from,
)


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


def test_flags_parse_and_travel_to_the_gateway_child(tmp_path) -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--grpc-use-ssl",
            "--grpc-server-cert", str(tmp_path / "s.crt"),
            "--grpc-server-key", str(tmp_path / "s.key"),
            "--grpc-restricted-protocol=statistics:k=v",
        ]
    )  # fmt: skip
    tls = tls_from(args)
    assert tls is not None and not tls.mutual and tls.root_cert is None
    assert [r.groups for r in restrictions_from(args)] == [{"statistics"}]
    again = build_parser().parse_args(
        [
            "gateway",
            "--model-repository",
            str(tmp_path),
            "--redis-url",
            "redis://x",
            *gateway_flags(args),
        ]
    )
    assert tls_from(again) == tls and restrictions_from(again) == restrictions_from(args)


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
    args = build_parser().parse_args(["up", "--http-restricted-api=statistics:k=v"])
    again = build_parser().parse_args(
        ["gateway", "--model-repository", str(tmp_path), "--redis-url", "redis://x",
         *gateway_flags(args)]
    )  # fmt: skip
    assert http_restrictions_from(again) == http_restrictions_from(args)
    assert [r.header for r in http_restrictions_from(args)] == ["k"]
