"""The stack's merged counters stay monotonic while gateways restart or do
not answer (stageserve/counter_carry.py), on texts a real TritonMetrics
renders, merged as `up`'s --metrics-port merges them."""

from __future__ import annotations

from stageserve.counter_carry import CounterCarry
from stageserve.metrics_merge import merge_samples, parse
from stageserve.telemetry import TritonMetrics, model_labels

SIMPLE = model_labels("simple", 1)
ADD = model_labels("add", 1)
SUCCESS = "nv_inference_request_success"
PENDING = "nv_inference_pending_request_count"


def _text(success: dict[tuple, float], pending: float = 0.0, cpu: float = 0.5) -> str:
    m = TritonMetrics()
    for labels, n in success.items():
        m.inc(SUCCESS, labels, n)
    m.set(PENDING, SIMPLE, pending)
    m.set("nv_cpu_utilization", (), cpu)
    return m.render()


def _merged(carry: CounterCarry, texts: dict, pids: dict | None = None) -> dict:
    return parse(merge_samples(carry.samples(texts, pids)))


def test_counters_as_read_while_nothing_restarts() -> None:
    carry = CounterCarry()
    out = _merged(carry, {1: _text({SIMPLE: 3}), 2: _text({SIMPLE: 4, ADD: 1})})
    assert out[SUCCESS] == {SIMPLE: 7, ADD: 1}
    out = _merged(carry, {1: _text({SIMPLE: 5}), 2: _text({SIMPLE: 4, ADD: 2})})
    assert out[SUCCESS] == {SIMPLE: 9, ADD: 2}


def test_a_restarted_gateway_goes_on_from_its_last_count() -> None:
    carry = CounterCarry()
    _merged(carry, {1: _text({SIMPLE: 10}), 2: _text({SIMPLE: 4})})
    # gateway 2 came back at 0 and has answered one request since
    out = _merged(carry, {1: _text({SIMPLE: 10}), 2: _text({SIMPLE: 1})})
    assert out[SUCCESS][SIMPLE] == 15
    out = _merged(carry, {1: _text({SIMPLE: 11}), 2: _text({SIMPLE: 3})})
    assert out[SUCCESS][SIMPLE] == 18


def test_a_series_a_restarted_gateway_no_longer_shows_keeps_its_count() -> None:
    carry = CounterCarry()
    _merged(carry, {1: _text({SIMPLE: 2, ADD: 6})})
    out = _merged(carry, {1: _text({SIMPLE: 1})})  # no request for `add` since
    assert out[SUCCESS] == {SIMPLE: 3, ADD: 6}
    out = _merged(carry, {1: _text({SIMPLE: 1, ADD: 2})})
    assert out[SUCCESS] == {SIMPLE: 3, ADD: 8}


def test_a_new_pid_is_a_restart_even_past_the_old_count() -> None:
    carry = CounterCarry()
    _merged(carry, {1: _text({SIMPLE: 4})}, {1: 100})
    out = _merged(carry, {1: _text({SIMPLE: 9})}, {1: 200})  # restarted, 9 since
    assert out[SUCCESS][SIMPLE] == 13
    out = _merged(carry, {1: _text({SIMPLE: 10})}, {1: 200})
    assert out[SUCCESS][SIMPLE] == 14


def test_a_silent_or_stopped_gateway_keeps_its_counters_not_its_gauges() -> None:
    carry = CounterCarry()
    _merged(carry, {1: _text({SIMPLE: 3}, pending=1, cpu=0.25), 2: _text({SIMPLE: 4}, pending=2)})
    silent = _merged(carry, {1: None, 2: _text({SIMPLE: 5}, pending=2, cpu=0.75)})
    assert silent[SUCCESS][SIMPLE] == 8
    assert silent["nv_cpu_utilization"][()] == 0.75  # the one that answered
    assert silent[PENDING][SIMPLE] == 2
    stopped = _merged(carry, {2: _text({SIMPLE: 6}, pending=0)})  # 1 is not running
    assert stopped[SUCCESS][SIMPLE] == 9
    back = _merged(carry, {1: _text({SIMPLE: 3}), 2: _text({SIMPLE: 6})})
    assert back[SUCCESS][SIMPLE] == 9


def test_a_gateway_never_read_adds_nothing_while_silent() -> None:
    carry = CounterCarry()
    out = _merged(carry, {1: None, 2: _text({SIMPLE: 1})})
    assert out[SUCCESS][SIMPLE] == 1
