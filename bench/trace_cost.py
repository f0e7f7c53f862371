"""What tracing costs: the identity model at one concurrency with tracing
off, on at rate 1000 and on at rate 1 (opentelemetry mode, every stage's
spans exported over OTLP/gRPC to a counting receiver in this process), on
one StageServe stack, perf_analyzer over gRPC.

  python -m bench.trace_cost                       # c=64, 3 interleaved rounds
  python -m bench.trace_cost --concurrency 64 --rounds 5

The three settings are switched with the TraceSetting RPC on the running
stack and measured in interleaved rounds (off, rate 1000, rate 1, off, ...),
so a shared machine's drift falls on every setting alike; the table gives
each setting's median throughput and p50 / p99 latency and the spans the
receiver got. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsg

from bench.perf_analyzer import PerfAnalyzerUnstable, PerfResult, run_perf
from bench.references import bench_model, free_port, wait_ready, write_stageserve_repository

SETTINGS = {
    "off": {"trace_level": ["OFF"]},
    "rate 1000": {"trace_level": ["TIMESTAMPS"], "trace_rate": "1000"},
    "rate 1": {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"},
}


class CountingReceiver(tsg.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context) -> tsp.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return tsp.ExportTraceServiceResponse()

    def drained(self, quiet_s: float = 1.0) -> None:
        """Until no span arrived for `quiet_s` (the stages' export backlog is
        sent: it must not load the next setting's measurement)."""
        seen = -1
        while seen != self.spans:
            seen = self.spans
            time.sleep(quiet_s)


def measure(url: str, model: str, args, shapes, data: Path) -> PerfResult:
    """One perf_analyzer point; on a loaded shared machine the windows may
    differ by more than -s allows: then once more with a loose -s."""
    for pct in (args.stability_pct, 100):
        try:
            return run_perf(
                url,
                model,
                args.concurrency,
                measurement_ms=args.measurement_ms,
                stability_pct=pct,
                shapes=shapes,
                input_data=data,
            )
        except PerfAnalyzerUnstable:
            if pct == 100:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    from stageserve.launcher import Stack, start_services

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measurement-ms", type=int, default=4000)
    ap.add_argument("--stability-pct", type=int, default=30, help="perf_analyzer -s")
    args = ap.parse_args(argv)

    receiver = CountingReceiver()
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tsg.add_TraceServiceServicer_to_server(receiver, collector)
    port = free_port()
    collector.add_insecure_port(f"127.0.0.1:{port}")
    collector.start()
    model = bench_model("identity")
    results: dict[str, list[PerfResult]] = {name: [] for name in SETTINGS}
    spans: dict[str, int] = dict.fromkeys(SETTINGS, 0)
    with tempfile.TemporaryDirectory(prefix="trace-cost-") as tmp:
        repo = write_stageserve_repository(Path(tmp) / "repo", [model])
        data = model.write_input_data(Path(tmp) / "input.json")
        config = [
            "mode=opentelemetry",
            f"opentelemetry,url=127.0.0.1:{port}",
            "opentelemetry,bsp_schedule_delay=200",
            "level=OFF",
        ]
        stack = Stack()
        try:
            services = start_services(
                stack,
                repo,
                load_models=[model.name],
                device="cpu",
                gateway_extra=[f"--trace-config={c}" for c in config],
            )
            url = services.gateway.address
            wait_ready(url, [model.name], 120)
            client = grpcclient.InferenceServerClient(url)
            for _ in range(args.rounds):
                for name, settings in SETTINGS.items():
                    client.update_trace_settings(settings=settings)
                    before = receiver.spans
                    results[name].append(measure(url, model.name, args, model.input_shapes, data))
                    receiver.drained()  # the spans exported late count here, not in the next
                    spans[name] += receiver.spans - before
            client.close()
        finally:
            stack.stop()
            collector.stop(None)
    print(f"identity, c={args.concurrency}, {args.rounds} interleaved rounds (median)")
    print(f"load average at the end: {os.getloadavg()}")
    print("| tracing | infer/s | p50 us | p99 us | spans received |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        tput = statistics.median(r.throughput for r in runs)
        p50 = statistics.median(r.p50_us for r in runs)
        p99 = statistics.median(r.p99_us for r in runs)
        print(f"| {name} | {tput:.0f} | {p50:.0f} | {p99:.0f} | {spans[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
