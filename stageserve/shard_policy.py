"""Which scheduler owns a model: a pure, pluggable assignment policy.

A policy maps a model name and the live schedulers to one owner. The adapter
(stageserve/shard_map.py) keeps the answer in Redis as leases; this module
only decides, so a policy is a few lines and unit-testable alone (as Ray
Serve keeps its routing policies small and swappable).

The default, rendezvous (highest random weight) hashing, scores every
(scheduler, model) pair with a hash and gives the model to the highest score.
It is stable: a scheduler joining takes only the models it now scores highest
on (about 1/N of them) and a scheduler leaving frees only its own; every
other model stays where it is, so its queue and batches are undisturbed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol


class ShardPolicy(Protocol):
    def owner(self, model: str, schedulers: Iterable[str]) -> str | None:
        """The scheduler id that should own `model` (None: no scheduler)."""
        ...


def _score(scheduler: str, model: str) -> int:
    digest = hashlib.blake2b(f"{scheduler}\0{model}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Rendezvous:
    """Highest random weight: the same answer on every process for the same
    inputs, whatever order the schedulers are listed in."""

    def owner(self, model: str, schedulers: Iterable[str]) -> str | None:
        best: tuple[int, str] | None = None
        for scheduler in schedulers:
            candidate = (_score(scheduler, model), scheduler)
            if best is None or candidate > best:
                best = candidate
        return None if best is None else best[1]


DEFAULT_POLICY: ShardPolicy = Rendezvous()


def assign(
    models: Iterable[str], schedulers: Iterable[str], policy: ShardPolicy = DEFAULT_POLICY
) -> dict[str, str]:
    """model -> owner for every model (none when there is no scheduler)."""
    live = sorted(set(schedulers))
    if not live:
        return {}
    out: dict[str, str] = {}
    for model in models:
        owner = policy.owner(model, live)
        if owner is not None:
            out[model] = owner
    return out
