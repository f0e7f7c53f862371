"""`--exit-on-error` / `--strict-readiness`: tritonserver's spelling and defaults (both true)."""

from __future__ import annotations

import pytest

from stageserve.cli import build_parser


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_defaults_are_tritons(command: str) -> None:
    extra = ["--model-repository", "m", "--redis-url", "redis://x"] if command == "gateway" else []
    args = build_parser().parse_args([command, *extra])
    assert args.exit_on_error is True
    assert args.strict_readiness is True


@pytest.mark.parametrize(
    ("given", "expected"),
    [(["--exit-on-error", "false"], False), (["--exit-on-error=0"], False),
     (["--exit-on-error"], True), (["--exit-on-error", "true"], True)],
)  # fmt: skip
def test_boolean_values_as_tritonserver_takes_them(given: list[str], expected: bool) -> None:
    args = build_parser().parse_args(["up", *given, "--strict-readiness=false"])
    assert args.exit_on_error is expected
    assert args.strict_readiness is False


def test_a_bad_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", "--strict-readiness", "maybe"])
    assert exc.value.code == 2
    assert "invalid value for bool option: " in capsys.readouterr().err
