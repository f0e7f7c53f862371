"""`python -m bench.batch_shapes`: batch padding and shape warm-up on the CNN.

For the CNN of bench.gpu (ONNX Runtime or TorchScript, `--device`), one
StageServe stack per variant of its config.pbtxt:

* ``plain``: as bench.gpu serves it (no preferred sizes; on a GPU every size
  1..max batch is warmed up before READY, docs/gpu.md);
* ``pad``: ``preferred_batch_size`` 1, 2, 4, ... max batch and
  ``pad_batch "true"``: formed batches run at those sizes only, and only
  they are warmed up;
* ``cold``: no padding and ``shape_warmup "false"``: what a load costs
  without the shape warm-up (each new batch size then pays on first use).

For each: the stack's start-up seconds (the model load included), the
worker's "shape warm-up done" figures (shapes, seconds), and one
perf_analyzer point (infer/s, p50, p99, the mean formed batch, CPU us per
request by stage).

  python -m bench.batch_shapes --device cuda:0              # ONNX Runtime
  python -m bench.batch_shapes --device cuda:0 --backend torch
  python -m bench.batch_shapes --device cpu --batch 4 --image-size 16 --measurement-ms 1000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.__main__ import Point, measure
from bench.cnn import write_cnn
from bench.perf_analyzer import find_perf_analyzer, text_table
from stageserve.launcher import Stack, start_services
from stageserve.pad_policy import powers_of_two

VARIANTS = ("plain", "pad", "cold")
WARMED = "shape warm-up done"


@dataclass(frozen=True)
class VariantResult:
    variant: str
    startup_s: float
    warmup: dict  # the worker's "shape warm-up done" fields ({} when none)
    point: Point


def variant_config(text: str, variant: str, max_batch_size: int) -> str:
    """The CNN's config.pbtxt for one variant."""
    if variant == "pad":
        sizes = ", ".join(str(s) for s in powers_of_two(max_batch_size))
        text = re.sub(
            r"dynamic_batching \{", f"dynamic_batching {{ preferred_batch_size: [ {sizes} ]", text
        )
        return text + 'parameters { key: "pad_batch" value { string_value: "true" } }\n'
    if variant == "cold":
        return text + 'parameters { key: "shape_warmup" value { string_value: "false" } }\n'
    return text


def warmup_entry(log_file: Path) -> dict:
    """The fields of the worker's shape warm-up line ({} when it wrote none)."""
    if not log_file.exists():
        return {}
    for line in log_file.read_text().splitlines():
        if WARMED in line:
            return json.loads(line if line.startswith("{") else line[line.index("{") :])
    return {}


def run_variant(args: argparse.Namespace, variant: str, tmp: Path) -> VariantResult:
    repository, log_file = tmp / variant / "models", tmp / variant / "stack.log"
    size = {"image_size": args.image_size, "width": args.width, "max_batch_size": args.batch}
    if args.backend == "torch":
        import services.worker.torch_backend  # noqa: F401 (its OpenMP settings, before torch)
        from bench.torch_cnn import write_torch_cnn

        model_dir = write_torch_cnn(repository, **size)
    else:
        model_dir = write_cnn(repository, **size)
    config = model_dir / "config.pbtxt"
    config.write_text(variant_config(config.read_text(), variant, args.batch))
    stack = Stack(log_argv=["--log-file", str(log_file)])
    try:
        t0 = time.monotonic()
        running = start_services(stack, repository, device=args.device)
        startup_s = time.monotonic() - t0
        point = measure(
            running.gateway.address,
            stack,
            "cnn",
            args.concurrency or 2 * args.batch,
            measurement_ms=args.measurement_ms,
            stability_pct=args.stability_pct,
        )
    finally:
        stack.stop()
    return VariantResult(variant, startup_s, warmup_entry(log_file), point)


def report(results: list[VariantResult], backend: str, device: str) -> str:
    rows = [["variant", "startup s", "warm-up s", "shapes", "infer/s", "p50 ms", "p99 ms", "batch"]]
    for r in results:
        p = r.point.result
        shapes = r.warmup.get("shapes", [])
        rows.append(
            [
                r.variant,
                f"{r.startup_s:.1f}",
                f"{r.warmup['seconds']:.2f}" if r.warmup else "-",
                f"{len(shapes)} ({shapes[0]}..{shapes[-1]})" if shapes else "-",
                f"{p.throughput:,.0f}",
                f"{p.p50_us / 1000:.2f}",
                f"{p.p99_us / 1000:.2f}",
                f"{r.point.mean_batch:.1f}",
            ]
        )
    cpu = "\n".join(
        f"{r.variant}: CPU us per request "
        + ", ".join(f"{k} {v:.0f}" for k, v in r.point.cpu_us_per_request.items())
        for r in results
    )
    return f"CNN ({backend}) on {device}\n" + text_table(rows[0], rows[1:]) + "\n" + cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_shapes", description=__doc__)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda:N (the worker's)")
    ap.add_argument("--backend", choices=["onnx", "torch"], default="onnx")
    ap.add_argument("--batch", type=int, default=32, help="max_batch_size")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=0, help="default: 2 x batch")
    ap.add_argument("--measurement-ms", type=int, default=5000)
    ap.add_argument("--stability-pct", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {unknown}")
    if find_perf_analyzer() is None:
        print(
            "perf_analyzer is not installed: run scripts/install_perf_analyzer.sh", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="stageserve-shapes-") as tmp:
        results = [run_variant(args, v, Path(tmp)) for v in variants]
    print(report(results, args.backend, args.device), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
