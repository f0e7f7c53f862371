"""Triton's rate limiter flags, stdlib only (the CLI parses them without the
serving dependencies): parsed once into the settings tree's ratelimiter
section (RateLimiterSettings.mode and .resources), and written again from it
for the rate limiter child of `stageserve up`."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

OFF = "off"
EXECUTION_COUNT = "execution_count"
RATE_LIMIT_MODES = (OFF, EXECUTION_COUNT)


def parse_resource_flag(text: str) -> tuple[str, int]:
    """`--rate-limit-resource=<name>:<count>[:<device>]` -> (override field, count).

    The field is "name" (every device, and global resources) or "name@device"."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"--rate-limit-resource '{text}': expected <name>:<count>[:<device>]")
    try:
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(f"--rate-limit-resource '{text}': count and device are integers") from None
    if count < 0:
        raise ValueError(f"--rate-limit-resource '{text}': count must be >= 0")
    return (parts[0] if device is None else f"{parts[0]}@{device}"), count


def add_rate_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rate-limit",
        choices=RATE_LIMIT_MODES,
        default=OFF,
        help="Triton's --rate-limit: off (default: one payload per instance, resources "
        "ignored) or execution_count (instances run only while holding their "
        "rate_limiter resources, picked by priority)",
    )
    parser.add_argument(
        "--rate-limit-resource",
        action="append",
        default=[],
        metavar="<name>:<count>[:<device>]",
        help="repeatable; a resource's available count (default: the largest count any "
        "instance asks for); without <device> it applies to every device",
    )


def resource_overrides(flags: list[str]) -> dict[str, int]:
    """The parsed --rate-limit-resource flags; raises ValueError on a bad one."""
    return dict(parse_resource_flag(f) for f in flags)


def resource_flag(field: str, count: int) -> str:
    """The --rate-limit-resource value that parses back to (field, count)."""
    name, at, device = field.rpartition("@")
    if at and name and device.isdigit():
        return f"{name}:{count}:{device}"
    return f"{field}:{count}"


def rate_limit_argv(mode: str, resources: Iterable[tuple[str, int]]) -> list[str]:
    """The rate limiter section's flags again (RateLimiterSettings.mode and
    .resources), for the `stageserve ratelimiter` child of `up`."""
    out = ["--rate-limit", mode]
    for field, count in resources:
        out += ["--rate-limit-resource", resource_flag(field, count)]
    return out
