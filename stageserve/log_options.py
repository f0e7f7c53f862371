"""Triton's log flags (--log-verbose is cli.py's), read into a LogSettings.

tritonserver's --log-info, --log-warning, --log-error, --log-format and
--log-file, with its defaults. Each is a stage's own startup setting; what the
LogSettings RPC or POST /v2/logging changes (stack-wide, in Redis) goes over
it (stageserve/log_follow.py).
"""

from __future__ import annotations

import argparse

from stageserve.log_settings import DEFAULT_FORMAT, FORMATS, LogSettings

# The commands whose process follows the stack's log settings.
STAGES = ("gateway", "scheduler", "ratelimiter", "worker")


def flag_bool(text: str) -> bool:
    """tritonserver's boolean flag values."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid value for bool option: {text}")


def add_log_flags(p: argparse.ArgumentParser) -> None:
    for kind in ("info", "warning", "error"):
        p.add_argument(
            f"--log-{kind}",
            type=flag_bool,
            nargs="?",
            const=True,
            default=True,
            help=f"log {kind} records (as tritonserver: true|false)",
        )
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default=DEFAULT_FORMAT,
        help="default: one JSON object per line; ISO8601: Triton's ISO8601 text line",
    )
    p.add_argument("--log-file", default="", help="append the log to this file (default stderr)")


def log_settings_of(args: argparse.Namespace) -> LogSettings:
    return LogSettings(
        log_file=args.log_file,
        log_info=args.log_info,
        log_warning=args.log_warning,
        log_error=args.log_error,
        log_verbose_level=max(args.log_verbose, 0),
        log_format=args.log_format,
    )


def log_argv(settings: LogSettings) -> list[str]:
    """The log flags that give a stage `settings` (--log-verbose aside: the
    launcher passes that one), for `stageserve up` to hand every stage it
    starts, and starts again."""
    argv = [
        *(
            f"--log-{k}={str(getattr(settings, f'log_{k}')).lower()}"
            for k in ("info", "warning", "error")
        ),
        f"--log-format={settings.log_format}",
    ]
    if settings.log_file:
        argv.append(f"--log-file={settings.log_file}")
    return argv
