"""`--http-port`, `--http-address`, `--allow-http` as tritonserver takes them."""

from __future__ import annotations

import pytest

from stageserve.cli import _http_listen, build_parser


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_http_defaults_to_8000_on_every_address(command: str) -> None:
    extra = ["--model-repository", "/m", "--redis-url", "redis://r"] if command == "gateway" else []
    args = build_parser().parse_args([command, *extra])
    assert _http_listen(args) == "0.0.0.0:8000"


@pytest.mark.parametrize(
    ("flags", "listen"),
    [
        (["--http-port", "9000", "--http-address", "127.0.0.1"], "127.0.0.1:9000"),
        (["--allow-http"], "0.0.0.0:8000"),
        (["--allow-http", "true"], "0.0.0.0:8000"),
        (["--allow-http", "false"], None),
        (["--allow-http=0"], None),
    ],
)
def test_http_flags(flags: list[str], listen: str | None) -> None:
    assert _http_listen(build_parser().parse_args(["up", *flags])) == listen


def test_allow_http_rejects_other_words() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--allow-http", "maybe"])
