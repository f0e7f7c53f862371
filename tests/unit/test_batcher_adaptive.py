"""The dynamic batcher's adaptive hold (beyond Triton): a batch that could go
out stays open while requests keep arriving, never for a lone request."""

from __future__ import annotations

from services.scheduler.batcher import DynamicBatcher, Pending

US = 1_000


def req(tag: str, t: int, batch_size: int = 1) -> Pending:
    return Pending(batch_size=batch_size, shape_key="a", enqueue_ns=t, payload=tag)


def tags(decision) -> list[str]:
    return [p.payload for p in decision.batch or []]


def test_off_by_default_sends_at_once() -> None:
    b = DynamicBatcher(8)
    for i, t in enumerate((0, 100 * US)):
        b.add(req(f"r{i}", t))
    assert tags(b.next_batch(100 * US)) == ["r0", "r1"]


def test_a_lone_request_never_waits() -> None:
    b = DynamicBatcher(8, adaptive_delay_ns=2000 * US)
    b.add(req("r0", 0))
    assert tags(b.next_batch(0)) == ["r0"]


def test_holds_while_arrivals_are_due_then_sends() -> None:
    b = DynamicBatcher(8, adaptive_delay_ns=2000 * US)
    for i, t in enumerate((0, 100 * US, 200 * US)):
        b.add(req(f"r{i}", t))
    # mean gap ~ 100 us (EWMA from 0): the next arrival is due soon, hold
    d = b.next_batch(210 * US)
    assert d.batch is None and d.wake_at_ns is not None
    assert 210 * US < d.wake_at_ns <= 200 * US + 2000 * US
    b.add(req("r3", 260 * US))
    d = b.next_batch(270 * US)
    assert d.batch is None and d.wake_at_ns is not None
    assert d.wake_at_ns > 260 * US  # the newest arrival extends it
    # nothing more arrives: it goes out at the wake time with everything queued
    assert tags(b.next_batch(d.wake_at_ns)) == ["r0", "r1", "r2", "r3"]


def test_never_longer_than_the_cap_after_the_oldest() -> None:
    b = DynamicBatcher(64, adaptive_delay_ns=500 * US)
    t = 0
    sent = None
    for i in range(40):  # a steady stream, one every 20 us, checked at each arrival
        b.add(req(f"r{i}", t))
        if i > 0:  # (a lone r0 would go at once)
            d = b.next_batch(t)
            if d.batch:
                sent = (t, len(d.batch))
                break
            assert d.wake_at_ns is not None and d.wake_at_ns <= 500 * US
        t += 20 * US
    assert sent == (500 * US, 26)  # r0 .. r25: held until oldest + the cap


def test_full_batch_goes_at_once() -> None:
    b = DynamicBatcher(4, adaptive_delay_ns=2000 * US)
    for i in range(4):
        b.add(req(f"r{i}", i * US))
    assert tags(b.next_batch(4 * US)) == ["r0", "r1", "r2", "r3"]


def test_preferred_size_goes_at_once() -> None:
    b = DynamicBatcher(8, preferred_batch_sizes=(2,), adaptive_delay_ns=2000 * US)
    b.add(req("r0", 0))
    b.add(req("r1", 10 * US))
    assert tags(b.next_batch(10 * US)) == ["r0", "r1"]


def test_triton_queue_delay_still_applies_first() -> None:
    b = DynamicBatcher(8, max_queue_delay_ns=300 * US, adaptive_delay_ns=1000 * US)
    b.add(req("r0", 0))
    b.add(req("r1", 10 * US))
    assert b.next_batch(20 * US).wake_at_ns == 300 * US
    # past Triton's delay the hold is bounded by the gap after the last arrival
    d = b.next_batch(300 * US)
    assert d.batch is not None or (d.wake_at_ns is not None and d.wake_at_ns <= 1000 * US)


def test_scheduler_flag_reaches_the_batcher(monkeypatch) -> None:
    from services.scheduler.batch_strategy import make_batcher
    from stageserve.cli import _settings, build_parser
    from stageserve.config import parse_config_text, to_spec

    def delay_us(*flags: str) -> int:
        parser = build_parser()
        args = parser.parse_args(["scheduler", "--redis-url", "redis://h", *flags])
        return _settings(parser, args).scheduler.adaptive_batch_delay_us

    monkeypatch.delenv("STAGESERVE_ADAPTIVE_BATCH_DELAY_US", raising=False)
    assert delay_us("--adaptive-batch-delay-us", "700") == 700
    assert delay_us() == 2000  # on by default (hold_tuner.py)
    monkeypatch.setenv("STAGESERVE_ADAPTIVE_BATCH_DELAY_US", "0")
    assert delay_us() == 0
    monkeypatch.setenv("STAGESERVE_ADAPTIVE_BATCH_DELAY_US", "300")
    assert delay_us() == 300
    assert delay_us("--adaptive-batch-delay-us", "700") == 700  # the flag wins
    spec = to_spec(
        parse_config_text(
            'name: "m" platform: "onnxruntime_onnx" max_batch_size: 8 dynamic_batching { } '
            'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ] '
            'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]'
        )
    )
    batcher = make_batcher(spec, delay_us("--adaptive-batch-delay-us", "700"))
    assert isinstance(batcher, DynamicBatcher) and batcher.adaptive_delay_ns == 700 * US
