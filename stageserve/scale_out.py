"""How many gateway processes `stageserve up --gateways N|auto` starts.

Several gateways share the public gRPC and HTTP ports (SO_REUSEPORT: the
kernel spreads new connections over them), in front of the same scheduler,
workers and Redis. `auto` follows the rule and the measurement recorded in
stageserve/settings.py (StackSettings): one gateway per
`auto_gateway_cores` usable cores, between 1 and `auto_gateways_max`.
"""

from __future__ import annotations

import os

from stageserve.gpus import parse_count
from stageserve.settings import StackSettings

AUTO = "auto"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's
    cpuset or a `taskset` limits it), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def auto_gateways(cores: int, settings: StackSettings) -> int:
    """`--gateways auto` on a host with `cores` usable cores."""
    per = max(1, settings.auto_gateway_cores)
    return max(1, min(cores // per, settings.auto_gateways_max))


def gateway_count(gateways: int | str, settings: StackSettings, cores: int | None = None) -> int:
    """The number of gateways to start for `--gateways` (a count or auto)."""
    if gateways == AUTO:
        return auto_gateways(usable_cores() if cores is None else cores, settings)
    count = int(gateways)
    if count < 1:
        raise ValueError(f"--gateways must be >= 1 or '{AUTO}', got {gateways}")
    return count


def parse_gateways(text: str) -> int | str:
    """argparse type of --gateways: a positive count or 'auto'."""
    return parse_count(text, "gateway")
