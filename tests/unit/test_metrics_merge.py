"""The stack's Triton metrics merged from several gateways' /metrics texts
(stageserve/metrics_merge.py): each text rendered by a real TritonMetrics,
as a gateway renders it, with StageServe's own families after it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from stageserve.metrics_merge import LOCAL_CACHE_RULES, merge, parse
from stageserve.telemetry import TRITON_FAMILIES, TritonMetrics, model_labels

SIMPLE = model_labels("simple", 1)
ADD = model_labels("add", "2")
HOST = {"nv_cpu_memory_total_bytes": 16e9, "nv_cpu_utilization": 0.25}


def _gateway(
    success: dict[tuple, float],
    failures: dict[str, float] | None = None,
    pending: float | None = None,
    host: dict[str, float] | None = None,
    cache: dict[str, float] | None = None,
) -> str:
    """One gateway's /metrics: its Triton families, then a `stageserve_*` one."""
    m = TritonMetrics()
    for labels, n in success.items():
        m.inc("nv_inference_request_success", labels, n)
        m.inc("nv_inference_count", labels, 2 * n)
        m.inc("nv_inference_request_duration_us", labels, 100 * n)
    for reason, n in (failures or {}).items():
        m.inc("nv_inference_request_failure", (*SIMPLE, ("reason", reason)), n)
    if pending is not None:
        m.set("nv_inference_pending_request_count", SIMPLE, pending)
    for name, value in {**HOST, **(host or {})}.items():
        m.set(name, (), value)
    for name, value in (cache or {}).items():
        m.set(name, (), value)
    registry = CollectorRegistry()
    Counter("stageserve_gateway_requests", "own family", registry=registry).inc(3)
    return m.render() + generate_latest(registry).decode()


def _value(text: str, name: str, labels: tuple = ()) -> float | None:
    return parse(text).get(name, {}).get(labels)


def test_counters_are_summed_per_label_set() -> None:
    text = merge([_gateway({SIMPLE: 3, ADD: 1}), _gateway({SIMPLE: 4})])
    assert _value(text, "nv_inference_request_success", SIMPLE) == 7
    assert _value(text, "nv_inference_request_success", ADD) == 1
    assert _value(text, "nv_inference_count", SIMPLE) == 14
    assert _value(text, "nv_inference_request_duration_us", SIMPLE) == 700


def test_failures_are_summed_per_reason() -> None:
    text = merge(
        [
            _gateway({}, {"REJECTED": 2, "BACKEND": 1}),
            _gateway({}, {"REJECTED": 5, "OTHER": 1}),
        ]
    )
    failures = parse(text)["nv_inference_request_failure"]
    assert failures == {
        (*SIMPLE, ("reason", "REJECTED")): 7,
        (*SIMPLE, ("reason", "BACKEND")): 1,
        (*SIMPLE, ("reason", "OTHER")): 1,
    }
    # label order as the gateways render it: model, version, reason
    assert 'nv_inference_request_failure{model="simple",version="1",reason="REJECTED"} 7' in text


def test_pending_requests_are_the_fullest_view_not_a_sum() -> None:
    # each gateway reports the stack's backlog; one missed a scheduler (2)
    text = merge([_gateway({}, pending=3), _gateway({}, pending=2), _gateway({})])
    assert _value(text, "nv_inference_pending_request_count", SIMPLE) == 3


def test_host_gauges_are_taken_once_from_the_first_that_answered() -> None:
    first = _gateway({}, host={"nv_cpu_utilization": 0.5})
    second = _gateway({}, host={"nv_cpu_utilization": 0.75})
    text = merge([first, second])
    assert _value(text, "nv_cpu_memory_total_bytes") == 16e9  # not 32e9
    assert _value(text, "nv_cpu_utilization") == 0.5
    assert _value(merge([second]), "nv_cpu_utilization") == 0.75


def test_a_shared_cache_counts_per_gateway_and_holds_one_set_of_entries() -> None:
    a: dict[str, float] = {"nv_cache_num_hits": 4, "nv_cache_num_lookups": 6}
    b: dict[str, float] = {"nv_cache_num_hits": 1, "nv_cache_num_lookups": 1}
    a.update(nv_cache_num_entries=9, nv_cache_util=0.5)
    b.update(nv_cache_num_entries=0, nv_cache_util=0.0)
    text = merge([_gateway({}, cache=b), _gateway({}, cache=a)])
    assert _value(text, "nv_cache_num_hits") == 5
    assert _value(text, "nv_cache_num_lookups") == 7
    assert _value(text, "nv_cache_num_entries") == 9  # the one cache, its latest view
    assert _value(text, "nv_cache_util") == 0.5


def test_local_caches_add_their_entries_and_average_their_utilization() -> None:
    a: dict[str, float] = {"nv_cache_num_entries": 9, "nv_cache_util": 0.5}
    b: dict[str, float] = {"nv_cache_num_entries": 3, "nv_cache_util": 0.25}
    text = merge([_gateway({}, cache=a), _gateway({}, cache=b)], LOCAL_CACHE_RULES)
    assert _value(text, "nv_cache_num_entries") == 12
    assert _value(text, "nv_cache_util") == 0.375


def test_a_gateway_missing_from_a_scrape_leaves_the_others_answer() -> None:
    gateways = [_gateway({SIMPLE: 3}), _gateway({SIMPLE: 4})]
    assert _value(merge(gateways[1:]), "nv_inference_request_success", SIMPLE) == 4
    assert merge([]) == ""


def test_help_and_type_once_per_family_in_tritons_format_without_own_families() -> None:
    one = _gateway({SIMPLE: 3}, {"REJECTED": 1}, pending=1)
    text = merge([one, _gateway({SIMPLE: 4, ADD: 1})])
    for name in parse(text):
        kind, help_text = TRITON_FAMILIES[name]
        assert text.count(f"# HELP {name} ") == 1
        assert text.count(f"# TYPE {name} ") == 1
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" in text
    assert "_total{" not in text and "_total " not in text and "stageserve_" not in text
    # One gateway's Triton text comes back as that gateway rendered it.
    assert merge([one]) == one.split("# HELP stageserve_")[0]


def test_label_values_with_quotes_and_backslashes_survive() -> None:
    odd = model_labels('we"ird\\name', 1)
    text = merge([_gateway({odd: 1}), _gateway({odd: 2})])
    assert _value(text, "nv_inference_request_success", odd) == 3
    assert 'model="we\\"ird\\\\name"' in text
