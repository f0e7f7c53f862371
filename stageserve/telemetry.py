"""Prometheus metrics: Triton's own families, StageServe's per-stage ones, system.

Every service serves `/metrics` over HTTP on its --metrics-port. Each process
exports what it knows (the gateway: requests and their phases; the scheduler:
queue depth and batch sizes; the rate limiter: waits and instance usage; the
worker: compute per instance). Prometheus labels each series with the
scraped `instance`, so per-model figures add up with `sum by (model)`.

Triton's families are counters and gauges named exactly as Triton names them
(`nv_inference_count`, not `..._total`), rendered here rather than through
prometheus_client, whose counters always append `_total`.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from stageserve.net import listen_failed

# ------------------------------------------------------------------- Triton

TRITON_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_success": (
        "counter",
        "Number of successful inference requests, all batch sizes",
    ),
    "nv_inference_request_failure": (
        "counter",
        "Number of failed inference requests, all batch sizes",
    ),
    "nv_inference_count": (
        "counter",
        "Number of inferences performed (does not include cached requests)",
    ),
    "nv_inference_exec_count": (
        "counter",
        "Number of model executions performed (does not include cached requests)",
    ),
    "nv_inference_request_duration_us": (
        "counter",
        "Cumulative inference request duration in microseconds (includes cached requests)",
    ),
    "nv_inference_queue_duration_us": (
        "counter",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    ),
    "nv_inference_compute_input_duration_us": (
        "counter",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_infer_duration_us": (
        "counter",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_output_duration_us": (
        "counter",
        "Cumulative inference compute output duration in microseconds "
        "(does not include cached requests)",
    ),
    "nv_cache_num_hits_per_model": ("counter", "Number of cache hits per model"),
    "nv_cache_hit_duration_per_model": (
        "counter",
        "Total cache hit duration per model, in microseconds",
    ),
    "nv_cache_num_misses_per_model": ("counter", "Number of cache misses per model"),
    "nv_cache_miss_duration_per_model": (
        "counter",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
    ),
    # The response cache's, as a whole (services/gateway/cache_metrics.py):
    # Triton 2.51's names, types and help texts.
    "nv_cache_util": ("gauge", "Cache utilization [0.0 - 1.0]"),
    "nv_cache_num_entries": ("gauge", "Number of responses stored in response cache"),
    "nv_cache_num_hits": ("gauge", "Number of cache hits in response cache"),
    "nv_cache_num_misses": ("gauge", "Number of cache misses in response cache"),
    "nv_cache_num_lookups": ("gauge", "Number of cache lookups in response cache"),
    "nv_cache_num_evictions": ("gauge", "Number of cache evictions in response cache"),
    "nv_cache_lookup_duration": (
        "gauge",
        "Total cache lookup duration (hit and miss), in microseconds",
    ),
    "nv_cache_insertion_duration": ("gauge", "Total cache insertion duration, in microseconds"),
    "nv_inference_pending_request_count": (
        "gauge",
        "Instantaneous number of pending requests awaiting execution per-model.",
    ),
    "nv_model_load_duration_secs": ("gauge", "Model load time in seconds"),
    # StageServe keeps no pinned memory pool: both read 0 (Triton 2.51 shows
    # its pool's size, 256 MiB by default, even without CUDA).
    "nv_pinned_memory_pool_total_bytes": (
        "gauge",
        "Pinned memory pool total memory size, in bytes",
    ),
    "nv_pinned_memory_pool_used_bytes": ("gauge", "Pinned memory pool used memory size, in bytes"),
    "nv_cpu_utilization": ("gauge", "CPU utilization rate [0.0 - 1.0]"),
    "nv_cpu_memory_total_bytes": ("gauge", "CPU total memory (RAM), in bytes"),
    "nv_cpu_memory_used_bytes": ("gauge", "CPU used memory (RAM), in bytes"),
    # Triton's texts for the GPU families (its metrics.cc); not checked
    # against a running Triton here (no GPU on the test machines).
    "nv_gpu_utilization": ("gauge", "GPU utilization rate [0.0 - 1.0)"),
    "nv_gpu_memory_total_bytes": ("gauge", "GPU total memory, in bytes"),
    "nv_gpu_memory_used_bytes": ("gauge", "GPU used memory, in bytes"),
    "nv_gpu_power_usage": ("gauge", "GPU power usage in watts"),
    "nv_gpu_power_limit": ("gauge", "GPU power management limit in watts"),
    "nv_energy_consumption": ("gauge", "GPU energy consumed since the driver loaded, joules"),
}

#: The response cache's gauges, as a whole (services/gateway/cache_metrics.py):
#: what each gateway counts of its own lookups and insertions, and the cache's
#: state (entries held, utilization).
CACHE_COUNTS = (
    "nv_cache_num_lookups",
    "nv_cache_num_hits",
    "nv_cache_num_misses",
    "nv_cache_num_evictions",
    "nv_cache_lookup_duration",
    "nv_cache_insertion_duration",
)
CACHE_STATE = ("nv_cache_num_entries", "nv_cache_util")

Labels = tuple[tuple[str, str], ...]


class TritonMetrics:
    """Counters and gauges with Triton's names, rendered in the text format."""

    def __init__(self) -> None:
        self._values: dict[str, dict[Labels, float]] = {name: {} for name in TRITON_FAMILIES}
        self._lock = threading.Lock()

    def inc(self, name: str, labels: Labels, value: float = 1.0) -> None:
        family = self._values[name]
        family[labels] = family.get(labels, 0.0) + value

    def set(self, name: str, labels: Labels, value: float) -> None:
        self._values[name][labels] = value

    def get(self, name: str, labels: Labels) -> float:
        return self._values[name].get(labels, 0.0)

    def remove(self, name: str, labels: Labels) -> None:
        self._values[name].pop(labels, None)

    def render(self) -> str:
        lines: list[str] = []
        for name, (kind, help_text) in TRITON_FAMILIES.items():
            samples = list(self._values[name].items())
            if not samples:
                continue
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(
                    f"{name}{{{label_text}}} {_number(value)}"
                    if labels
                    else f"{name} {_number(value)}"
                )
        return "\n".join(lines) + ("\n" if lines else "")


def model_labels(model: str, version: int | str) -> Labels:
    return (("model", model), ("version", str(version)))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


TRITON = TritonMetrics()


def update_system_metrics(metrics: TritonMetrics = TRITON) -> None:
    """CPU and memory (and GPU, via nvidia-ml-py, when one is present)."""
    metrics.set("nv_pinned_memory_pool_total_bytes", (), 0.0)
    metrics.set("nv_pinned_memory_pool_used_bytes", (), 0.0)
    metrics.set("nv_cpu_utilization", (), psutil.cpu_percent(interval=None) / 100.0)
    mem = psutil.virtual_memory()
    metrics.set("nv_cpu_memory_total_bytes", (), float(mem.total))
    metrics.set("nv_cpu_memory_used_bytes", (), float(mem.total - mem.available))
    for reading in gpu_readings():
        labels = (("gpu_uuid", reading.uuid),)
        metrics.set("nv_gpu_utilization", labels, reading.utilization)
        metrics.set("nv_gpu_memory_total_bytes", labels, reading.memory_total)
        metrics.set("nv_gpu_memory_used_bytes", labels, reading.memory_used)
        metrics.set("nv_gpu_power_usage", labels, reading.power)
        metrics.set("nv_gpu_power_limit", labels, reading.power_limit)
        metrics.set("nv_energy_consumption", labels, reading.energy)


@dataclass(frozen=True)
class GpuReading:
    uuid: str
    utilization: float  # 0..1
    memory_total: float  # bytes
    memory_used: float
    power: float  # watts
    power_limit: float  # watts
    energy: float  # joules since the driver loaded


def gpu_readings() -> list[GpuReading]:
    """One reading per GPU from nvidia-ml-py; [] without it, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU
        return []
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        power = _optional(pynvml.nvmlDeviceGetPowerUsage, handle) / 1000.0  # mW
        limit = _optional(pynvml.nvmlDeviceGetPowerManagementLimit, handle) / 1000.0  # mW
        energy = _optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle) / 1000.0  # mJ
        out.append(GpuReading(uuid, util, float(mem.total), float(mem.used), power, limit, energy))
    return out


def _optional(read, handle) -> float:
    """A reading some GPUs do not support (NVMLError_NotSupported): 0."""
    try:
        return float(read(handle))
    except Exception:
        return 0.0


# ------------------------------------------------------------ StageServe's

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class LoopHistogramChild:
    """One label set's buckets: plain numbers, no lock (see LoopHistogram)."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is >= amount, as prometheus_client's `le`.
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.total += amount


class LoopHistogram:
    """A histogram family for figures observed once per request on one thread.

    prometheus_client's Histogram takes a lock and walks the bucket list on
    every observe: 1.0 us each (timeit, this machine), and the gateway observed
    six per request (five phases and the RPC timer) on its event loop, which
    is its bottleneck at c=64. Here a child is a list of counts and a sum
    updated in place (bisect: 0.3 us), rendered by a collector at scrape time
    with the same name, labels, buckets, _count and _sum (no _created).
    Each child must be observed from one thread at a time (the event loop);
    a scrape from the metrics thread reads a snapshot that may lag by one
    observation, never a torn number."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        REGISTRY.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogramChild(self.bounds)
        return child

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.total
            running, buckets = 0, []
            for le, count in zip(les, counts, strict=True):
                running += count
                buckets.append((le, running))
            family.add_metric(list(key), buckets, total)
        yield family


REQUEST_DURATION = LoopHistogram(
    "stageserve_request_duration_seconds",
    "Per-request latency by phase: request (whole, at the gateway), queue, compute_*",
    ["model", "version", "phase"],
    buckets=LATENCY_BUCKETS,
)
GATEWAY_RPC_DURATION = LoopHistogram(
    "stageserve_gateway_rpc_duration_seconds",
    "Public RPC handling time at the gateway",
    ["method", "code"],
    buckets=LATENCY_BUCKETS,
)
#: stageserve/loop_lag.py's probe: how late the stage's event loop woke it
EVENT_LOOP_LAG = LoopHistogram(
    "stageserve_event_loop_lag_seconds",
    "How much later than due the stage's event loop ran a periodic probe",
    [],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
)
GATEWAY_INFLIGHT = Gauge(
    "stageserve_gateway_inflight_requests", "Inference requests in flight at the gateway", ["model"]
)
TENSOR_SLOTS_IN_USE = Gauge(
    "stageserve_tensor_slots_in_use",
    "Slots of this process's shared-memory tensor region in use (stageserve/tensor_shm.py)",
    ["stage"],
)
SCHEDULER_QUEUE_DEPTH = Gauge(
    "stageserve_scheduler_queue_depth", "Requests queued, not yet executing", ["model", "version"]
)
SCHEDULER_SHARD_OWNED = Gauge(
    "stageserve_scheduler_shard_owned",
    "1 for each model whose queues this scheduler owns (schedulers sharded by model)",
    ["model"],
)
SCHEDULER_BATCH_SIZE = Histogram(
    "stageserve_scheduler_batch_size",
    "Batch size of each execution the scheduler dispatched",
    ["model", "version"],
    buckets=BATCH_BUCKETS,
)
RATELIMITER_WAIT = Histogram(
    "stageserve_ratelimiter_wait_seconds",
    "Time an Acquire waited for a free instance",
    ["model", "version"],
    buckets=LATENCY_BUCKETS,
)
RATELIMITER_INSTANCES = Gauge(
    "stageserve_ratelimiter_instances",
    "Registered instances by state (free / busy)",
    ["model", "version", "state"],
)
RATELIMITER_GRANTS = Counter(
    "stageserve_ratelimiter_grants", "Execution grants handed out", ["model", "version"]
)
RATELIMITER_GRANT_WAIT = Histogram(
    "stageserve_ratelimiter_grant_wait_seconds",
    "Time a granted Acquire waited, by model and the granted instance's priority",
    ["model", "priority"],
    buckets=LATENCY_BUCKETS,
)
RATELIMITER_RESOURCES = Gauge(
    "stageserve_ratelimiter_resources",
    "Rate limiter resource counts per device (or global): held / available",
    ["resource", "device", "state"],
)
WORKER_COMPUTE = Histogram(
    "stageserve_worker_compute_seconds",
    "Batch compute time per instance and phase (input / infer / output)",
    ["model", "version", "model_instance", "phase"],
    buckets=LATENCY_BUCKETS,
)
CUDA_SHM_COPIES = Counter(
    "stageserve_cuda_shm_copies",
    "Copies between the gateway and clients' CUDA shared-memory regions, by direction "
    "(d2h: an input read out of a region; h2d: an output written into one; d2d: a tensor "
    "the worker read or wrote in the region itself, on its device)",
    ["direction"],
)
STREAM_MESSAGES = Counter(
    "stageserve_stream_messages",
    "Messages written on internal streams by their client end, by link (scheduler: "
    "gateway -> scheduler; worker: scheduler -> worker; ratelimiter: scheduler -> rate "
    "limiter). Every message has a fixed CPU cost on both ends: requests per message "
    "(stageserve_stream_requests_total over this) is what packing and the write hold win",
    ["link"],
)
STREAM_REQUESTS = Counter(
    "stageserve_stream_requests",
    "Requests carried by the messages of stageserve_stream_messages_total, by link",
    ["link"],
)
STAGE_RPC_DURATION = Histogram(
    "stageserve_stage_rpc_duration_seconds",
    "Inter-stage call latency, from the caller's side",
    ["service", "peer", "method"],
    buckets=LATENCY_BUCKETS,
)
STAGE_RPC_ERRORS = Counter(
    "stageserve_stage_rpc_errors",
    "Inter-stage calls that failed, by status code",
    ["service", "peer", "method", "code"],
)


# ------------------------------------------------------------------- server


def render(include_triton: bool = True) -> bytes:
    update_system_metrics()
    text = TRITON.render().encode() if include_triton else b""
    return text + generate_latest(REGISTRY)


def _handler(body: Callable[[], bytes]) -> type[BaseHTTPRequestHandler]:
    """A request handler answering GET /metrics (and /) with `body()`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            text = body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            return

    return Handler


def serve_metrics(
    port: int, host: str = "0.0.0.0", body: Callable[[], bytes] = render
) -> ThreadingHTTPServer:
    """Serve /metrics (`body()`, this process's metrics by default) from a
    daemon thread; returns the server (port 0 picks one). A port it cannot
    bind raises ListenFailed with Triton's message."""
    try:
        server = ThreadingHTTPServer((host, port), _handler(body))
    except OSError as exc:
        raise listen_failed("Metrics", f"{host}:{port}", exc) from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    psutil.cpu_percent(interval=None)  # prime: the first reading is meaningless
    return server
