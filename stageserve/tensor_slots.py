"""The slot table of one shared-memory tensor region: pure, no I/O.

A region's data area is split into `len(tags)` slots of `slot_size` bytes; a
tensor takes an extent of consecutive slots. Each slot has a tag (0: free,
else the pid of the process that will free it), the time it was taken and
the generation of the allocation that took it (a counter of the owner's,
never reused): a reader that finds its extent's generation changed after it
read the bytes knows the owner freed them meanwhile and handed them to
another tensor (`retaken`).

The table lives in the region itself (two numpy arrays over the mapping), so
the process that reads an extent frees it by zeroing its tags, with no
message back to the owner: the owner only ever turns a 0 tag into a pid, a
consumer only ever turns its own pid back into 0. A torn view while both
run can only make the owner see fewer free slots than there are, never hand
out a slot in use. Tests pass plain numpy arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

#: Extents of up to this many slots are read and set item by item.
SHORT_EXTENT = 8


class SlotTable:
    """alloc / free / count over a tag array (uint32), a stamp array (uint64,
    ns) and a generation array (uint64; its own zeros when not given)."""

    def __init__(
        self,
        tags: np.ndarray,
        stamps: np.ndarray,
        slot_size: int,
        gens: np.ndarray | None = None,
    ) -> None:
        if gens is None:
            gens = np.zeros(tags.shape, np.uint64)
        if tags.shape != stamps.shape or tags.shape != gens.shape or slot_size <= 0:
            raise ValueError("tags, stamps and gens must match, slot_size must be positive")
        self.tags = tags
        self.stamps = stamps
        self.gens = gens
        # The same slots as items: an extent of a few slots is read and set
        # item by item through these (a numpy slice assignment costs ~0.7 us
        # however short, a memoryview item ~0.16: timeit on the 2-core VM).
        self._tag_items = tags.data
        self._stamp_items = stamps.data
        self._gen_items = gens.data
        self.slot_size = slot_size
        # the last generation handed out: a region is new with each owner
        # process (its name carries the pid), so one counter a table suffices
        self._generation = int(gens.max()) if gens.size else 0
        self._cursor = 0  # next-fit: the search starts after the last extent handed out
        self._lock = threading.Lock()  # a worker's instance threads allocate concurrently

    @property
    def slots(self) -> int:
        return int(self.tags.shape[0])

    def alloc(self, nbytes: int, tag: int, now_ns: int) -> int | None:
        """The first slot of a free extent for `nbytes`, now tagged `tag`;
        None when no extent that long is free (the caller falls back)."""
        if tag <= 0:
            raise ValueError("a tag is a positive pid")
        need = extent_slots(nbytes, self.slot_size)
        if need > self.slots:
            return None
        with self._lock:
            start = self._cursor
            # Next-fit: slots are mostly given back in the order they were
            # taken, so the extent at the cursor is usually free; checking it
            # first is cheap: timeit on the 2-core VM, one alloc + free at the
            # cursor ~3 us, through the full search (numpy over every tag) ~6.
            if start + need > self.slots or not self._free_at(start, need):
                found = self._find(need)
                if found is None:
                    return None
                start = found
            end = start + need
            self._generation += 1
            generation = self._generation
            # the generation before the tag, and both before the caller writes
            # the bytes: a reader that sees its old generation after reading
            # read bytes nobody had been handed yet
            if need <= SHORT_EXTENT:
                gens, stamps, tags = self._gen_items, self._stamp_items, self._tag_items
                for i in range(start, end):
                    gens[i] = generation
                for i in range(start, end):
                    stamps[i] = now_ns
                for i in range(start, end):
                    tags[i] = tag
            else:
                self.gens[start:end] = generation
                self.stamps[start:end] = now_ns
                self.tags[start:end] = tag
            self._cursor = end % self.slots
            return start

    def _free_at(self, start: int, need: int) -> bool:
        if need <= SHORT_EXTENT:  # item reads: a numpy reduction costs ~2.7 us however short
            tags = self._tag_items
            return not any(tags[i] for i in range(start, start + need))
        return not self.tags[start : start + need].any()

    def _find(self, need: int) -> int | None:
        free = self.tags == 0
        if need == 1:
            hits = np.flatnonzero(free[self._cursor :])
            if hits.size:
                return self._cursor + int(hits[0])
            hits = np.flatnonzero(free[: self._cursor])
            return int(hits[0]) if hits.size else None
        # runs of `need` free slots: a window whose free count is `need`
        counts = np.convolve(free.astype(np.int32), np.ones(need, dtype=np.int32), "valid")
        starts = np.flatnonzero(counts == need)
        if not starts.size:
            return None
        after = starts[starts >= self._cursor]
        return int(after[0] if after.size else starts[0])

    def generation(self, start: int) -> int:
        """The generation of the extent at `start` (read by its owner right
        after `alloc`, while it holds the extent)."""
        return int(self._gen_items[start])

    def free(self, start: int, nbytes: int) -> None:
        """Give back the extent at `start` that held `nbytes`."""
        if not 0 <= start < self.slots:
            raise ValueError(f"slot {start} is outside the table of {self.slots}")
        end = min(start + extent_slots(nbytes, self.slot_size), self.slots)
        if end - start <= SHORT_EXTENT:
            tags = self._tag_items
            for i in range(start, end):
                tags[i] = 0
        else:
            self.tags[start:end] = 0

    def in_use(self) -> int:
        return int(np.count_nonzero(self.tags))

    def reclaim(self, dead: Callable[[int], bool], older_than_ns: int | None = None) -> int:
        """Free every slot whose tag's process is `dead`, and (with
        `older_than_ns`) every slot taken before that time; the count freed."""
        with self._lock:
            held = self.tags != 0
            lost = np.zeros_like(held)
            for pid in np.unique(self.tags[held]):
                if dead(int(pid)):
                    lost |= self.tags == pid
            if older_than_ns is not None:
                lost |= held & (self.stamps < older_than_ns)
            self.tags[lost] = 0
            return int(np.count_nonzero(lost))


def extent_slots(nbytes: int, slot_size: int) -> int:
    """How many slots an extent of `nbytes` takes (at least one)."""
    return max(1, -(-nbytes // slot_size))


def retaken(gens: np.ndarray, start: int, end: int, generation: int) -> bool:
    """Some slot of gens[start:end] differs from `generation` (the check a
    reader with a read-only mapping makes too)."""
    if end - start <= SHORT_EXTENT:  # item reads: a numpy reduction costs ~2.7 us
        items = gens.data
        return any(items[i] != generation for i in range(start, end))
    return not bool((gens[start:end] == generation).all())
