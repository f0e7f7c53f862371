"""Which hosted instances a worker unloads, given the published model set (pure).

An instance goes when its model is no longer published, when its version is
neither a loaded nor a draining one, or when a newer generation of its
version is hosted (a reload: the old generation goes only once the new one
is here, so a reload whose files fail to load leaves the old one serving).
A draining version (LoadedModel.draining) is never loaded anew, so its old
instances stay until the gateway drops it from the record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

from stageserve.model_state import LoadedModel


class Hosted(Protocol):
    model: str
    version: int
    generation: int


T = TypeVar("T", bound=Hosted)


def stale_instances(instances: Iterable[T], wanted: Mapping[str, LoadedModel]) -> list[T]:
    instances = list(instances)
    current = {
        (i.model, i.version)
        for i in instances
        if i.model in wanted and i.generation == wanted[i.model].generation
    }
    return [i for i in instances if _stale(i, wanted, current)]


def _stale(inst: Hosted, wanted: Mapping[str, LoadedModel], current: set[tuple[str, int]]) -> bool:
    model = wanted.get(inst.model)
    if model is None:
        return True
    if inst.version in model.draining:
        return False
    if inst.version not in model.versions:
        return True
    return model.generation != inst.generation and (inst.model, inst.version) in current
