"""The log flags `stageserve up` hands its stages parse back to its settings."""

from __future__ import annotations

import argparse

import pytest

from stageserve.log_options import add_log_flags, log_argv, log_settings_of
from stageserve.log_settings import LogSettings


def _parsed(argv: list[str]) -> LogSettings:
    p = argparse.ArgumentParser()
    p.add_argument("--log-verbose", type=int, default=0)
    add_log_flags(p)
    return log_settings_of(p.parse_args(argv))


@pytest.mark.parametrize(
    "settings",
    [
        LogSettings(),
        LogSettings(log_info=False, log_format="ISO8601"),
        LogSettings(log_warning=False, log_error=False, log_file="/tmp/stack.log"),
    ],
)
def test_log_argv_round_trips(settings: LogSettings) -> None:
    assert _parsed(log_argv(settings)) == settings


def test_log_argv_from_a_triton_command_line() -> None:
    settings = _parsed(["--log-info", "false", "--log-format", "ISO8601", "--log-file", "x.log"])
    assert log_argv(settings) == [
        "--log-info=false",
        "--log-warning=true",
        "--log-error=true",
        "--log-format=ISO8601",
        "--log-file=x.log",
    ]
