"""services/scheduler/hold_tuner.py: the adaptive hold is kept on only while
requests arrive at least as fast with it as without it (a fake clock; the
traffic's arrival rate depends on the mode, as a closed loop's does)."""

from __future__ import annotations

from services.scheduler.batcher import DynamicBatcher, Pending
from services.scheduler.hold_tuner import HoldTuner

MS = 1_000_000


def run(tuner: HoldTuner, per_ms: dict[bool, int], ms: int, start: int = 0) -> list[bool]:
    """Drive `tuner` for `ms` ms; each ms the mode decides how many arrive."""
    modes = []
    for t in range(start, start + ms):
        on = tuner.hold_on(t * MS)
        modes.append(on)
        for _ in range(per_ms[on]):
            tuner.arrived(t * MS)
    return modes


def test_trials_then_keeps_the_hold_when_it_brings_more_arrivals() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=8)
    modes = run(tuner, {True: 3, False: 2}, 1000)
    assert modes[:100] == [True] * 100  # first trial: on
    assert modes[100:200] == [False] * 100  # second trial: off
    assert all(modes[200:1000])  # on won: kept 8 epochs
    assert sum(modes) / len(modes) >= 0.9


def test_switches_the_hold_off_when_it_costs_throughput() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=8)
    modes = run(tuner, {True: 78, False: 100}, 3000)  # the hold loses 22% (c=8)
    assert not any(modes[200:1000])
    # every 10 epochs one trial of the hold; trials alternate which goes first
    assert sum(modes) / len(modes) <= 0.15
    assert modes[1000:1100] == [False] * 100 and modes[1100:1200] == [True] * 100


def test_a_tie_keeps_the_hold() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=8, margin=0.03)
    modes = run(tuner, {True: 98, False: 100}, 1000)  # within the margin
    assert all(modes[200:1000])


def test_follows_a_change_of_load() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=4)
    run(tuner, {True: 78, False: 100}, 1200)
    modes = run(tuner, {True: 130, False: 100}, 1200, start=1200)  # now the hold wins
    assert sum(modes[-400:]) == 400


def test_after_an_idle_spell_it_tries_again() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=8)
    run(tuner, {True: 78, False: 100}, 500)
    assert not tuner.hold_on(500 * MS)
    # nothing arrives for 5 epochs: the next traffic starts with fresh trials
    modes = run(tuner, {True: 3, False: 2}, 400, start=1000)
    assert sum(modes[:200]) == 100 and all(modes[200:])


def test_the_batcher_asks_the_tuner() -> None:
    tuner = HoldTuner(epoch_ns=100 * MS, keep_epochs=8)
    b = DynamicBatcher(8, adaptive_delay_ns=2 * MS, hold_tuner=tuner)

    def two_queued(t: int):
        for i in range(2):
            b.add(Pending(batch_size=1, shape_key="a", enqueue_ns=t + i, payload=i))
        return b.next_batch(t + 2)

    assert two_queued(0).batch is None  # trial of the hold: held
    b.drain()
    run(tuner, {True: 1, False: 5}, 300, start=1)  # off wins its trial
    d = two_queued(301 * MS)
    assert d.batch is not None and len(d.batch) == 2  # sent at once, as Triton would
