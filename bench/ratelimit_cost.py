"""CPU the rate limiter and Redis spend per request, driven by perf_analyzer.

Starts a stack on the `simple` model (one instance), runs perf_analyzer at
each concurrency and reads the rate limiter's and Redis's process CPU time
(psutil) before and after; requests are counted from the model's statistics.
With --rate-limit execution_count the rate limiter runs Triton's rate
limiter; with --resources the model's instance also declares a rate_limiter
resource, so every execution takes a grant (no grant reuse): the cost of the
feature where it is asked for.

    python -m bench.ratelimit_cost -c 1 64 [--rate-limit execution_count] [--resources]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import tritonclient.grpc as grpcclient

from bench.perf_analyzer import PerfAnalyzerUnstable, run_perf
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import write_simple

RESOURCE_BLOCK = """
instance_group [
  {
    count: 1
    kind: KIND_CPU
    rate_limiter { resources [ { name: "R1" count: 1 } ] priority: 1 }
  }
]
"""


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _executions(url: str, model: str) -> tuple[int, int]:
    client = grpcclient.InferenceServerClient(url)
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    client.close()
    return int(stats["inference_stats"]["success"].get("count", 0)), int(
        stats.get("execution_count", 0)
    )


def _drive(url: str, concurrency: int, measurement_ms: int) -> None:
    """perf_analyzer as the load: the figures are counted here, so a window
    it calls unstable (a busy shared machine) still counts."""
    with contextlib.suppress(PerfAnalyzerUnstable):
        run_perf(url, "simple", concurrency, measurement_ms=measurement_ms, stability_pct=50)


def write_model(root: Path, resources: bool) -> None:
    path = write_simple(root)
    if resources:
        cfg = path / "config.pbtxt"
        text = cfg.read_text()
        start = text.index("instance_group")
        end = text.index("]", start) + 1
        cfg.write_text(text[:start] + RESOURCE_BLOCK.strip() + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--resources", action="store_true")
    ap.add_argument("--rate-limit", default="off", choices=["off", "execution_count"])
    ap.add_argument("--measurement-ms", type=int, default=4000)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        write_model(repo, args.resources)
        stack = Stack()
        try:
            # (no keyword when off: the bench also runs on trees older than the flag)
            extra: dict[str, Any] = (
                {"ratelimiter_args": ["--rate-limit", args.rate_limit]}
                if args.rate_limit != "off"
                else {}
            )
            s = start_services(stack, repo, device="cpu", **extra)
            redis_pid = stack.children[0].proc.pid
            rl_pid = s.ratelimiter.proc.pid
            print(f"rate_limit={args.rate_limit} resources={args.resources}")
            print("conc  infer/s  requests  executions  rl_us/req  redis_us/req")
            for c in args.concurrency:
                _drive(s.gateway.address, c, 1000)  # warm up
                req0, ex0 = _executions(s.gateway.address, "simple")
                rl0, rd0 = _cpu_s(rl_pid), _cpu_s(redis_pid)
                t0 = time.monotonic()
                _drive(s.gateway.address, c, args.measurement_ms)
                elapsed = time.monotonic() - t0
                rl1, rd1 = _cpu_s(rl_pid), _cpu_s(redis_pid)
                req1, ex1 = _executions(s.gateway.address, "simple")
                n = max(1, req1 - req0)
                print(
                    f"{c:>4}  {n / elapsed:>7.0f}  {n:>8}  {ex1 - ex0:>10}"
                    f"  {(rl1 - rl0) / n * 1e6:>9.1f}  {(rd1 - rd0) / n * 1e6:>12.1f}",
                    flush=True,
                )
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
