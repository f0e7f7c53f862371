"""The id of one hosted model instance, built by the worker and read by the gateway.

``<worker>/<model>/<version>/g<generation>/<group>/<index>``: the worker that
hosts it, the model version and the load generation it belongs to, and its
place in the model's instance groups. The gateway reads the generation back
to tell a reload's new instances from the old ones it replaces.

Model names never contain "/" (stageserve.names); a worker id or an
instance_group name may, so there "%" and "/" are escaped and every id
splits into exactly six fields.
"""

from __future__ import annotations

from dataclasses import dataclass


class InstanceIdError(ValueError):
    """A string that is not an instance id."""


@dataclass(frozen=True)
class InstanceId:
    worker: str
    model: str
    version: int
    generation: int
    group: str
    index: int

    def __str__(self) -> str:
        return "/".join(
            (
                _escape(self.worker),
                self.model,
                str(self.version),
                f"g{self.generation}",
                _escape(self.group),
                str(self.index),
            )
        )


def instance_id(
    worker: str, model: str, version: int, generation: int, group: str, index: int
) -> str:
    """The id of instance `index` of `group` for one load of a model version."""
    return str(InstanceId(worker, model, version, generation, group, index))


def parse_instance_id(text: str) -> InstanceId:
    """The fields of an id `instance_id` built; InstanceIdError otherwise."""
    parts = text.split("/")
    if len(parts) != 6 or not parts[3].startswith("g"):
        raise InstanceIdError(f"not an instance id: {text!r}")
    worker, model, version, generation, group, index = parts
    try:
        return InstanceId(
            _unescape(worker),
            model,
            int(version),
            int(generation[1:]),
            _unescape(group),
            int(index),
        )
    except ValueError:
        raise InstanceIdError(f"not an instance id: {text!r}") from None


def generation_of(text: str) -> int | None:
    """The load generation an instance id carries, or None when it is not one."""
    try:
        return parse_instance_id(text).generation
    except InstanceIdError:
        return None


def _escape(field: str) -> str:
    return field.replace("%", "%25").replace("/", "%2F")


def _unescape(field: str) -> str:
    return field.replace("%2F", "/").replace("%25", "%")
