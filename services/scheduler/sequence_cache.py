"""The states a scheduler last committed for its sequences: pure, time passed in.

While a scheduler owns a model without a break (one shard term,
shard_lua.py), no other scheduler runs the model's sequences, so the state
a sequence's last batch here committed to Redis is still the state in
Redis. The next request of that sequence then runs with the kept copy: no
backlog listing and no claim, one Redis call per batch (the commit), where
a sequence's request otherwise costs three. The commit checks the term, so
a copy from an older term never overwrites what another owner kept
(sequence_lua.SEQUENCE_COMMIT).

A copy is used only within its term and within the sequence's idle time
from the commit that kept it (Redis expires the sequence no sooner), and at
most `capacity` sequences are kept, least recently committed dropped first.
Sequences that stay here are the ones the model's traffic keeps busy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class Kept(NamedTuple):  # (a tuple: built on every sequence batch's commit, per row)
    term: str
    slot: int
    states: dict[str, bytes]  # state output name -> raw, as committed
    shapes: dict[str, tuple[int, ...]]
    until: float  # monotonic s: the sequence surely has not idled out before


class SequenceCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, cid: str, term: str | None, now: float) -> Kept | None:
        """The kept states of `cid`, if they are still Redis's."""
        kept = self._kept.get(cid)
        if kept is None or term is None:
            return None
        if kept.term != term or now >= kept.until:
            del self._kept[cid]
            return None
        return kept

    def put(self, cid: str, kept: Kept) -> None:
        if self.capacity <= 0:
            return
        self._kept[cid] = kept
        self._kept.move_to_end(cid)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def drop(self, cid: str) -> None:
        self._kept.pop(cid, None)

    def clear(self) -> None:
        self._kept.clear()
