"""The supervisor's restart delays and the chaos benchmark's Redis audit (pure parts)."""

from __future__ import annotations

from bench.chaos_audit import audit_snapshot
from stageserve.restart_policy import RestartPolicy, RestartState


def test_first_restart_is_quick_then_delays_double_up_to_the_cap() -> None:
    state = RestartState(RestartPolicy(first_delay_s=0.1, max_delay_s=1.0, healthy_after_s=10))
    delays = [state.on_exit(uptime_s=0.5) for _ in range(6)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_stage_that_ran_long_enough_starts_over_from_the_first_delay() -> None:
    state = RestartState(RestartPolicy(first_delay_s=0.1, max_delay_s=5.0, healthy_after_s=10))
    for _ in range(4):
        state.on_exit(uptime_s=1.0)
    assert state.on_exit(uptime_s=30.0) == 0.1
    assert state.on_exit(uptime_s=1.0) == 0.2


def _snapshot(pools, grants=(), dead=0, forever=0, orphans=0, now_ms=10_000):
    return [list(pools), list(grants), dead, forever, orphans, now_ms]


def test_audit_of_a_consistent_registry_finds_nothing() -> None:
    # i1 free, i2 held by a live grant
    audit = audit_snapshot(
        _snapshot([(b"m:1", [b"i1", b"i2"], [b"i1"])], [(b"g", b"10500", b"i2", b"m:1")])
    )
    assert audit.leaked == 0, audit.problems
    assert (audit.instances, audit.free, audit.grants) == (2, 1, 1)


def test_audit_counts_every_kind_of_leak() -> None:
    audit = audit_snapshot(
        _snapshot(
            # i1 neither free nor granted; i2 free twice; i3 free and granted;
            # "x" free but not registered
            [(b"m:1", [b"i1", b"i2", b"i3"], [b"i2", b"i2", b"i3", b"x"])],
            # a grant on i3 long past its lease, and one on an unknown instance
            [(b"g1", b"1000", b"i3", b"m:1"), (b"g2", b"20000", b"gone", b"m:1")],
            dead=1,
            forever=2,
        )
    )
    assert audit.lost_instances == 1
    assert audit.double_booked == 2
    assert audit.stray == 2
    assert audit.expired_grants == 1
    assert audit.leaked == 1 + 2 + 2 + 1 + 1 + 2
