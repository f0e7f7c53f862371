"""`--schedulers N|auto`: how many schedulers `stageserve up` starts.

A scheduler is one asyncio process, so it uses at most one core, and it
shards by model: more schedulers help a repository with several busy
models, never one hot model (docs/architecture.md, "Schedulers sharded by
model"). `auto` gives one scheduler per 8 usable cores, at least one: on
the 2-core development machine 1, on the 16-core GPU host 2, leaving the
other cores to gateways and workers, which carry more CPU per inference
(docs/benchmarks.md: per-stage CPU per inference).
"""

from __future__ import annotations

import os

from stageserve.gpus import parse_count

AUTO = "auto"
CORES_PER_SCHEDULER = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_schedulers(cores: int) -> int:
    return max(1, cores // CORES_PER_SCHEDULER)


def parse_schedulers(text: str) -> int | str:
    """argparse type of --schedulers: a positive count or 'auto'."""
    return parse_count(text, "scheduler")


def scheduler_count(value: int | str) -> int:
    """The count `--schedulers` stands for on this host."""
    return auto_schedulers(usable_cores()) if value == AUTO else int(value)
