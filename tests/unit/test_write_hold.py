"""stageserve/write_hold.py: when an internal stream's writer sends what is
queued (a fake clock, in ns)."""

from __future__ import annotations

import pytest

from stageserve.write_hold import WriteHold

US = 1_000
MS = 1_000_000


def steady(hold: WriteHold, gap_ns: int, count: int, start: int = 0, in_flight: int = 8) -> int:
    """`count` arrivals `gap_ns` apart from `start`, each finding `in_flight`
    requests on the stream (itself included); returns the last one's time."""
    t = start
    for i in range(count):
        t = start + i * gap_ns
        hold.arrived(t, in_flight)
    return t


def test_a_lone_request_is_written_at_once():
    hold = WriteHold(2 * MS)
    last = steady(hold, 500 * US, 10)
    # Only the queued request itself is in flight: nothing else is due soon.
    assert hold.write_at(last, queued=1, in_flight=1, now_ns=last) is None
    assert hold.write_at(last, queued=3, in_flight=3, now_ns=last) is None


def test_no_hold_while_few_requests_are_in_flight_on_average():
    # Concurrency 2-4: each held request is a large share of what is in
    # flight, and waiting for the next one costs more than the message saved.
    hold = WriteHold(2 * MS)
    last = steady(hold, 800 * US, 400, in_flight=3)
    assert hold.write_at(last, queued=1, in_flight=3, now_ns=last) is None
    last = steady(hold, 500 * US, 400, start=last + 500 * US, in_flight=6)
    assert hold.mean_in_flight > 4
    assert hold.write_at(last, queued=1, in_flight=6, now_ns=last) is not None


def test_nothing_is_held_before_the_first_arrival():
    assert WriteHold(2 * MS).write_at(0, queued=1, in_flight=5, now_ns=0) is None


def test_the_write_waits_while_the_next_arrival_is_due():
    hold = WriteHold(2 * MS)
    last = steady(hold, 500 * US, 40)
    assert hold.mean_gap_ns == pytest.approx(500 * US, rel=0.01)
    at = hold.write_at(last, queued=1, in_flight=6, now_ns=last)
    assert at == last + int(2 * hold.mean_gap_ns)  # twice the mean gap after the last arrival
    # One more arrival keeps it open longer; the write goes when none comes.
    hold.arrived(last + 400 * US, 8)
    later = hold.write_at(last, queued=2, in_flight=7, now_ns=last + 400 * US)
    assert later is not None and later > at
    assert hold.write_at(last, queued=2, in_flight=7, now_ns=later) is None


def test_the_hold_never_exceeds_its_cap_after_the_first_queued_request():
    hold = WriteHold(2 * MS)
    last = steady(hold, 900 * US, 40)  # 2 x gap = 1.8 ms: each arrival extends it
    first = last
    now = first
    for _ in range(10):
        now += 900 * US
        hold.arrived(now, 8)
        at = hold.write_at(first, queued=3, in_flight=9, now_ns=now)
        if at is None:
            break
        assert at <= first + 2 * MS
    assert now - first <= 2 * MS + 900 * US
    assert hold.write_at(first, queued=3, in_flight=9, now_ns=first + 2 * MS) is None


def test_a_short_gap_is_floored_so_a_burst_still_waits_a_little():
    hold = WriteHold(2 * MS)
    last = steady(hold, 1 * US, 50)  # a burst: the mean gap is ~1 us
    at = hold.write_at(last, queued=5, in_flight=9, now_ns=last)
    assert at == last + hold.min_gap_ns


def test_no_hold_when_the_next_request_is_not_due_within_the_cap():
    hold = WriteHold(2 * MS)
    last = steady(hold, 5 * MS, 40)  # a slow model's traffic: 5 ms apart
    assert hold.write_at(last, queued=1, in_flight=8, now_ns=last) is None


def test_a_cap_of_zero_is_refused():
    with pytest.raises(ValueError):
        WriteHold(0)
