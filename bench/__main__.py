"""`python -m bench`: perf_analyzer over gRPC against a fresh StageServe stack.

Builds the example repository, starts Redis and every service as separate
processes, and for each model and concurrency prints infer/s, p50 and p99
plus the CPU time each stage spent per request (user+system time of each
service process over the measurement, divided by requests served), so the
next optimisation is chosen from data.

  python -m bench                                  # simple + mlp at 1, 16, 64
  python -m bench --models mlp --concurrency 1 64 --measurement-ms 5000
  python -m bench --models accumulator --concurrency 1 8 --perf-arg=--sequence-length=20
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.perf_analyzer import PerfResult, find_perf_analyzer, run_perf
from bench.profile import Recorder, format_profile
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import build_example_repository

STAGES = ("gateway", "scheduler", "ratelimiter", "worker", "redis")


@dataclass
class Point:
    result: PerfResult
    cpu_us_per_request: dict[str, float]
    mean_batch: float  # requests per model execution over the measurement


def _cpu_seconds(stack: Stack) -> dict[str, float]:
    """Total user+system CPU seconds per stage (workers summed)."""
    out = dict.fromkeys(STAGES, 0.0)
    for child in stack.children:
        stage = child.name.split("-", 1)[0]
        try:
            t = psutil.Process(child.proc.pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[stage] = out.get(stage, 0.0) + t.user + t.system
    return out


def _served(url: str, model: str) -> tuple[int, int]:
    """(successful requests, model executions) so far, from ModelStatistics."""
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(url).get_inference_statistics(model)
    return (
        sum(s.inference_stats.success.count for s in stats.model_stats),
        sum(s.execution_count for s in stats.model_stats),
    )


def _profile_targets(stack: Stack) -> list[tuple[str, int]]:
    """(stage, pid) of every Python service (Redis is not a Python process)."""
    return [(c.name, c.proc.pid) for c in stack.children if not c.name.startswith("redis")]


def measure(
    url: str,
    stack: Stack,
    model: str,
    concurrency: int,
    *,
    measurement_ms: int,
    stability_pct: int,
    perf_args: Sequence[str] = (),
    profile: Path | None = None,
    profile_native: bool = False,
    protocol: str = "grpc",
    perf_url: str | None = None,
) -> Point:
    """One perf_analyzer point; with `profile` (a directory), py-spy every stage meanwhile.

    `url` is the gRPC front (statistics are read there); perf_analyzer drives
    `perf_url` (default `url`) over `protocol`."""
    recorder = Recorder(profile, native=profile_native) if profile else None
    if recorder is not None:
        recorder.start(_profile_targets(stack), f"{model}-c{concurrency}")
    cpu_before = _cpu_seconds(stack)
    served_before, executions_before = _served(url, model)
    result = run_perf(
        perf_url or url,
        model,
        concurrency,
        measurement_ms=measurement_ms,
        stability_pct=stability_pct,
        extra_args=["--max-trials", "6", *perf_args],
        protocol=protocol,
    )
    served_after, executions_after = _served(url, model)
    served = max(1, served_after - served_before)
    cpu_after = _cpu_seconds(stack)
    if recorder is not None:
        for stage_profile in recorder.stop():
            print(format_profile(stage_profile), flush=True)
    per_request = {s: (cpu_after[s] - cpu_before[s]) / served * 1e6 for s in STAGES}
    return Point(result, per_request, served / max(1, executions_after - executions_before))


def format_points(points: list[Point]) -> str:
    header = ["model", "conc", "infer/s", "p50 ms", "p99 ms", "batch"] + [f"{s} us" for s in STAGES]
    rows = [header]
    for p in points:
        r = p.result
        rows.append(
            [
                r.model,
                str(r.concurrency),
                f"{r.throughput:.0f}",
                f"{r.p50_us / 1000:.2f}",
                f"{r.p99_us / 1000:.2f}",
                f"{p.mean_batch:.1f}",
            ]
            + [f"{p.cpu_us_per_request[s]:.0f}" for s in STAGES]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["simple", "mlp"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--measurement-ms", type=int, default=4000)
    parser.add_argument("--stability-pct", type=int, default=30)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--csv", type=Path, default=None, help="also write the table as CSV")
    parser.add_argument(
        "--perf-arg",
        action="append",
        default=[],
        help="extra perf_analyzer argument, repeatable (e.g. --perf-arg=--sequence-length=20)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="py-spy every stage during each measurement (raw stacks into DIR) and print "
        "where each spends its CPU (needs: pip install py-spy)",
    )
    parser.add_argument(
        "--profile-native", action="store_true", help="with --profile: C/Cython frames too"
    )
    args = parser.parse_args(argv)

    if args.profile and not Recorder.available():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    if find_perf_analyzer() is None:
        print(
            "perf_analyzer is not installed: run scripts/install_perf_analyzer.sh", file=sys.stderr
        )
        return 2
    stack = Stack()
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        repository = Path(tmp) / "models"
        build_example_repository(repository)
        try:
            services = start_services(stack, repository, workers=args.workers, device=args.device)
            url = services.gateway.address
            for model in args.models:
                for c in args.concurrency:
                    point = measure(
                        url,
                        stack,
                        model,
                        c,
                        measurement_ms=args.measurement_ms,
                        stability_pct=args.stability_pct,
                        perf_args=args.perf_arg,
                        profile=args.profile,
                        profile_native=args.profile_native,
                    )
                    points.append(point)
                    print(format_points([point]).splitlines()[-1], flush=True)
        finally:
            stack.stop()
    print()
    print(format_points(points))
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(
                ["model", "concurrency", "infer_per_s", "p50_us", "p99_us", "mean_batch"]
                + [f"cpu_us_{s}" for s in STAGES]
            )
            for p in points:
                r = p.result
                w.writerow(
                    [r.model, r.concurrency, r.throughput, r.p50_us, r.p99_us, p.mean_batch]
                    + [p.cpu_us_per_request[s] for s in STAGES]
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
