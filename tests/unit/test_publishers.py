"""services/worker/publishers.py: when the published model set is complete
enough for a worker to unload what is missing from it."""

from __future__ import annotations

from services.worker.publishers import PublisherWatch


def test_complete_while_every_gateway_seen_is_marked() -> None:
    watch = PublisherWatch(grace_s=5.0)
    assert watch.observe({"a", "b"}, now=0.0)
    assert watch.observe({"a", "b"}, now=1.0)
    assert watch.waiting_for() == []


def test_no_mark_at_all_is_never_complete() -> None:
    """Redis lost everything and no gateway republished yet: a fresh worker
    too must not read "nothing published" as "unload everything"."""
    assert not PublisherWatch(grace_s=5.0).observe(set(), now=0.0)
    watch = PublisherWatch(grace_s=0.0)
    assert watch.observe({"a"}, now=0.0)
    assert not watch.observe(set(), now=100.0)


def test_a_gateway_marking_first_does_not_complete_the_set_of_another() -> None:
    """The race: Redis comes back empty, gateway c (restarting) marks with
    nothing loaded before gateway a republished its models."""
    watch = PublisherWatch(grace_s=5.0)
    assert watch.observe({"a", "b"}, now=0.0)
    assert not watch.observe({"c"}, now=1.0)  # a and b: missing since 1.0
    assert watch.waiting_for() == ["a", "b"]
    assert not watch.observe({"c", "a"}, now=1.3)  # a republished; b (gone) still awaited
    assert watch.waiting_for() == ["b"]
    assert not watch.observe({"c", "a"}, now=5.9)
    assert watch.observe({"c", "a"}, now=6.0)  # b forgotten 5 s after it was missed
    assert watch.waiting_for() == []


def test_grace_counts_from_when_the_mark_was_first_missed() -> None:
    watch = PublisherWatch(grace_s=2.0)
    watch.observe({"a"}, now=0.0)
    watch.observe(set(), now=10.0)  # last seen long ago: the grace starts now
    assert not watch.observe(set(), now=11.9)
    assert watch.waiting_for() == ["a"]
    assert not watch.observe(set(), now=12.0)  # forgotten, but nothing is marked
    assert watch.waiting_for() == []
    assert watch.observe({"a"}, now=12.5)  # back: remembered again


def test_a_gateway_back_within_the_grace_resets_it() -> None:
    watch = PublisherWatch(grace_s=2.0)
    watch.observe({"a", "b"}, now=0.0)
    assert not watch.observe({"b"}, now=1.0)
    assert watch.observe({"a", "b"}, now=1.5)
    assert not watch.observe({"b"}, now=10.0)  # missed again: a fresh grace
    assert not watch.observe({"b"}, now=11.9)
    assert watch.observe({"b"}, now=12.0)
