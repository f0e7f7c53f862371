"""services/scheduler/sequence_cache.py: kept states are used only within
their term and idle time, and the oldest go first past capacity."""

from __future__ import annotations

from services.scheduler.sequence_cache import Kept, SequenceCache


def kept(term: str = "t1", until: float = 10.0, raw: bytes = b"\x01") -> Kept:
    return Kept(term, 2, {"S": raw}, {"S": (1,)}, until)


def test_a_copy_is_used_within_its_term_and_idle_time_only() -> None:
    cache = SequenceCache(4)
    cache.put("a", kept())
    assert cache.get("a", "t1", 9.9) == kept()
    assert cache.get("a", None, 1.0) is None  # no term: not owned now
    assert cache.get("a", "t1", 1.0) is not None  # (still kept)
    assert cache.get("a", "t2", 1.0) is None  # another term: dropped
    assert cache.get("a", "t1", 1.0) is None
    cache.put("b", kept())
    assert cache.get("b", "t1", 10.0) is None  # idled out: dropped
    assert len(cache) == 0


def test_past_capacity_the_least_recently_committed_goes() -> None:
    cache = SequenceCache(2)
    cache.put("a", kept())
    cache.put("b", kept())
    cache.put("a", kept(raw=b"\x02"))  # committed again: the most recent
    cache.put("c", kept())
    assert cache.get("b", "t1", 0.0) is None
    assert cache.get("a", "t1", 0.0) == kept(raw=b"\x02")
    assert cache.get("c", "t1", 0.0) is not None
    cache.drop("a")
    assert cache.get("a", "t1", 0.0) is None
    cache.clear()
    assert len(cache) == 0


def test_capacity_zero_keeps_nothing() -> None:
    cache = SequenceCache(0)
    cache.put("a", kept())
    assert cache.get("a", "t1", 0.0) is None
