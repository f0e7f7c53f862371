"""services/scheduler/batcher.py: Triton's default and dynamic batching rules."""

from __future__ import annotations

import random

import pytest

from services.scheduler.batcher import Decision, DefaultBatcher, DynamicBatcher, Pending

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is optional
    given = None  # type: ignore[assignment]  # the property test is left out then

MS = 1_000_000  # ns


def req(tag, batch_size=1, shape="a", t=0):
    return Pending(batch_size=batch_size, shape_key=shape, enqueue_ns=t, payload=tag)


def tags(batch):
    assert batch is not None
    return [p.payload for p in batch]


def fill(batcher, *requests):
    for r in requests:
        batcher.add(r)
    return batcher


# ------------------------------------------------------------------ default


def test_default_empty_queue():
    b = DefaultBatcher()
    assert b.next_batch(0) == Decision(None, None)
    assert len(b) == 0


def test_default_one_request_per_batch_in_order():
    b = fill(DefaultBatcher(), req("x", 4), req("y", 2, shape="other"), req("z"))
    assert len(b) == 3
    assert tags(b.next_batch(0).batch) == ["x"]
    d = b.next_batch(0)
    assert tags(d.batch) == ["y"] and d.wake_at_ns is None
    assert tags(b.next_batch(0).batch) == ["z"]
    assert b.next_batch(0) == Decision(None, None)


# ------------------------------------------------------------------ dynamic basics


def test_dynamic_needs_positive_max_batch_size():
    with pytest.raises(ValueError):
        DynamicBatcher(0)
    with pytest.raises(ValueError):
        DynamicBatcher(-3)


def test_dynamic_empty_queue():
    b = DynamicBatcher(8, (4,), 10 * MS)
    assert b.next_batch(123) == Decision(None, None)


def test_delay_zero_sends_immediately():
    b = fill(DynamicBatcher(8), req("a", t=100), req("b", t=101))
    d = b.next_batch(101)
    assert tags(d.batch) == ["a", "b"]
    assert d.wake_at_ns is None
    assert len(b) == 0


def test_delay_zero_single_request():
    b = fill(DynamicBatcher(8), req("a", t=5))
    assert tags(b.next_batch(5).batch) == ["a"]


def test_waits_until_oldest_plus_delay():
    b = fill(DynamicBatcher(8, (), 10 * MS), req("a", t=1 * MS), req("b", t=4 * MS))
    d = b.next_batch(2 * MS)
    assert d.batch is None
    assert d.wake_at_ns == 11 * MS  # oldest (head) + delay, not the newest
    assert len(b) == 2
    # still early, one ns before the deadline
    assert b.next_batch(11 * MS - 1) == Decision(None, 11 * MS)
    d = b.next_batch(11 * MS)
    assert tags(d.batch) == ["a", "b"]
    assert len(b) == 0


def test_late_call_after_deadline_sends():
    b = fill(DynamicBatcher(8, (), 10 * MS), req("a", t=0))
    assert tags(b.next_batch(500 * MS).batch) == ["a"]


def test_wake_time_follows_new_head():
    b = fill(DynamicBatcher(4, (), 10 * MS), req("a", 3, t=0), req("b", 2, t=5 * MS))
    # b does not fit behind a -> a goes at once (blocked), b stays
    assert tags(b.next_batch(1 * MS).batch) == ["a"]
    d = b.next_batch(6 * MS)
    assert d == Decision(None, 15 * MS)


def test_max_reached_sends_at_once_without_waiting():
    b = fill(DynamicBatcher(4, (), 1_000 * MS), *(req(i, t=i) for i in range(4)))
    d = b.next_batch(4)
    assert tags(d.batch) == [0, 1, 2, 3]
    assert d.wake_at_ns is None


def test_max_reached_takes_only_max_and_leaves_rest():
    b = fill(DynamicBatcher(3, (), 1_000 * MS), *(req(i, t=i) for i in range(7)))
    assert tags(b.next_batch(0).batch) == [0, 1, 2]
    assert tags(b.next_batch(0).batch) == [3, 4, 5]
    d = b.next_batch(0)
    assert d.batch is None and d.wake_at_ns == 6 + 1_000 * MS
    assert len(b) == 1


def test_request_that_does_not_fit_ends_batch():
    b = fill(DynamicBatcher(8, (), 1_000 * MS), req("a", 3), req("b", 3), req("c", 3), req("d", 1))
    d = b.next_batch(0)
    # a+b = 6, c would make 9 > 8: sent at once without waiting, d does not skip c
    assert tags(d.batch) == ["a", "b"]
    assert [p.payload for p in b.queue] == ["c", "d"]


def test_head_larger_than_max_is_sent_alone():
    # The gateway refuses this; the batcher must still make progress.
    b = fill(DynamicBatcher(4, (), 1_000 * MS), req("big", 9), req("small", 1))
    assert tags(b.next_batch(0).batch) == ["big"]
    assert b.next_batch(0) == Decision(None, 1_000 * MS)


def test_different_shape_ends_batch_and_next_call_serves_other_shape():
    b = fill(
        DynamicBatcher(8, (), 1_000 * MS),
        req("a1", shape=(2, 3)),
        req("a2", shape=(2, 3)),
        req("b1", shape=(5,), t=1),
        req("a3", shape=(2, 3), t=2),
    )
    d = b.next_batch(0)
    assert tags(d.batch) == ["a1", "a2"]  # sent at once: the next one cannot join
    d = b.next_batch(0)
    assert tags(d.batch) == ["b1"]  # a3 behind it differs again
    d = b.next_batch(0)
    assert d.batch is None and d.wake_at_ns == 2 + 1_000 * MS
    assert tags(b.next_batch(2 + 1_000 * MS).batch) == ["a3"]


def test_shape_key_compares_by_equality_not_identity():
    b = fill(DynamicBatcher(8), req("a", shape=(("x", (3, 4)),)), req("b", shape=(("x", (3, 4)),)))
    assert tags(b.next_batch(0).batch) == ["a", "b"]


# ------------------------------------------------------------------ preferred sizes


def test_largest_preferred_prefix_is_sent_at_once():
    b = fill(DynamicBatcher(16, (2, 4), 1_000 * MS), *(req(i) for i in range(5)))
    d = b.next_batch(0)
    assert tags(d.batch) == [0, 1, 2, 3]  # 4 preferred, larger than 2
    assert d.wake_at_ns is None
    assert [p.payload for p in b.queue] == [4]


def test_preferred_prefix_smaller_one_when_larger_not_reached():
    b = fill(DynamicBatcher(16, (2, 4), 1_000 * MS), *(req(i) for i in range(3)))
    assert tags(b.next_batch(0).batch) == [0, 1]
    assert b.next_batch(0) == Decision(None, 1_000 * MS)


def test_no_preferred_prefix_waits_then_sends_all_at_deadline():
    b = fill(DynamicBatcher(16, (4, 8), 10 * MS), *(req(i, t=i) for i in range(3)))
    assert b.next_batch(1) == Decision(None, 10 * MS)
    assert len(b) == 3
    assert tags(b.next_batch(10 * MS).batch) == [0, 1, 2]


def test_preferred_skipped_over_by_multi_row_requests():
    # totals go 3, 6: never exactly 4 -> wait
    b = fill(DynamicBatcher(16, (4,), 10 * MS), req("a", 3), req("b", 3))
    assert b.next_batch(0) == Decision(None, 10 * MS)
    assert tags(b.next_batch(10 * MS).batch) == ["a", "b"]


def test_preferred_with_multi_row_requests():
    b = fill(DynamicBatcher(16, (5,), 1_000 * MS), req("a", 2), req("b", 3), req("c", 4))
    assert tags(b.next_batch(0).batch) == ["a", "b"]


def test_blocked_batch_sends_largest_preferred_prefix():
    # totals 2, 4, 6 then a different shape: blocked -> largest preferred (4)
    b = fill(
        DynamicBatcher(16, (2, 4), 1_000 * MS),
        req("a", 2),
        req("b", 2),
        req("c", 2),
        req("x", 1, shape="other"),
    )
    assert tags(b.next_batch(0).batch) == ["a", "b"]
    # the remainder is blocked by the other shape again; its preferred prefix is [c] (2)
    assert tags(b.next_batch(0).batch) == ["c"]
    assert b.next_batch(0) == Decision(None, 1_000 * MS)


def test_blocked_without_preferred_prefix_sends_everything_that_fits():
    b = fill(DynamicBatcher(8, (8,), 1_000 * MS), req("a", 3), req("b", 3), req("c", 3))
    assert tags(b.next_batch(0).batch) == ["a", "b"]


def test_blocked_by_size_uses_preferred_prefix():
    b = fill(DynamicBatcher(8, (3,), 1_000 * MS), req("a", 3), req("b", 4), req("c", 5))
    # a+b=7, c does not fit -> blocked; largest preferred prefix is [a] (3)
    assert tags(b.next_batch(0).batch) == ["a"]


def test_max_reached_wins_over_preferred_prefix():
    b = fill(DynamicBatcher(4, (2,), 1_000 * MS), *(req(i) for i in range(5)))
    assert tags(b.next_batch(0).batch) == [0, 1, 2, 3]


def test_preferred_equal_to_queue_content_sent_immediately_even_with_delay():
    b = fill(DynamicBatcher(8, (3,), 1_000 * MS), req("a", 1), req("b", 2))
    d = b.next_batch(0)
    assert tags(d.batch) == ["a", "b"] and d.wake_at_ns is None


# ------------------------------------------------------------------ multi-row


def test_multi_row_requests_fill_to_exact_max():
    b = fill(DynamicBatcher(8, (), 1_000 * MS), req("a", 5), req("b", 3), req("c", 1))
    assert tags(b.next_batch(0).batch) == ["a", "b"]
    assert [p.payload for p in b.queue] == ["c"]


def test_multi_row_under_max_waits():
    b = fill(DynamicBatcher(8, (), 10 * MS), req("a", 5, t=3), req("b", 2, t=4))
    assert b.next_batch(4) == Decision(None, 3 + 10 * MS)
    d = b.next_batch(3 + 10 * MS)
    assert tags(d.batch) == ["a", "b"] and sum(p.batch_size for p in d.batch) == 7


def test_batch_of_size_equal_max_from_single_request():
    b = fill(DynamicBatcher(4, (), 1_000 * MS), req("a", 4), req("b", 1))
    assert tags(b.next_batch(0).batch) == ["a"]


# ------------------------------------------------------------------ remove / drain


def test_remove_takes_matching_requests_and_keeps_order():
    b = fill(DynamicBatcher(8, (), 1_000 * MS), *(req(i, t=i) for i in range(6)))
    removed = b.remove(lambda p: p.payload % 2 == 0)
    assert [p.payload for p in removed] == [0, 2, 4]
    assert [p.payload for p in b.queue] == [1, 3, 5]
    assert len(b) == 3
    # the new head's enqueue time decides the deadline
    assert b.next_batch(0) == Decision(None, 1 + 1_000 * MS)


def test_remove_nothing_and_everything():
    b = fill(DefaultBatcher(), req("a"), req("b"))
    assert b.remove(lambda p: False) == []
    assert len(b) == 2
    assert [p.payload for p in b.remove(lambda p: True)] == ["a", "b"]
    assert len(b) == 0
    assert b.next_batch(0) == Decision(None, None)


def test_drain_returns_everything_in_order_and_empties():
    b = fill(DynamicBatcher(2, (), 5), req("a"), req("b", shape="s"), req("c"))
    out = b.drain()
    assert [p.payload for p in out] == ["a", "b", "c"]
    assert len(b) == 0
    assert b.drain() == []
    assert b.next_batch(10**12) == Decision(None, None)
    b.add(req("d", t=7))
    assert b.next_batch(8) == Decision(None, 12)


def test_pending_equality_ignores_payload():
    assert Pending(1, "s", 5, payload="x") == Pending(1, "s", 5, payload="y")
    assert Pending(1, "s", 5) != Pending(2, "s", 5)


# ------------------------------------------------------------------ invariants


def _simulate(ops, max_batch, preferred, delay):
    """Run a random schedule of arrivals and batch requests; check every invariant."""
    b = DynamicBatcher(max_batch, preferred, delay)
    now = 0
    arrived: dict = {}
    served: dict = {}
    seq = 0
    for kind, a, c in ops:
        now += a
        if kind == "add":
            shape = f"s{c % 3}"
            r = Pending(1 + c % max_batch, shape, now, payload=(shape, seq))
            seq += 1
            b.add(r)
            arrived.setdefault(shape, []).append(r.payload)
        else:
            _check_decision(b, now, max_batch, preferred, delay, served)
    # flush: at a time past every deadline, the batcher must drain the queue
    now += delay + 1
    for _ in range(seq + 1):
        d = b.next_batch(now)
        if d.batch is None:
            assert d.wake_at_ns is None
            break
        _record(d.batch, max_batch, served)
    assert len(b) == 0
    assert served == arrived  # each request exactly once, in arrival order per shape


def _record(batch, max_batch, served):
    assert batch, "a batch is never empty"
    shapes = {p.shape_key for p in batch}
    assert len(shapes) == 1, "a batch never mixes shapes"
    total = sum(p.batch_size for p in batch)
    assert total <= max_batch, "no batch exceeds max_batch_size"
    for p in batch:
        served.setdefault(p.shape_key, []).append(p.payload)


def _check_decision(b, now, max_batch, preferred, delay, served):
    before = list(b.queue)
    d = b.next_batch(now)
    if not before:
        assert d == Decision(None, None)
        return
    if d.batch is None:
        # waiting is only allowed before the head's deadline, with a wake time
        assert d.wake_at_ns == before[0].enqueue_ns + delay
        assert now < d.wake_at_ns
        assert list(b.queue) == before
        return
    assert d.wake_at_ns is None
    # the batch is a prefix of the queue
    assert list(d.batch) == before[: len(d.batch)]
    assert list(b.queue) == before[len(d.batch) :]
    total = sum(p.batch_size for p in d.batch)
    if now < before[0].enqueue_ns + delay:
        # sent early: max reached, a preferred size, or the next request could not join
        nxt = before[len(d.batch)] if len(d.batch) < len(before) else None
        blocked = nxt is not None and (
            nxt.shape_key != before[0].shape_key or total + nxt.batch_size > max_batch
        )
        assert total == max_batch or total in preferred or blocked
    _record(d.batch, max_batch, served)


def test_random_schedules_keep_invariants():
    rng = random.Random(20240607)
    for _ in range(300):
        max_batch = rng.randint(1, 9)
        preferred = tuple(
            sorted(rng.sample(range(1, max_batch + 1), rng.randint(0, min(3, max_batch))))
        )
        delay = rng.choice([0, 1, 5, 50])
        ops = [
            (rng.choice(["add", "add", "next"]), rng.randint(0, 10), rng.randint(0, 30))
            for _ in range(rng.randint(0, 60))
        ]
        _simulate(ops, max_batch, preferred, delay)


if given is not None:

    @settings(max_examples=150, deadline=None)
    @given(
        max_batch=st.integers(1, 9),
        preferred=st.lists(st.integers(1, 9), max_size=3),
        delay=st.sampled_from([0, 1, 5, 50]),
        ops=st.lists(
            st.tuples(st.sampled_from(["add", "next"]), st.integers(0, 10), st.integers(0, 30)),
            max_size=60,
        ),
    )
    def test_hypothesis_schedules_keep_invariants(max_batch, preferred, delay, ops):
        preferred = tuple(p for p in preferred if p <= max_batch)
        _simulate(ops, max_batch, preferred, delay)
