"""services/scheduler/batcher.py: priority levels and queue policies (Triton's
ModelQueuePolicy: timeout_action, default_timeout_microseconds,
allow_timeout_override, max_queue_size), expire() and requeue_front()."""

from __future__ import annotations

import pytest

from services.scheduler.batcher import (
    DELAY,
    REJECT,
    DefaultBatcher,
    DynamicBatcher,
    Pending,
    QueueFull,
    QueuePolicy,
)

MS = 1_000_000  # ns
US = 1_000  # ns


# A default long enough never to fire in these tests: requests shorten it (Triton's rule).
LONG = 10**9


def req(tag, priority=0, t=0, batch_size=1, shape="a"):
    return Pending(
        batch_size=batch_size, shape_key=shape, enqueue_ns=t, payload=tag, priority=priority
    )


def tags(requests):
    assert requests is not None
    return [p.payload for p in requests]


def take_all(batcher, now=0):
    """Every batch the batcher sends at `now`, in order."""
    out = []
    while len(batcher):
        d = batcher.next_batch(now)
        assert d.batch, d
        out.append(tags(d.batch))
    return out


def prio(levels=2, default=2, **kwargs):
    return DynamicBatcher(1, priority_levels=levels, default_priority_level=default, **kwargs)


# ------------------------------------------------------------ QueuePolicy.timeout_us


def test_policy_without_override_always_uses_default():
    p = QueuePolicy(default_timeout_us=500)
    assert p.timeout_us(0) == 500
    assert p.timeout_us(100) == 500
    assert p.timeout_us(10_000) == 500
    assert QueuePolicy().timeout_us(100) == 0  # no default, no override: no timeout


def test_policy_override_may_shorten_but_not_extend_the_default():
    p = QueuePolicy(default_timeout_us=500, allow_timeout_override=True)
    assert p.timeout_us(100) == 100
    assert p.timeout_us(500) == 500
    assert p.timeout_us(10_000) == 500
    assert p.timeout_us(0) == 500  # 0: the request asks for nothing


def test_policy_override_with_no_default_timeout_is_ignored_as_in_triton():
    # Triton's core only takes a requested timeout shorter than a non-zero
    # default; with no default timeout there is nothing to shorten.
    p = QueuePolicy(default_timeout_us=0, allow_timeout_override=True)
    assert p.timeout_us(200) == 0
    assert p.timeout_us(0) == 0


# ------------------------------------------------------------------ priority order


def test_levels_are_served_highest_first_then_by_arrival():
    b = DynamicBatcher(8, priority_levels=3, default_priority_level=2)
    for r in (req("a3", 3), req("b2", 2), req("c1", 1), req("d3", 3), req("e1", 1), req("f2", 2)):
        b.add(r)
    assert tags(b.queue) == ["c1", "e1", "b2", "f2", "a3", "d3"]
    assert len(b) == 6
    # one batch in queue order (max_batch_size 8, delay 0)
    assert take_all(b) == [["c1", "e1", "b2", "f2", "a3", "d3"]]


def test_priority_zero_and_out_of_range_use_the_default_level():
    b = prio(levels=3, default=2)
    assert b.level_of(0) == 2
    assert b.level_of(4) == 2
    assert b.level_of(99) == 2
    assert b.level_of(1) == 1 and b.level_of(3) == 3
    for r in (req("low", 3), req("zero", 0), req("big", 7), req("two", 2), req("hi", 1)):
        b.add(r)
    assert [(p.payload, p.priority) for p in b.queue] == [
        ("hi", 1),
        ("zero", 2),
        ("big", 2),
        ("two", 2),
        ("low", 3),
    ]
    assert take_all(b) == [["hi"], ["zero"], ["big"], ["two"], ["low"]]


def test_no_priority_levels_is_one_fifo_queue():
    b = DynamicBatcher(1)
    for r in (req("a", 0), req("b", 1), req("c", 5)):
        b.add(r)
    assert take_all(b) == [["a"], ["b"], ["c"]]


def test_default_scheduler_honours_priorities_too():
    b = DefaultBatcher(priority_levels=2, default_priority_level=2)
    b.add(req("low"))
    b.add(req("high", 1))
    assert take_all(b) == [["high"], ["low"]]


def test_high_priority_arrival_changes_the_head_and_the_wake_time():
    b = DynamicBatcher(4, max_queue_delay_ns=10 * MS, priority_levels=2, default_priority_level=2)
    b.add(req("low", 2, t=0))
    assert b.next_batch(1 * MS).wake_at_ns == 10 * MS
    b.add(req("high", 1, t=5 * MS))
    # both wait for the oldest of the pending batch
    assert b.next_batch(6 * MS).wake_at_ns == 10 * MS
    assert tags(b.next_batch(10 * MS).batch) == ["high", "low"]


def test_shapes_still_split_batches_across_levels():
    b = DynamicBatcher(8, priority_levels=2, default_priority_level=2)
    b.add(req("l-a", 2, shape="a"))
    b.add(req("h-b", 1, shape="b"))
    b.add(req("h-a", 1, shape="a"))
    # queue order: h-b, h-a, l-a; h-a has another shape than the head h-b
    assert take_all(b) == [["h-b"], ["h-a", "l-a"]]


# ------------------------------------------------------------------ max_queue_size


def test_max_queue_size_rejects_beyond_the_cap():
    b = DynamicBatcher(1, default_policy=QueuePolicy(max_queue_size=2))
    b.add(req("a"))
    b.add(req("b"))
    with pytest.raises(QueueFull, match="maximum queue size 2"):
        b.add(req("c"))
    assert len(b) == 2
    assert tags(b.queue) == ["a", "b"]
    # a batch leaving frees a slot
    assert tags(b.next_batch(0).batch) == ["a"]
    b.add(req("d"))
    assert tags(b.queue) == ["b", "d"]


def test_max_queue_size_is_per_level():
    b = DynamicBatcher(
        1,
        priority_levels=2,
        default_priority_level=2,
        default_policy=QueuePolicy(max_queue_size=1),
        level_policies={1: QueuePolicy(max_queue_size=3)},
    )
    b.add(req("l1", 2))
    with pytest.raises(QueueFull):
        b.add(req("l2", 2))
    with pytest.raises(QueueFull):
        b.add(req("l3", 0))  # the default level is level 2
    for k in range(3):
        b.add(req(f"h{k}", 1))
    with pytest.raises(QueueFull):
        b.add(req("h3", 1))
    assert tags(b.queue) == ["h0", "h1", "h2", "l1"]


def test_max_queue_size_counts_delayed_requests():
    b = DynamicBatcher(
        1,
        default_policy=QueuePolicy(timeout_action=DELAY, default_timeout_us=10, max_queue_size=2),
    )
    b.add(req("a", t=0))
    b.add(req("b", t=0))
    assert b.expire(1 * MS) == []  # both delayed, still queued
    with pytest.raises(QueueFull):
        b.add(req("c", t=1 * MS))
    assert len(b) == 2


def test_rejected_add_changes_nothing():
    b = DynamicBatcher(1, default_policy=QueuePolicy(max_queue_size=1, default_timeout_us=5))
    first = req("a")
    b.add(first)
    second = req("b", priority=0)
    with pytest.raises(QueueFull):
        b.add(second)
    assert len(b) == 1
    assert b.next_deadline() == 5 * US


# ------------------------------------------------------------------ deadlines


def test_add_sets_level_deadline_and_action_from_the_policy():
    b = DynamicBatcher(
        4,
        priority_levels=2,
        default_priority_level=2,
        default_policy=QueuePolicy(default_timeout_us=300),
        level_policies={
            1: QueuePolicy(
                timeout_action=DELAY, default_timeout_us=1000, allow_timeout_override=True
            )
        },
    )
    low, high, high_short = req("low", 0, t=10), req("high", 1, t=20), req("hs", 1, t=30)
    b.add(low, timeout_us=50)  # override not allowed at level 2: ignored
    b.add(high)
    b.add(high_short, timeout_us=100)
    assert (low.priority, low.deadline_ns, low.timeout_action) == (2, 10 + 300 * US, REJECT)
    assert (high.priority, high.deadline_ns, high.timeout_action) == (1, 20 + 1000 * US, DELAY)
    assert high_short.deadline_ns == 30 + 100 * US
    assert b.next_deadline() == 30 + 100 * US


def test_no_timeout_means_no_deadline():
    b = DynamicBatcher(4)
    r = req("a")
    b.add(r, timeout_us=1000)  # override not allowed by the default policy
    assert r.deadline_ns is None
    assert b.next_deadline() is None
    assert b.expire(10**18) == []
    assert len(b) == 1


# ------------------------------------------------------------------ expire()


def test_expire_reject_returns_expired_requests_and_keeps_order_of_the_rest():
    b = DynamicBatcher(
        8, default_policy=QueuePolicy(default_timeout_us=LONG, allow_timeout_override=True)
    )
    b.add(req("a", t=0), timeout_us=100)
    b.add(req("b", t=0))  # no timeout
    b.add(req("c", t=0), timeout_us=50)
    b.add(req("d", t=0), timeout_us=500)
    assert b.expire(49 * US) == []  # nothing due yet
    assert tags(b.expire(100 * US)) == ["a", "c"]  # deadline reached: expired
    assert len(b) == 2
    assert tags(b.queue) == ["b", "d"]
    assert b.next_deadline() == 500 * US
    assert b.expire(100 * US) == []  # answered once only
    assert tags(b.next_batch(100 * US).batch) == ["b", "d"]


def test_expire_delay_moves_requests_behind_every_live_request():
    b = DynamicBatcher(
        1,
        priority_levels=2,
        default_priority_level=2,
        default_policy=QueuePolicy(
            timeout_action=DELAY, default_timeout_us=LONG, allow_timeout_override=True
        ),
    )
    b.add(req("h-timed", 1, t=0), timeout_us=10)
    b.add(req("l-timed", 2, t=0), timeout_us=10)
    b.add(req("h-live", 1, t=0))
    b.add(req("l-live", 2, t=0))
    assert b.expire(1 * MS) == []  # DELAY: nobody is rejected
    assert len(b) == 4
    # live requests of every level first, then delayed ones by level
    assert tags(b.queue) == ["h-live", "l-live", "h-timed", "l-timed"]
    # a delayed request has no deadline any more and never expires again
    assert [r.deadline_ns for r in b.queue if r.payload.endswith("timed")] == [None, None]
    assert b.next_deadline() == LONG * 1000  # only the live ones' default remains
    # later live arrivals still go ahead of the delayed ones
    b.add(req("l-new", 2, t=2 * MS))
    assert take_all(b, 2 * MS) == [["h-live"], ["l-live"], ["l-new"], ["h-timed"], ["l-timed"]]


def test_delayed_requests_still_batch_together_after_live_ones():
    b = DynamicBatcher(
        4,
        default_policy=QueuePolicy(
            timeout_action=DELAY, default_timeout_us=LONG, allow_timeout_override=True
        ),
    )
    b.add(req("t1", t=0), timeout_us=1)
    b.add(req("t2", t=0), timeout_us=1)
    b.add(req("live", t=0))
    b.expire(1 * MS)
    assert tags(b.next_batch(1 * MS).batch) == ["live", "t1", "t2"]
    assert len(b) == 0


def test_expire_mixed_actions_per_level():
    b = DynamicBatcher(
        1,
        priority_levels=2,
        default_priority_level=2,
        default_policy=QueuePolicy(timeout_action=REJECT, default_timeout_us=100),
        level_policies={1: QueuePolicy(timeout_action=DELAY, default_timeout_us=100)},
    )
    b.add(req("h", 1, t=0))
    b.add(req("l", 2, t=0))
    b.add(req("l-late", 2, t=1 * MS))
    assert tags(b.expire(200 * US)) == ["l"]
    assert tags(b.queue) == ["l-late", "h"]
    assert b.next_deadline() == 1 * MS + 100 * US


def test_remove_and_drain_see_delayed_requests():
    b = DynamicBatcher(
        1,
        default_policy=QueuePolicy(
            timeout_action=DELAY, default_timeout_us=LONG, allow_timeout_override=True
        ),
    )
    b.add(req("d", t=0), timeout_us=1)
    b.add(req("x", t=0))
    b.add(req("y", t=0))
    b.expire(1 * MS)
    # live requests first, then delayed ones
    assert tags(b.remove(lambda p: p.payload in ("d", "x"))) == ["x", "d"]
    assert tags(b.queue) == ["y"]
    assert len(b) == 1
    b.add(req("e", t=0), timeout_us=1)
    b.expire(1 * MS)
    assert tags(b.drain()) == ["y", "e"]
    assert len(b) == 0 and b.queue == []


# ------------------------------------------------------------------ requeue_front


def test_requeue_front_puts_requests_back_at_the_head_of_their_levels():
    b = DynamicBatcher(8, priority_levels=2, default_priority_level=2)
    for r in (req("h1", 1), req("l1", 2), req("l2", 2)):
        b.add(r)
    taken = b.next_batch(0).batch
    assert tags(taken) == ["h1", "l1", "l2"]
    assert len(b) == 0
    b.add(req("l3", 2))
    b.add(req("h2", 1))
    b.requeue_front(taken)
    assert len(b) == 5
    assert tags(b.queue) == ["h1", "h2", "l1", "l2", "l3"]


def test_requeue_front_into_a_new_batcher_keeps_levels_and_deadlines():
    old = DynamicBatcher(
        8,
        priority_levels=2,
        default_priority_level=2,
        default_policy=QueuePolicy(default_timeout_us=100),
    )
    old.add(req("l", 0, t=0))
    old.add(req("h", 1, t=0))
    pending = old.drain()
    new = DynamicBatcher(2, priority_levels=2, default_priority_level=2)
    new.requeue_front(pending)
    assert len(new) == 2
    assert [(p.payload, p.priority) for p in new.queue] == [("h", 1), ("l", 2)]
    assert new.next_deadline() == 100 * US
    assert sorted(tags(new.expire(100 * US))) == ["h", "l"]
    assert len(new) == 0


def test_requeue_front_then_batches_respect_max_batch_size():
    b = DynamicBatcher(2)
    for r in (req("a"), req("b"), req("c")):
        b.add(r)
    first = b.next_batch(0).batch
    b.requeue_front(first)
    assert take_all(b) == [["a", "b"], ["c"]]
