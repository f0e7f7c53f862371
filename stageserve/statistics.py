"""Per model-version inference statistics, as Triton's ModelStatistics reports them.

Pure bookkeeping: the gateway records each finished request here with the
timings the scheduler and worker reported. Triton's semantics: a batch of n
requests adds n to inference_count and 1 to execution_count; success and
fail durations are whole-request durations; batch_stats count executions by
batch size. Exactly one request per batch (the "leader") carries the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from stageserve.errors import invalid
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.names import parse_version, printable


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += max(0, ns)

    def to_pb(self) -> gs.StatisticDuration:
        return gs.StatisticDuration(count=self.count, ns=self.ns)


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelVersionStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)

    def record_success(self, request_ns: int, batch_size: int, timing: pb.Timing) -> None:
        self.success.add(request_ns)
        self.queue.add(timing.queue_ns)
        self.compute_input.add(timing.compute_input_ns)
        self.compute_infer.add(timing.compute_infer_ns)
        self.compute_output.add(timing.compute_output_ns)
        self.inference_count += max(batch_size, 1)
        self.last_inference_ms = int(time.time() * 1000)
        if timing.batch_leader:
            self.execution_count += 1
            b = self.batches.setdefault(int(timing.batch_size), BatchStats())
            b.compute_input.add(timing.compute_input_ns)
            b.compute_infer.add(timing.compute_infer_ns)
            b.compute_output.add(timing.compute_output_ns)

    def record_cache_hit(self, request_ns: int, queue_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache, as Triton 2.51 counts it
        (measured against it: tests/integration/test_response_cache.py): a
        success with its queue time (until the lookup began) and the lookup
        as cache_hit; no inference, execution nor last_inference."""
        self.success.add(request_ns)
        self.queue.add(queue_ns)
        self.cache_hit.add(lookup_ns)

    def record_cache_miss(self, lookup_insert_ns: int) -> None:
        """The cache's share of a request that missed and was run (its success
        recorded apart): lookup plus insertion, added to the request's
        duration too, as Triton does."""
        self.success.ns += max(0, lookup_insert_ns)
        self.cache_miss.add(lookup_insert_ns)

    def record_failure(self, request_ns: int) -> None:
        self.fail.add(request_ns)
        self.last_inference_ms = int(time.time() * 1000)

    def to_pb(self, name: str, version: int) -> gs.ModelStatistics:
        return gs.ModelStatistics(
            name=name,
            version=str(version),
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            inference_stats=gs.InferStatistics(
                success=self.success.to_pb(),
                fail=self.fail.to_pb(),
                queue=self.queue.to_pb(),
                compute_input=self.compute_input.to_pb(),
                compute_infer=self.compute_infer.to_pb(),
                compute_output=self.compute_output.to_pb(),
                cache_hit=self.cache_hit.to_pb(),
                cache_miss=self.cache_miss.to_pb(),
            ),
            batch_stats=[
                gs.InferBatchStatistics(
                    batch_size=size,
                    compute_input=b.compute_input.to_pb(),
                    compute_infer=b.compute_infer.to_pb(),
                    compute_output=b.compute_output.to_pb(),
                )
                for size, b in sorted(self.batches.items())
            ],
        )


class _Loaded(Protocol):
    name: str
    generation: int

    def ready_versions(self) -> list[int]: ...


def requested_versions(
    entries: Mapping[str, _Loaded], name: str, version: str
) -> list[tuple[str, int, int]]:
    """(model, version, generation) a ModelStatistics request covers, with
    Triton's INVALID_ARGUMENT for a model or version that is not loaded."""
    if not name:
        return [
            (n, v, e.generation) for n, e in sorted(entries.items()) for v in e.ready_versions()
        ]
    entry = entries.get(name)
    ready = entry.ready_versions() if entry is not None else []
    if entry is None or not ready:
        raise invalid(f"requested model '{printable(name)}' is not available")
    wanted = parse_version(version)
    if wanted is None:
        return [(name, v, entry.generation) for v in ready]
    if wanted not in ready:
        raise invalid(f"requested model version is not available for model '{name}'")
    return [(name, wanted, entry.generation)]


class StatsBook:
    """This gateway's statistics per model version, for the model's current
    load (generation): a model loaded again starts afresh, as in Triton."""

    def __init__(self, generation_of: Callable[[str], int] = lambda model: 0) -> None:
        self._stats: dict[tuple[str, int], tuple[int, ModelVersionStats]] = {}
        self._generation_of = generation_of

    def generation(self, model: str) -> int:
        """The model's current load."""
        return self._generation_of(model)

    def of(self, model: str, version: int, generation: int | None = None) -> ModelVersionStats:
        """`generation`: the model's current load, when the caller has it."""
        key = (model, version)
        if generation is None:
            generation = self._generation_of(model)
        held = self._stats.get(key)
        if held is None or held[0] != generation:
            held = self._stats[key] = (generation, ModelVersionStats())
        return held[1]

    def items(self) -> list[tuple[str, int, int, ModelVersionStats]]:
        """(model, version, generation, stats) for every version recorded."""
        return [(m, v, g, st) for (m, v), (g, st) in self._stats.items()]

    def reset(self, model: str) -> None:
        """A reloaded model starts its statistics afresh, as in Triton."""
        for key in [k for k in self._stats if k[0] == model]:
            del self._stats[key]


def merge(parts: Iterable[gs.ModelStatistics]) -> gs.ModelStatistics:
    """Add up one model version's statistics kept by several gateways: counts
    and durations sum, batch statistics sum per batch size, last_inference is
    the latest."""
    parts = list(parts)
    out = gs.ModelStatistics()
    out.CopyFrom(parts[0])
    del out.batch_stats[:]
    batches: dict[int, gs.InferBatchStatistics] = {}
    for i, p in enumerate(parts):
        if i:
            out.last_inference = max(out.last_inference, p.last_inference)
            out.inference_count += p.inference_count
            out.execution_count += p.execution_count
            for name in _INFER_FIELDS:
                _add(getattr(out.inference_stats, name), getattr(p.inference_stats, name))
        for b in p.batch_stats:
            held = batches.get(b.batch_size)
            if held is None:
                batches[b.batch_size] = held = gs.InferBatchStatistics(batch_size=b.batch_size)
            for name in ("compute_input", "compute_infer", "compute_output"):
                _add(getattr(held, name), getattr(b, name))
    out.batch_stats.extend(batches[size] for size in sorted(batches))
    return out


_INFER_FIELDS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


def _add(into: gs.StatisticDuration, other: gs.StatisticDuration) -> None:
    into.count += other.count
    into.ns += other.ns
