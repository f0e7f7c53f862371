"""What a stage's heap settle does (stageserve/heap_freeze.py): garbage goes,
what is alive leaves the collector's walks, and a later settle frees cycles
dropped since the last one."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from stageserve import heap_freeze


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of this pytest process collects as usual


def test_garbage_is_collected_and_what_lives_is_frozen() -> None:
    dropped = weakref.ref(_cycle())  # garbage only the collector frees
    assert dropped() is not None
    kept = _cycle()
    heap_freeze.settle("test")
    assert dropped() is None
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # no collection walks it


def test_a_cycle_dropped_after_a_settle_goes_at_the_next_one() -> None:
    model = _cycle()  # e.g. a model's objects, built at load
    heap_freeze.settle("loaded")
    gone = weakref.ref(model)
    del model  # unloaded: only the collector can free the cycle
    gc.collect()
    assert gone() is not None  # frozen: collections leave it alone
    heap_freeze.settle("unloaded")
    assert gone() is None
