"""Which model instance runs which of a sequence model's slot groups: a pure
state machine (no I/O, time passed in), unit-tested on its own.

Triton runs every request of a sequence on the model instance the sequence
was given at its start: a Python model may keep a sequence's state in its
instance. The sequence batcher's slots come in groups, one per instance the
model's config asks for (sequence_strategy.py: slot s belongs to group
s % groups, as Triton hands out the lowest free slot index across its
instances). A group is pinned to the instance that ran its first batch and
stays there while any of its slots is taken; an empty group comes unpinned
and goes to whichever instance runs it next.

The scheduler learns instances from the rate limiter's grants, so the pins
become a filter on grants (`InstanceFilter`): work of pinned groups needs
their instances (`only`); work of an unpinned group goes to an instance
holding no group with nothing to do (`other_than`), so groups spread over
the instances as in Triton. When every instance holds a group (more groups
than live instances: an instance's worker died, or fewer workers serve the
model than its config counts), the rate limiter grants one of them anyway;
the queue is `crowded` for a moment and that instance takes the group on
too. An instance that went away (`forget`) leaves its groups unpinned.

The pins outlive the scheduler that holds them: its sequence adapter saves
them in Redis when they change (`version`, `snapshot`), and the model's next
owner takes them up (`adopt`) with the slots of the sequences it continues
(sequence_queue.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# How long, after the rate limiter granted a pinned instance for an unpinned
# group, any instance may take unpinned groups: long enough for the queue to
# form that batch, short enough that an instance coming back is used soon.
CROWDED_S = 1.0


@dataclass(frozen=True, slots=True)
class InstanceFilter:
    """Which instances a grant may name: one of `only` when it is not
    empty, else any not in `other_than`."""

    only: frozenset[str] = frozenset()
    other_than: frozenset[str] = frozenset()

    def fits(self, instance: str) -> bool:
        if self.only:
            return instance in self.only
        return instance not in self.other_than


class InstancePins:
    def __init__(self, groups: int) -> None:
        self.groups = max(1, groups)
        self._pin: dict[int, str] = {}  # group -> instance
        self._crowded_until = 0.0
        self.version = 0  # counts the changes, for whoever saves them

    def group_of(self, slot: int) -> int:
        return slot % self.groups

    def instance_of(self, group: int) -> str | None:
        return self._pin.get(group)

    def groups_on(self, instance: str) -> set[int]:
        return {g for g, i in self._pin.items() if i == instance}

    def pin(self, group: int, instance: str) -> None:
        if self._pin.get(group) != instance:
            self._pin[group] = instance
            self.version += 1

    def _unpin(self, groups: Collection[int]) -> None:
        for group in groups:
            del self._pin[group]
        if groups:
            self.version += 1

    def forget(self, instance: str) -> None:
        """The instance is gone: its groups go to whichever instance runs them next."""
        self._unpin(self.groups_on(instance))

    def clear(self) -> None:
        self._unpin(list(self._pin))

    def keep_only(self, occupied: Collection[int]) -> None:
        """Groups with no taken slot come unpinned."""
        self._unpin([g for g in self._pin if g not in occupied])

    def snapshot(self) -> dict[int, str]:
        return dict(self._pin)

    def adopt(self, saved: dict[int, str]) -> None:
        """Pins a previous owner saved, for the groups not pinned here."""
        for group, instance in saved.items():
            if 0 <= group < self.groups and group not in self._pin:
                self.pin(group, instance)

    def crowd(self, now: float) -> None:
        """The rate limiter granted a pinned instance for an unpinned group
        (no other instance is registered): any instance takes unpinned groups
        for CROWDED_S."""
        self._crowded_until = now + CROWDED_S

    def crowded(self, now: float) -> bool:
        return now < self._crowded_until

    def may_adopt(self, instance: str, now: float) -> bool:
        """Whether the instance may take an unpinned group on."""
        return instance not in self._pin.values() or self.crowded(now)

    def filter(self, eligible: Collection[int], now: float) -> InstanceFilter | None:
        """The grants that can run a batch of the `eligible` groups (groups
        holding a sequence whose next request may run); None: any grant."""
        pinned = self._pin
        needed = {pinned[g] for g in eligible if g in pinned}
        if all(g in pinned for g in eligible):
            return InstanceFilter(only=frozenset(needed)) if needed else None
        if self.crowded(now):
            return None
        idle = frozenset(pinned.values()) - needed
        return InstanceFilter(other_than=idle) if idle else None
