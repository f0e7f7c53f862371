"""`python -m bench.scheduler_cost [--schedulers N]`: what one scheduler costs per inference.

Serves identity FP32 [16] (max_batch_size 64, dynamic batching) on a stack
with N schedulers (default 1), warms it, then runs perf_analyzer over gRPC
at --concurrency (64) and prints the stack's infer/s, p50/p99 and the CPU
each stage process spent per inference (from /proc, over the inferences
the model's statistics counted during the run). 1e6 / the scheduler's
us per inference is how many infer/s of one model a scheduler carries
before its one core is full (docs/architecture.md, "Schedulers sharded by
model").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import tritonclient.grpc as grpcclient

from bench.perf_analyzer import run_perf
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import write_identity

MODEL = "identity"


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_cost")
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measurement-ms", type=int, default=4000, help="per window")
    parser.add_argument("--stability-pct", type=int, default=20)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="scheduler-cost-"))
    write_identity(root, MODEL, "FP32", dims=(16,), max_batch_size=64)
    stack = Stack()
    try:
        s = start_services(stack, root, device="cpu", http_address=None, schedulers=args.schedulers)
        pids = {c.name: c.proc.pid for c in stack.children if c.name != "redis"}
        client = grpcclient.InferenceServerClient(s.gateway.address)

        def count() -> int:
            return client.get_inference_statistics(MODEL).model_stats[0].inference_count

        window = {"measurement_ms": args.measurement_ms, "stability_pct": args.stability_pct}
        run_perf(s.gateway.address, MODEL, args.concurrency, **window)  # warm-up
        for n in range(args.rounds):
            counted = count()
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            began = time.monotonic()
            result = run_perf(s.gateway.address, MODEL, args.concurrency, **window)
            wall = time.monotonic() - began
            inferences = max(1, count() - counted)
            spent = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
            per = ", ".join(f"{k} {v / inferences * 1e6:.0f}" for k, v in spent.items())
            busiest = max((k for k in spent if k.startswith("scheduler")), key=spent.__getitem__)
            print(
                f"round {n}: {result.throughput:.0f} infer/s, p50 {result.p50_us:.0f} us, "
                f"p99 {result.p99_us:.0f} us; CPU us per inference: {per}; "
                f"busiest scheduler {spent[busiest] / wall:.2f} cores",
                flush=True,
            )
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
