"""The gateway's per-request records: one success moves ModelStatistics, Triton's
counters and the phase histograms by the same numbers; LoopHistogram renders
exactly what prometheus_client's Histogram renders; the in-flight gauge reads
ModelTable's count at scrape time."""

from __future__ import annotations

import itertools

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest

from services.gateway.dataplane import DataPlane
from services.gateway.model_table import ModelEntry, ModelTable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.recorder import RequestRecorder
from stageserve.statistics import StatsBook
from stageserve.telemetry import LATENCY_BUCKETS, LoopHistogram, TritonMetrics, model_labels

_names = itertools.count()


def _unique(prefix: str) -> str:
    """Metric and model names no other test in this process uses (REGISTRY is global)."""
    return f"{prefix}_{next(_names)}"


def _lines(text: bytes, name: str) -> list[str]:
    return [
        line.replace(name, "NAME")
        for line in text.decode().splitlines()
        if name in line and "_created" not in line
    ]


def test_loop_histogram_renders_what_prometheus_histogram_renders() -> None:
    reference_registry = CollectorRegistry()
    ref_name, loop_name = _unique("ref_seconds"), _unique("loop_seconds")
    reference = Histogram(
        ref_name, "doc", ["model", "phase"], buckets=LATENCY_BUCKETS, registry=reference_registry
    )
    loop = LoopHistogram(loop_name, "doc", ["model", "phase"], LATENCY_BUCKETS)
    # on a bound, just above one, zero, beyond the last bound, several label sets
    values = [0.0, 0.0001, 0.00010001, 0.0005, 0.003, 1, 10, 11, 1e9]
    for phase in ("queue", "request"):
        for v in values:
            reference.labels("m", phase).observe(v)
            loop.labels("m", phase).observe(v)
    rendered = _lines(generate_latest(REGISTRY), loop_name)
    assert rendered == _lines(generate_latest(reference_registry), ref_name)
    assert 'NAME_bucket{le="+Inf",model="m",phase="queue"} 9.0' in rendered
    assert 'NAME_count{model="m",phase="request"} 9.0' in rendered


def test_loop_histogram_checks_its_labels() -> None:
    loop = LoopHistogram(_unique("labels_seconds"), "doc", ["a", "b"], LATENCY_BUCKETS)
    try:
        loop.labels("only-one")
    except ValueError as exc:
        assert "takes labels" in str(exc)
    else:
        raise AssertionError("a missing label was accepted")


def test_a_success_moves_statistics_counters_and_histograms_together() -> None:
    model = _unique("recorded")
    metrics = TritonMetrics()
    book = StatsBook()
    recorder = RequestRecorder(book, metrics)
    leader = pb.Timing(
        queue_ns=2_000_000,
        compute_input_ns=3_000,
        compute_infer_ns=40_000,
        compute_output_ns=5_000,
        batch_leader=True,
        batch_size=3,
    )
    follower = pb.Timing(queue_ns=1_500, batch_size=3)
    recorder.success(model, 1, 7_654_321, 2, leader)
    recorder.success(model, 1, 1_999, 1, follower)

    labels = model_labels(model, 1)
    value = metrics.get
    assert value("nv_inference_request_success", labels) == 2
    assert value("nv_inference_count", labels) == 3
    assert value("nv_inference_exec_count", labels) == 1
    assert value("nv_inference_request_duration_us", labels) == 7_654 + 1
    assert value("nv_inference_queue_duration_us", labels) == 2_000 + 1
    assert value("nv_inference_compute_infer_duration_us", labels) == 40

    stats = book.of(model, 1)
    assert stats.success.count == 2 and stats.success.ns == 7_654_321 + 1_999
    assert stats.queue.ns == 2_001_500 and stats.compute_infer.count == 2
    assert stats.inference_count == 3 and stats.execution_count == 1
    assert set(stats.batches) == {3} and stats.batches[3].compute_infer.ns == 40_000

    sample = REGISTRY.get_sample_value
    request = {"model": model, "version": "1", "phase": "request"}
    assert sample("stageserve_request_duration_seconds_count", request) == 2
    assert sample("stageserve_request_duration_seconds_sum", request) == (
        7_654_321 / 1e9 + 1_999 / 1e9
    )
    le_1ms = {**request, "le": "0.001"}
    assert sample("stageserve_request_duration_seconds_bucket", le_1ms) == 1


def test_a_model_loaded_again_counts_from_zero_and_an_unloaded_one_keeps_only_failures() -> None:
    model = _unique("reloaded")
    metrics = TritonMetrics()
    generation = {model: 1}
    recorder = RequestRecorder(StatsBook(lambda m: generation.get(m, 0)), metrics)
    labels = model_labels(model, 1)
    other = _unique("other")
    recorder.loaded(other, 1)
    recorder.loaded(model, 1)  # before any request: every counter at 0
    assert metrics.get("nv_inference_request_success", labels) == 0
    assert (labels, 0) in metrics._values["nv_inference_count"].items()
    recorder.success(model, 1, 1_000, 1, pb.Timing(batch_leader=True, batch_size=1))
    recorder.failure(model, 1, 1_000, pb.BACKEND_FAILED)
    assert metrics.get("nv_inference_request_success", labels) == 1
    generation[model] = 2  # loaded again
    recorder.success(model, 1, 1_000, 1, pb.Timing(batch_leader=True, batch_size=1))
    assert metrics.get("nv_inference_request_success", labels) == 1
    assert metrics.get("nv_inference_request_failure", (*labels, ("reason", "BACKEND"))) == 0
    recorder.unloaded({(other, 1)})  # this model is not loaded now
    assert labels not in metrics._values["nv_inference_request_success"]
    assert (*labels, ("reason", "OTHER")) in metrics._values["nv_inference_request_failure"]
    assert model_labels(other, 1) in metrics._values["nv_inference_request_success"]


def test_a_failure_first_after_a_load_again_is_counted_in_the_new_load() -> None:
    model = _unique("failed_first")
    metrics = TritonMetrics()
    generation = {model: 1}
    recorder = RequestRecorder(StatsBook(lambda m: generation.get(m, 0)), metrics)
    backend = (*model_labels(model, 1), ("reason", "BACKEND"))
    recorder.failure(model, 1, 1_000, pb.BACKEND_FAILED)
    generation[model] = 2
    recorder.failure(model, 1, 1_000, pb.BACKEND_FAILED)
    recorder.success(model, 1, 1_000, 1, pb.Timing(batch_leader=True, batch_size=1))
    assert metrics.get("nv_inference_request_failure", backend) == 1
    assert metrics.get("nv_inference_request_success", model_labels(model, 1)) == 1


def test_the_inflight_gauge_reads_the_model_tables_count() -> None:
    model = _unique("inflight")
    models = ModelTable()
    dataplane = DataPlane(models, lifecycle=None, scheduler=None)  # type: ignore[arg-type]
    entry = ModelEntry(name=model)
    dataplane._watch_inflight(model)
    gauge = {"model": model}

    def inflight() -> float | None:
        return REGISTRY.get_sample_value("stageserve_gateway_inflight_requests", gauge)

    assert inflight() == 0
    models.begin(entry, 1)
    models.begin(entry, 2)
    assert inflight() == 2
    models.end(entry, 1)
    assert inflight() == 1
    models.end(entry, 2)
    assert inflight() == 0
