"""One place that records a finished request: ModelStatistics and metrics move together.

Every figure a user can read — ModelStatistics, Triton's nv_inference_*
counters, StageServe's latency histograms — is updated here from the same
numbers, so they always agree.

This runs once per request on the gateway's event loop, the gateway's
bottleneck at high concurrency: a (model, version)'s label tuple and
histogram children are looked up once, and the histograms are LoopHistograms
(stageserve/telemetry.py: no lock, no walk over the buckets). Measured with
timeit on this machine: 13.2 us per success before (five prometheus_client
observes took 5.0 us of it), 8.3 us after (0.9 us).
"""

from __future__ import annotations

from stageserve.errors import triton_reason
from stageserve.generated import stageserve_pb2 as pb
from stageserve.statistics import ModelVersionStats, StatsBook
from stageserve.telemetry import (
    REQUEST_DURATION,
    TRITON,
    Labels,
    LoopHistogramChild,
    TritonMetrics,
    model_labels,
)

_PHASES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# Triton's reason labels of nv_inference_request_failure, in its order.
FAILURE_REASONS = ("OTHER", "BACKEND", "CANCELED", "REJECTED")
# A model version's counters without a reason label.
MODEL_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)


class RequestRecorder:
    def __init__(self, book: StatsBook, triton: TritonMetrics = TRITON) -> None:
        self.book = book
        self.triton = triton
        # (model, version) -> its counter labels, phase histograms (in _PHASES
        # order) and the model's load (generation) they count
        self._labels: dict[tuple[str, int], tuple[Labels, tuple[LoopHistogramChild, ...], int]] = {}

    def _of(
        self, model: str, version: int
    ) -> tuple[ModelVersionStats, Labels, tuple[LoopHistogramChild, ...]]:
        """A (model, version)'s statistics, counter labels and phase
        histograms (in _PHASES order), for the model's current load: the load
        is looked up once per request."""
        generation = self.book.generation(model)
        labels, phases, _ = self._labels_of(model, version, generation)
        return self.book.of(model, version, generation), labels, phases

    def _labels_of(
        self, model: str, version: int, generation: int
    ) -> tuple[Labels, tuple[LoopHistogramChild, ...], int]:
        """A (model, version)'s counter labels and phase histograms, kept per
        load: a model loaded again counts from 0, as in Triton 2.51."""
        key = (model, version)
        cached = self._labels.get(key)
        if cached is None or cached[2] != generation:
            v = str(version)
            labels = model_labels(model, version)
            cached = self._labels[key] = (
                labels,
                tuple(REQUEST_DURATION.labels(model, v, phase) for phase in _PHASES),
                generation,
            )
            # Triton 2.51 shows a model's counters at 0 from its load, the
            # failure counter once per reason (tests/integration/test_metrics_triton.py).
            for name in MODEL_COUNTERS:
                self.triton.set(name, labels, 0)
            for reason in FAILURE_REASONS:
                self.triton.set("nv_inference_request_failure", (*labels, ("reason", reason)), 0)
        return cached

    def unloaded(self, ready: set[tuple[str, int]]) -> None:
        """Versions no longer loaded lose their counters, all but the failure
        counter, as Triton 2.51's do at the unload."""
        # (on the metrics server's thread: a copy of the keys, as the loop may add one)
        for key in [k for k in list(self._labels) if k not in ready]:
            gone = self._labels.pop(key, None)
            if gone is not None:
                for name in MODEL_COUNTERS:
                    self.triton.remove(name, gone[0])

    def loaded(self, model: str, version: int) -> None:
        """A loaded version's counters exist, at 0 until its first request,
        as Triton 2.51 shows them from the model's load."""
        self._labels_of(model, version, self.book.generation(model))

    def success(
        self, model: str, version: int, request_ns: int, batch_size: int, timing: pb.Timing
    ) -> None:
        stats, labels, phases = self._of(model, version)
        stats.record_success(request_ns, batch_size, timing)
        inc = self.triton.inc
        inc("nv_inference_request_success", labels)
        inc("nv_inference_count", labels, max(batch_size, 1))
        if timing.batch_leader:
            inc("nv_inference_exec_count", labels)
        inc("nv_inference_request_duration_us", labels, request_ns // 1000)
        inc("nv_inference_queue_duration_us", labels, timing.queue_ns // 1000)
        inc("nv_inference_compute_input_duration_us", labels, timing.compute_input_ns // 1000)
        inc("nv_inference_compute_infer_duration_us", labels, timing.compute_infer_ns // 1000)
        inc("nv_inference_compute_output_duration_us", labels, timing.compute_output_ns // 1000)
        request, queue, c_in, c_infer, c_out = phases
        request.observe(request_ns / 1e9)
        queue.observe(timing.queue_ns / 1e9)
        c_in.observe(timing.compute_input_ns / 1e9)
        c_infer.observe(timing.compute_infer_ns / 1e9)
        c_out.observe(timing.compute_output_ns / 1e9)

    def cache_hit(
        self, model: str, version: int, request_ns: int, queue_ns: int, lookup_ns: int
    ) -> None:
        """A request answered from the response cache: Triton 2.51's figures
        for a hit (a success, its request and queue time, the hit; no
        inference count, no execution, no compute phases)."""
        stats, labels, phases = self._of(model, version)
        stats.record_cache_hit(request_ns, queue_ns, lookup_ns)
        inc = self.triton.inc
        inc("nv_inference_request_success", labels)
        inc("nv_inference_request_duration_us", labels, request_ns // 1000)
        inc("nv_inference_queue_duration_us", labels, queue_ns // 1000)
        inc("nv_cache_num_hits_per_model", labels)
        inc("nv_cache_hit_duration_per_model", labels, lookup_ns // 1000)
        phases[0].observe(request_ns / 1e9)

    def cache_miss(self, model: str, version: int, lookup_insert_ns: int) -> None:
        """The cache's share of a request that missed (its success recorded by success())."""
        stats, labels, _ = self._of(model, version)
        stats.record_cache_miss(lookup_insert_ns)
        inc = self.triton.inc
        inc("nv_inference_request_duration_us", labels, lookup_insert_ns // 1000)
        inc("nv_cache_num_misses_per_model", labels)
        inc("nv_cache_miss_duration_per_model", labels, lookup_insert_ns // 1000)

    def failure(
        self,
        model: str,
        version: int,
        request_ns: int,
        reason: pb.FailureReason,
    ) -> None:
        """A failed request; `reason` (a FailureReason, as the stages told it)
        gives Triton's reason label of nv_inference_request_failure."""
        stats, labels, _ = self._of(model, version)  # (a new load's counters start at 0 first)
        stats.record_failure(request_ns)
        self.triton.inc(
            "nv_inference_request_failure", (*labels, ("reason", triton_reason(reason)))
        )
