"""`python -m bench.scale`: one stack, its throughput and each stage's CPU per inference.

Starts one StageServe stack (`stageserve up`'s start_services, so the same
processes `up` runs) with the given gateway and worker counts (`auto`: what
`stageserve up --gateways auto` / `--workers auto` pick on this host), serving
three models, and runs perf_analyzer against each at each concurrency:

* ``identity``: FP32 [16] (bench.references), the per-request overhead;
* ``identity_49k``: FP32 [3, 64, 64] (49,152 bytes per request),
  max_batch_size 32, dynamic batching: issue 26's per-stage CPU targets;
* ``cnn``: the compute-bound CNN of bench/cnn.py.

For every point it prints throughput, p50 and p99 (perf_analyzer, gRPC by
default), the inferences per model execution (ModelStatistics), and per
stage (gateway, scheduler, ratelimiter, worker, redis; the processes of a
kind summed) the cores it used and its CPU microseconds per inference:
psutil's user+system CPU time of each stage's pid (and its children) before
and after the perf_analyzer run, divided by the inferences ModelStatistics
counted in between (read after the gateways' statistics
publish period, so every gateway's share is in), and per internal link the
requests each stream message carried (`req/msg sched`: gateways ->
scheduler; `batches/msg wk`: schedulers -> workers, a batch per request),
from every stage's stageserve_stream_* counters over the run, and the cores
perf_analyzer itself used (`pa cores`: it shares the host with the stack). It
runs on any host: on a
2-core machine it records the per-stage costs, on a many-core host the
headline. Figures: docs/benchmarks.md.

  python -m bench.scale                                  # auto counts, c=32, all 3 models
  python -m bench.scale --gateways 2 --models identity_49k --concurrency 32 64
  python -m bench.scale --json out.json                  # the points as JSON too
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bench.perf_analyzer import PerfAnalyzerError, PerfAnalyzerUnstable, run_perf
from bench.profile import Recorder, format_profile
from bench.references import (
    BenchModel,
    _StageServeLogs,
    bench_model,
    tree_cpu_seconds,
    wait_ready,
)
from stageserve.gpus import AUTO, gpu_count, worker_devices
from stageserve.launcher import Stack, start_services
from stageserve.net import free_port
from stageserve.scale_out import gateway_count, parse_gateways, usable_cores
from stageserve.settings import settings_from_env
from stageserve_tools.examples import config_text, identity_model, write_model

MODELS = ("identity", "identity_49k", "cnn")
#: The 49 KB identity of issue 26's per-stage targets.
IDENTITY_49K_DIMS = (3, 64, 64)
IDENTITY_49K_MAX_BATCH = 32
#: Every other model's max_batch_size (bench.references').
MAX_BATCH = 64
STAGES = ("gateway", "scheduler", "ratelimiter", "worker", "redis")
SHORT = {
    "gateway": "gw",
    "scheduler": "sched",
    "ratelimiter": "rl",
    "worker": "wk",
    "redis": "redis",
}


def scale_model(name: str) -> tuple[BenchModel, int]:
    """One of MODELS and its max_batch_size."""
    if name == "identity_49k":
        onnx = identity_model("FP32", IDENTITY_49K_DIMS, IDENTITY_49K_MAX_BATCH)
        tensor = ("FP32", IDENTITY_49K_DIMS)
        return (
            BenchModel(
                name,
                onnx.SerializeToString(),
                (("INPUT0", *tensor),),
                (("OUTPUT0", *tensor),),
            ),
            IDENTITY_49K_MAX_BATCH,
        )
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return bench_model(name), MAX_BATCH


def write_repository(root: Path, models: Sequence[tuple[BenchModel, int]]) -> Path:
    """ONNX models, one CPU instance each, dynamic batching (Triton's config)."""
    for model, max_batch in models:
        text = config_text(
            model.name,
            model.inputs,
            model.outputs,
            max_batch_size=max_batch,
            dynamic_batching=True,
        )
        write_model(root, model.name, model.onnx, text)
    return root


def stage_of(child_name: str) -> str:
    """A launcher Child's name -> its stage kind (gateway-1 -> gateway, worker-0 -> worker)."""
    for stage in STAGES:
        if child_name == stage or child_name.startswith(f"{stage}-"):
            return stage
    return child_name


@dataclass
class StageCost:
    processes: int
    cores: float
    cpu_us_per_inf: float | None


@dataclass
class Point:
    model: str
    concurrency: int
    protocol: str
    throughput: float
    p50_us: float
    p99_us: float
    cores: float  # every process of the stack
    batch: float | None  # inferences per model execution
    stable: bool
    stages: dict[str, StageCost] = field(default_factory=dict)
    # internal link (scheduler, worker) -> requests per stream message
    per_message: dict[str, float] = field(default_factory=dict)
    # perf_analyzer's own cores over the run (it shares the host with the
    # stack: where the stack uses fewer cores than the host has, this says
    # whether the client took the rest)
    client_cores: float | None = None
    # the busiest scheduler's main thread (its event loop, where its own work
    # runs; grpc's poller threads are apart) in cores over the run: near 1.0,
    # that loop is what binds the model
    sched_loop_cores: float | None = None
    # the p99 of the busiest scheduler's event-loop lag over the run (a bucket
    # bound of stageserve_event_loop_lag_seconds, in ms): how long what is
    # due there (a result that hands out the next batch) waits for its loop
    sched_lag_p99_ms: float | None = None


#: The links whose requests per message a point shows, and their column names.
LINKS = {"scheduler": "req/msg sched", "worker": "batches/msg wk"}
Counts = dict[str, tuple[float, float]]  # link -> (messages, requests)


def scrape(port: int) -> list[Metric]:
    """The metric families of the stage serving /metrics on `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def stream_counts(metrics_ports: Sequence[int]) -> Counts:
    """link -> (messages, requests) written on it by the stages serving
    /metrics on `metrics_ports`, summed."""
    which = {"stageserve_stream_messages": 0, "stageserve_stream_requests": 1}
    totals: dict[str, list[float]] = {}
    for port in metrics_ports:
        for family in scrape(port):
            if family.name not in which:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    link = sample.labels["link"]
                    totals.setdefault(link, [0.0, 0.0])[which[family.name]] += sample.value
    return {link: (m, r) for link, (m, r) in totals.items()}


def per_message(before: Counts, after: Counts) -> dict[str, float]:
    """link -> requests per message written between two stream_counts."""
    out = {}
    for link, (messages, requests) in after.items():
        m0, r0 = before.get(link, (0.0, 0.0))
        if messages > m0:
            out[link] = (requests - r0) / (messages - m0)
    return out


LAG = "stageserve_event_loop_lag_seconds"
Buckets = dict[float, float]  # upper bound (le) -> cumulative count


def lag_buckets(port: int) -> Buckets:
    """The event-loop lag histogram (stageserve/loop_lag.py) of the stage
    serving /metrics on `port`."""
    return {
        float(sample.labels["le"]): sample.value
        for family in scrape(port)
        if family.name == LAG
        for sample in family.samples
        if sample.name == f"{LAG}_bucket"
    }


def quantile_bound(before: Buckets, after: Buckets, q: float) -> float | None:
    """The smallest bucket bound under which at least `q` of the
    observations between two lag_buckets fall (inf: beyond the last bound);
    None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * counts[-1]:
            return bound
    return bounds[-1]


def reaped_children_cpu() -> float:
    """User+system CPU seconds of this process's children that ended and were
    waited for (perf_analyzer, once run_perf returns; the stack's processes
    are still running and count nowhere here)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main_thread_cpu(pid: int) -> float:
    """user+system CPU seconds of a process's main thread (the thread whose
    id is the pid); 0.0 once the process is gone."""
    try:
        threads = psutil.Process(pid).threads()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return sum(t.user_time + t.system_time for t in threads if t.id == pid)


def stage_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    """stage -> user+system CPU seconds of its processes (and their children)."""
    return {stage: tree_cpu_seconds(p) for stage, p in pids.items()}


def inference_counts(url: str, model: str) -> tuple[int, int]:
    """(inferences, model executions) from ModelStatistics."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    return (
        sum(s.inference_count for s in stats.model_stats),
        sum(s.execution_count for s in stats.model_stats),
    )


@contextlib.contextmanager
def profiled(folder: Path | None, pids: dict[str, list[int]], label: str) -> Iterator[None]:
    """With a folder: py-spy on every stage process meanwhile, each stage's
    summary printed after (bench/profile.py)."""
    if folder is None:
        yield
        return
    recorder = Recorder(folder)
    recorder.start(
        [(f"{stage}-{i}", pid) for stage, procs in pids.items() for i, pid in enumerate(procs)],
        label,
    )
    try:
        yield
    finally:
        for stage_profile in recorder.stop():
            print(format_profile(stage_profile), flush=True)


def measure(
    url: str,
    pids: dict[str, list[int]],
    metrics_ports: Sequence[int],
    model: BenchModel,
    concurrency: int,
    args: argparse.Namespace,
    input_data: Path,
    settle_s: float,
    lag_ports: Sequence[int] = (),
) -> Point:
    """One perf_analyzer run and the stages' CPU over it; `lag_ports`: the
    schedulers' metrics ports, for their event-loop lag."""
    pct, trials, stable = args.stability_pct, args.max_trials, True
    while True:
        count0, executions0 = inference_counts(url, model.name)
        streams0 = stream_counts(metrics_ports)
        lags0 = {port: lag_buckets(port) for port in lag_ports}
        loops0 = {pid: main_thread_cpu(pid) for pid in pids.get("scheduler", [])}
        cpu0, t0 = stage_cpu(pids), time.monotonic()
        client0 = reaped_children_cpu()
        try:
            result = run_perf(
                url if args.protocol == "grpc" else args.http_url,
                model.name,
                concurrency,
                measurement_ms=args.measurement_ms,
                stability_pct=pct,
                extra_args=["--max-trials", str(trials)],
                protocol=args.protocol,
                shapes=model.input_shapes,
                input_data=input_data,
            )
        except PerfAnalyzerUnstable:
            # As bench.compare: once more over 3 windows at a relaxed
            # criterion, and the point is marked unstable.
            if not stable or args.unstable_retry_pct <= pct:
                raise
            pct, trials, stable = args.unstable_retry_pct, 3, False
            continue
        break
    cpu1, wall = stage_cpu(pids), time.monotonic() - t0
    loops = [(main_thread_cpu(pid) - used) / wall for pid, used in loops0.items()]
    lag_p99 = [quantile_bound(lags0[port], lag_buckets(port), 0.99) for port in lag_ports]
    lag_known = [b for b in lag_p99 if b is not None]
    client_cores = (reaped_children_cpu() - client0) / wall
    streams1 = stream_counts(metrics_ports)
    # Every gateway publishes its statistics each stats_publish_s: wait one
    # period (and some) so the count holds every gateway's share.
    time.sleep(settle_s)
    count1, executions1 = inference_counts(url, model.name)
    inferences, executions = count1 - count0, executions1 - executions0
    stages = {}
    for stage, procs in pids.items():
        used = cpu1[stage] - cpu0[stage]
        stages[stage] = StageCost(
            len(procs),
            used / wall,
            used / inferences * 1e6 if inferences > 0 else None,
        )
    return Point(
        model.name,
        concurrency,
        args.protocol,
        result.throughput,
        result.p50_us,
        result.p99_us,
        sum(s.cores for s in stages.values()),
        inferences / executions if executions > 0 else None,
        stable,
        stages,
        per_message(streams0, streams1),
        client_cores,
        max(loops) if loops else None,
        max(lag_known) * 1000 if lag_known else None,
    )


def format_points(points: Sequence[Point]) -> str:
    head = ["model", "c", "infer/s", "p50 ms", "p99 ms", "batch", "cores"]
    stages = [s for s in STAGES if any(s in p.stages for p in points)]
    head += [f"{SHORT[s]} us/inf" for s in stages] + [f"{SHORT[s]} cores" for s in stages]
    head += [*LINKS.values(), "pa cores", "sched loop cores", "sched lag p99 ms"]
    rows = []
    for p in points:
        row = [
            p.model,
            str(p.concurrency),
            f"{p.throughput:,.0f}",
            f"{p.p50_us / 1000:.2f}",
            f"{p.p99_us / 1000:.2f}",
            "-" if p.batch is None else f"{p.batch:.1f}",
            f"{p.cores:.2f}" + ("" if p.stable else " (unstable)"),
        ]
        for s in stages:
            us = p.stages[s].cpu_us_per_inf if s in p.stages else None
            row.append("-" if us is None else f"{us:.0f}")
        for s in stages:
            row.append(f"{p.stages[s].cores:.2f}" if s in p.stages else "-")
        for link in LINKS:
            ratio = p.per_message.get(link)
            row.append("-" if ratio is None else f"{ratio:.1f}")
        row.append("-" if p.client_cores is None else f"{p.client_cores:.2f}")
        row.append("-" if p.sched_loop_cores is None else f"{p.sched_loop_cores:.2f}")
        row.append("-" if p.sched_lag_p99_ms is None else f"<={p.sched_lag_p99_ms:g}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in [head, *rows]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--gateways", type=parse_gateways, default=AUTO, help="N or auto")
    ap.add_argument("--workers", default=AUTO, help="N or auto (one per GPU; 1 without)")
    ap.add_argument("--device", default="cpu", help="the workers' --device")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--measurement-ms", type=int, default=5000)
    ap.add_argument("--stability-pct", type=int, default=20)
    ap.add_argument("--max-trials", type=int, default=10)
    ap.add_argument(
        "--unstable-retry-pct",
        type=int,
        default=50,
        help="no stable measurement: once more over 3 windows at this -s, marked unstable",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the points here as JSON")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy every stage process during each point (raw stacks into this folder) and "
        "print where each spends its CPU; the figures of a profiled run include py-spy's cost",
    )
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile is not None and not Recorder.available():
        print("bench.scale --profile: py-spy is not installed (pip install py-spy)", flush=True)
        return 2
    settings = settings_from_env()
    gateways = gateway_count(args.gateways, settings.stack)
    workers: int | str = args.workers if args.workers == AUTO else int(args.workers)
    gpus = gpu_count() if workers == AUTO else 0
    worker_count = len(worker_devices(workers, args.device, gpus))
    cores = usable_cores()
    print(
        f"bench.scale: {platform.node()} {cores} cores, {gpus} GPUs; "
        f"{gateways} gateway(s) ({args.gateways}), {worker_count} worker(s) ({args.workers}), "
        f"perf_analyzer -i {args.protocol}",
        flush=True,
    )
    models = [scale_model(m) for m in args.models]
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        repo = write_repository(work / "models", models)
        logs = _StageServeLogs(work / "stageserve.log")
        stack = Stack()
        try:
            logs.redirect_children()
            try:
                services = start_services(
                    stack,
                    repo,
                    workers=workers,
                    device=args.device,
                    gateways=gateways,
                    # every stage serves /metrics: the stream counters
                    metrics_port=free_port(),
                    stage_metrics=True,
                )
            finally:
                logs.restore_stderr()
            url = services.gateway.address
            args.http_url = services.gateway.http_address
            wait_ready(url, [m.name for m, _ in models], 120, log=logs.path)
            pids: dict[str, list[int]] = {}
            for child in stack.children:
                pids.setdefault(stage_of(child.name), []).append(child.proc.pid)
            metrics_ports = [c.metrics_port for c in stack.children if c.metrics_port]
            lag_ports = [
                c.metrics_port
                for c in stack.children
                if c.metrics_port and stage_of(c.name) == "scheduler"
            ]
            settle_s = settings.gateway.stats_publish_s + 0.5 if gateways > 1 else 0.0
            for model, _ in models:
                data = model.write_input_data(work / "input" / f"{model.name}.json")
                for c in args.concurrency:
                    try:
                        with profiled(args.profile, pids, f"{model.name}-c{c}"):
                            point = measure(
                                url, pids, metrics_ports, model, c, args, data, settle_s, lag_ports
                            )
                    except PerfAnalyzerError as exc:
                        print(f"{model.name} c={c}: FAILED {str(exc).splitlines()[0]}", flush=True)
                        continue
                    points.append(point)
                    print(format_points([point]), flush=True)
        finally:
            stack.stop()
            logs.close()
    print()
    print(format_points(points))
    if args.json is not None:
        record = {
            "host": platform.node(),
            "cores": cores,
            "gpus": gpus,
            "gateways": gateways,
            "workers": worker_count,
            "load_average": os.getloadavg(),
            "points": [asdict(p) for p in points],
        }
        args.json.write_text(json.dumps(record, indent=2))
    return 0 if points else 1


if __name__ == "__main__":
    raise SystemExit(main())
