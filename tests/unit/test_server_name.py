"""ServerMetadata's name: "triton" by default (Triton's client examples check it),
set with --server-name on `stageserve up` and `stageserve gateway`."""

from __future__ import annotations

from typing import Any, cast

import pytest

from services.gateway.dataplane import DataPlane
from stageserve.cli import build_parser
from stageserve.settings import settings_from


def _metadata_name(**kwargs: Any) -> str:
    dataplane = DataPlane(cast(Any, None), cast(Any, None), cast(Any, None), **kwargs)
    try:
        return dataplane.server_metadata().name
    finally:
        dataplane.overrides.close()


def test_the_default_name_is_tritons() -> None:
    assert _metadata_name() == "triton"


def test_a_server_name_is_answered() -> None:
    assert _metadata_name(server_name="acme-inference") == "acme-inference"


@pytest.mark.parametrize(
    "argv",
    [["up"], ["gateway", "--model-repository", "/r", "--redis-url", "redis://x"]],
)
def test_the_flag_on_up_and_gateway(argv: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(argv).server_name == "triton"
    assert parser.parse_args([*argv, "--server-name", "acme"]).server_name == "acme"
    # the gateway reads it from its settings tree
    assert settings_from(parser.parse_args(argv)).gateway.server_name == "triton"
    named = settings_from(parser.parse_args([*argv, "--server-name", "acme"]))
    assert named.gateway.server_name == "acme"
