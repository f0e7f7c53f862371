"""services/scheduler/grant_pool.py, instance_pins.InstanceFilter and response_order.py:
the scheduler's pure parts."""

from __future__ import annotations

import pytest

from services.scheduler.grant_pool import GrantPool, Held, Usable
from services.scheduler.instance_pins import InstanceFilter
from services.scheduler.response_order import ResponseOrder


def ok(_: str) -> Usable:
    return Usable.OK


def test_a_finished_grant_is_kept_then_taken_again():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    pool.acquired("g1", now=0.0)
    held, releases = pool.take(ok)
    assert held == Held("g1", 0.0) and releases == [] and len(pool) == 0
    assert pool.finished(held, failed=False, holds_resources=False, now=1.0)
    assert pool.take(ok)[0] == Held("g1", 0.0)  # its first acquisition time stays


def test_not_kept_after_reuse_window_failure_gone_instance_or_resources():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    h = Held("g", 0.0)
    assert not pool.finished(h, False, False, now=2.5)  # reused long enough: back
    assert not pool.finished(h, True, False, now=0.1)  # the worker failed
    assert not pool.finished(h, None, False, now=0.1)  # the instance went away
    assert not pool.finished(h, False, True, now=0.1)  # holds rate_limiter resources
    assert len(pool) == 0


def test_take_skips_broken_and_lost_grants_and_says_how_to_release_them():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    for g in ("good", "lost", "broken"):
        pool.acquired(g, 0.0)
    states = {"good": Usable.OK, "lost": Usable.LOST, "broken": Usable.BROKEN}
    held, releases = pool.take(states.__getitem__)
    assert held is not None and held.grant == "good"
    assert releases == [("broken", True), ("lost", False)]
    assert pool.take(ok) == (None, [])


def test_take_leaves_grants_that_do_not_fit_held_until_their_reuse_window_ends():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    pool.acquired("old-B", 0.0)
    pool.acquired("A", 1.0)
    pool.acquired("new-B", 1.5)
    wants_b = InstanceFilter(only=frozenset({"old-B", "new-B"}))
    held, releases = pool.take(ok, wants_b.fits, now=1.6)
    assert held == Held("new-B", 1.5) and releases == [] and len(pool) == 2
    wants_a = InstanceFilter(other_than=frozenset({"old-B", "new-B"}))
    wants_c = InstanceFilter(only=frozenset({"C"}))
    # neither fits: old-B (2.5 s old) goes back, A (1.5 s) stays
    assert pool.take(ok, wants_c.fits, now=2.5) == (None, [("old-B", False)])
    assert pool.take(ok, wants_a.fits, now=2.5) == (Held("A", 1.0), [])
    assert len(pool) == 0


def test_a_filter_names_only_or_avoids_instances():
    assert InstanceFilter().fits("x")
    assert InstanceFilter(only=frozenset({"a"}), other_than=frozenset({"a"})).fits("a")
    assert not InstanceFilter(only=frozenset({"a"})).fits("b")
    assert not InstanceFilter(other_than=frozenset({"a"})).fits("a")


def test_standby_hold_runs_from_the_first_idle_moment():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    assert pool.idle(now=0.0) is None  # nothing held: wait for an arrival
    pool.acquired("g", 0.0)
    assert pool.idle(now=10.0) == 0.5
    assert pool.idle(now=10.2) == pytest.approx(0.3)
    pool.busy()  # work arrived: the hold starts over next time
    assert pool.idle(now=11.0) == 0.5
    assert pool.idle(now=11.6) == 0.0  # ran out: the caller releases
    assert pool.drain() == ["g"] and len(pool) == 0
    assert pool.idle(now=12.0) is None


def test_put_back_keeps_an_unused_grant():
    pool: GrantPool[str] = GrantPool(reuse_s=2.0, standby_s=0.5)
    pool.put_back(Held("g", 3.0))
    assert pool.drain() == ["g"]


def test_answers_leave_in_dispatch_order():
    order: ResponseOrder[str] = ResponseOrder()
    n = [order.number() for _ in range(4)]
    assert order.answered(n[2], "c") == []
    assert order.answered(n[1], "b") == []
    assert order.answered(n[0], "a") == ["a", "b", "c"]
    assert order.answered(n[3], "d") == ["d"]
    assert len(order) == 0


def test_reset_releases_held_answers_and_late_ones_are_not_stuck():
    order: ResponseOrder[str] = ResponseOrder()
    n = [order.number() for _ in range(3)]
    assert order.answered(n[1], "b") == []
    assert order.reset() == ["b"]
    # n[0] and n[2] were dispatched before the reset: they leave at once
    assert order.answered(n[2], "c") == ["c"]
    assert order.answered(n[0], "a") == ["a"]
    m = order.number()
    assert order.answered(m, "x") == ["x"]
