"""preserve_ordering: answers leave in dispatch order (pure, unit-tested).

Each request gets a number when its batch is dispatched; an answer is held
until every earlier number has been answered."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ResponseOrder(Generic[T]):
    def __init__(self) -> None:
        self._next_number = 0
        self._next_release = 0
        self._held: dict[int, T] = {}

    def number(self) -> int:
        """The next dispatch number."""
        n = self._next_number
        self._next_number += 1
        return n

    def answered(self, number: int, item: T) -> list[T]:
        """Record an answer; returns the answers that may leave now, in order."""
        if number < self._next_release:
            # dispatched before a reset: its ordering is over (held, it would
            # never leave, as nothing answers the numbers before it again)
            return [item]
        self._held[number] = item
        out = []
        while self._next_release in self._held:
            out.append(self._held.pop(self._next_release))
            self._next_release += 1
        return out

    def reset(self) -> list[T]:
        """Ordering restarts (a reload): every held answer leaves, in order, and
        numbers handed out before no longer wait for one another."""
        out = [self._held[n] for n in sorted(self._held)]
        self._held.clear()
        self._next_release = self._next_number
        return out

    def __len__(self) -> int:
        return len(self._held)
