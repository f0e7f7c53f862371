"""Building blocks of the sequence batcher's strategy (sequence_strategy.py),
pure (no I/O, time passed in), unit-tested on their own.

- `ready_in_age_order`: which sequences may put a request in the next batch
  (their head request is listed in Redis, none of theirs is executing, no
  retry pending), oldest head first; the oldest strategy takes them as they
  come.
- `DirectSlots`: the direct strategy's slots. A sequence owns a batch slot
  from its START to its END or idle timeout; START on an active id starts it
  over; a START waits while every slot is taken. With G instance groups,
  slot s is row s // G of group s % G's batches (`layout`), gaps are
  padding.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Generic, TypeVar

R = TypeVar("R")


def ready_in_age_order(
    heads: Iterable[tuple[str, bool, int]],
    running: Collection[str],
    retry_at: Mapping[str, float],
    now: float,
) -> list[str]:
    """heads: (sequence, its head request is listed, head's enqueue ns)."""
    ready = [
        (enqueue_ns, cid)
        for cid, listed, enqueue_ns in heads
        if listed and cid not in running and retry_at.get(cid, 0.0) <= now
    ]
    return [cid for _, cid in sorted(ready, key=lambda x: x[0])]


class DirectSlots(Generic[R]):
    def __init__(self) -> None:
        self._slots: dict[str, tuple[int, float]] = {}  # sequence -> (slot, last use)

    def __contains__(self, cid: str) -> bool:
        return cid in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def taken(self) -> set[int]:
        return {slot for slot, _ in self._slots.values()}

    def slot(self, cid: str, default: int = -1) -> int:
        return self._slots.get(cid, (default, 0.0))[0]

    def free_idle(self, now: float, idle_s: float, busy: Callable[[str], bool]) -> None:
        """Slots of sequences idle longer than idle_s (and not busy) come free."""
        for cid, (_, last) in list(self._slots.items()):
            if now - last > idle_s and not busy(cid):
                del self._slots[cid]

    def free_slot(self, capacity: int) -> int | None:
        used = self.taken()
        return next((s for s in range(capacity) if s not in used), None)

    def admit(self, cid: str, start: bool, capacity: int, now: float) -> bool:
        """Whether the sequence has a slot for its head request (taking a free
        one if needed). START on an active id gives up its old slot first."""
        if start:
            self._slots.pop(cid, None)
        if cid in self._slots:
            return True
        slot = self.free_slot(capacity)
        if slot is None:
            return False
        self._slots[cid] = (slot, now)
        return True

    def admit_at(self, cid: str, slot: int, groups: int, capacity: int, now: float) -> bool:
        """Give a sequence unknown here the slot it had (at the model's
        previous owner), or when another sequence holds that one the lowest
        free slot of its group (slot % groups: the same instance); False:
        none of them is free."""
        if cid in self._slots or not 0 <= slot < capacity:
            return False
        used = self.taken()
        free = (s for s in range(slot % groups, capacity, groups) if s not in used)
        chosen = slot if slot not in used else next(free, None)
        if chosen is None:
            return False
        self._slots[cid] = (chosen, now)
        return True

    def touch(self, cid: str, now: float) -> None:
        if cid in self._slots:
            self._slots[cid] = (self._slots[cid][0], now)

    def release(self, cid: str) -> None:
        self._slots.pop(cid, None)

    def next_idle_expiry(self, running: Collection[str], idle_s: float) -> float | None:
        """When the least recently used slot not running times out (None: none)."""
        idle = [last for cid, (_, last) in self._slots.items() if cid not in running]
        return min(idle) + idle_s if idle else None

    def layout(self, claimed: list[tuple[str, R, int]], groups: int) -> list[R | None]:
        """Batch rows for (sequence, row, slot it claimed with) of one group's
        batch: slot s is row s // groups, gaps are None (padding); a row whose
        slot clashes or is unknown (e.g. after a restart) takes the first gap,
        or goes at the end."""
        by_slot: dict[int, R] = {}
        spill: list[R] = []
        for cid, row, claimed_slot in claimed:
            slot = self.slot(cid, claimed_slot)
            index = slot // groups if slot >= 0 else -1
            if index >= 0 and index not in by_slot:
                by_slot[index] = row
            else:
                spill.append(row)
        rows: list[R | None] = [by_slot.get(i) for i in range(max(by_slot, default=-1) + 1)]
        for row in spill:
            gap = rows.index(None) if None in rows else len(rows)
            if gap == len(rows):
                rows.append(row)
            else:
                rows[gap] = row
        return rows
