"""`python -m bench.gpu`: StageServe against ONNX Runtime alone on a CNN.

Issue 5's GPU check: with dynamic batching, StageServe should reach at least
90% of the throughput ONNX Runtime reaches by itself, in one process, at the
same batch size, on the CUDA execution provider. This builds the ResNet-style
CNN of `bench/cnn.py`, then

1. runs it in this process through the worker's own backend
   (`OnnxInstance`, same session options) at `--batch` for `--seconds`,
   feeding numpy arrays as the worker does (host-to-device copies included);
2. starts a StageServe stack (`--device`, one worker; gateways and
   schedulers `auto` as `stageserve up` sizes them, or `--gateways`,
   `--schedulers`) on a repository holding
   the same model with dynamic batching up to `--batch`, and runs
   perf_analyzer over gRPC (`--protocol http`: the HTTP front) at
   `--concurrency` (default 2 x batch, so a full batch waits while one
   executes);

and prints both throughputs, the ratio and the batch size StageServe formed.
On a machine without a GPU it runs on the CPU provider (the device reported
in the output says which); there the server's stages and perf_analyzer share
the cores the model computes on, so the ratio is a lower bound.

With ``--backend torch`` the same CNN (same weights, bench/torch_cnn.py)
runs as TorchScript: alone through the worker's ``TorchInstance``, and
through StageServe as a ``pytorch_libtorch`` model.

  python -m bench.gpu                          # auto device, batch 32, 64x64 images
  python -m bench.gpu --device cuda:0 --batch 64 --image-size 128
  python -m bench.gpu --backend torch          # the TorchScript CNN

``--variant NAME:SETTINGS`` (repeatable) serves more copies of the model
from the one stack, each with its own config.pbtxt, and measures each in
turn against the one alone figure: SETTINGS are ``;``-separated
``preferred=1 2 4 8`` (dynamic_batching preferred_batch_size),
``instances=N`` (the instance_group count) or ``KEY=VALUE`` (a config
``parameters`` entry), e.g.

  python -m bench.gpu --variant 'heuristic:cudnn_conv_algo_search=1' \
      --variant 'pad:preferred=1 2 4 8 16 32'
  python -m bench.gpu --parameter cudnn_conv_algo_search=0 --parameter allow_tf32=true

``--parameter KEY=VALUE`` adds a model parameter (docs/gpu.md) to both runs:
the CNN's config.pbtxt and the session measured alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format

from bench.__main__ import measure
from bench.cnn import write_cnn
from bench.perf_analyzer import PerfAnalyzerUnstable, find_perf_analyzer, text_table
from services.worker.backends import TensorBackend
from services.worker.instances import default_intra_op_threads
from services.worker.onnx_backend import OnnxInstance
from services.worker.onnx_options import ort_options
from services.worker.service import detect_gpu
from stageserve.generated import model_config_pb2 as mc
from stageserve.launcher import Stack, start_services
from stageserve.scale_out import AUTO, gateway_count, parse_gateways
from stageserve.scheduler_count import parse_schedulers, scheduler_count
from stageserve.settings import settings_from_env

TARGET_RATIO = 0.9


@dataclass(frozen=True)
class AloneResult:
    device: str
    providers: list[str]
    images_per_s: float


def backend_alone(
    model_file: Path,
    device: str,
    batch: int,
    image_size: int,
    seconds: float,
    parameters: dict[str, str] | None = None,
) -> AloneResult:
    """Images/s of back-to-back runs at one batch size, warmed up first, through
    the worker's own backend for the file (ONNX Runtime or TorchScript), with
    the model `parameters` the server's instance gets."""
    io: dict[str, Any] = {"input_types": {"INPUT": "FP32"}, "output_types": {"OUTPUT": "FP32"}}
    threads = default_intra_op_threads(1)
    parameters = parameters or {}
    backend: TensorBackend
    if model_file.suffix == ".pt":
        from services.worker.torch_backend import TorchInstance

        backend = TorchInstance(
            model_file, device=device, intra_op_threads=threads, parameters=parameters, **io
        )
        providers = [f"torch {backend.device}"]
    else:
        options = ort_options(parameters, gpu=device != "cpu", device_id=_device_id(device))
        backend = OnnxInstance(
            model_file, device=device, intra_op_threads=threads, options=options, **io
        )
        providers = backend.providers
    rng = np.random.default_rng(0)
    feeds = {"INPUT": rng.random((batch, 3, image_size, image_size), dtype=np.float32)}
    for _ in range(3):
        backend.run(feeds, ["OUTPUT"])
    runs = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        backend.run(feeds, ["OUTPUT"])
        runs += 1
    return AloneResult(backend.device, providers, runs * batch / elapsed)


@dataclass(frozen=True)
class Variant:
    """One more copy of the model in the repository, with its own settings."""

    name: str
    preferred: tuple[int, ...] = ()
    instances: int = 0  # 0: as the base config
    parameters: tuple[tuple[str, str], ...] = ()


def parse_variant(text: str) -> Variant:
    """``NAME:preferred=1 2 4;instances=2;KEY=VALUE`` -> Variant."""
    name, _, settings = text.partition(":")
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"variant name {name!r} is not an identifier")
    preferred: tuple[int, ...] = ()
    instances = 0
    parameters: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in settings.split(";"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"variant setting {item!r} is not KEY=VALUE")
        if key == "preferred":
            preferred = tuple(int(v) for v in value.split())
        elif key == "instances":
            instances = int(value)
        else:
            parameters.append((key, value))
    return Variant(name, preferred, instances, tuple(parameters))


def write_variant(model_dir: Path, variant: Variant) -> str:
    """Copy `model_dir` (version 1 by link) as ``<model>_<variant>`` with the
    variant's settings applied to its config.pbtxt; returns the model name."""
    config = read_config(model_dir)
    config.name = f"{config.name}_{variant.name}"
    if variant.preferred:
        del config.dynamic_batching.preferred_batch_size[:]
        config.dynamic_batching.preferred_batch_size.extend(variant.preferred)
    if variant.instances:
        for group in config.instance_group:
            group.count = variant.instances
    set_parameters(config, variant.parameters)
    target = model_dir.parent / config.name
    target.mkdir()
    (target / "1").symlink_to(model_dir / "1", target_is_directory=True)
    (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    return config.name


def _device_id(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def read_config(model_dir: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), config)
    return config


def set_parameters(config: mc.ModelConfig, parameters: Iterable[tuple[str, str]]) -> None:
    """Model `parameters` entries (string values), over any of the same key."""
    for key, value in parameters:
        config.parameters[key].string_value = value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    ap.add_argument("--backend", choices=["onnx", "torch"], default="onnx")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--width", type=int, default=32, help="channels of the first stage")
    ap.add_argument("--seconds", type=float, default=10.0, help="ORT-alone run length")
    ap.add_argument("--concurrency", type=int, default=0, help="default: 2 x batch")
    ap.add_argument("--measurement-ms", type=int, default=5000)
    ap.add_argument("--stability-pct", type=int, default=30)
    ap.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help="NAME:SETTINGS, one more copy of the model measured from the same stack",
    )
    ap.add_argument("--profile", type=Path, help="py-spy every stage meanwhile, into this folder")
    # auto, as `stageserve up`: the stack a user gets on this host by default
    ap.add_argument(
        "--gateways", type=parse_gateways, default=AUTO, help="gateway processes (one port)"
    )
    ap.add_argument("--schedulers", type=parse_schedulers, default=AUTO, help="scheduler processes")
    ap.add_argument("--workers", type=int, default=1, help="worker processes, all on --device")
    ap.add_argument(
        "--protocol",
        choices=["grpc", "http"],
        default="grpc",
        help="perf_analyzer's front (statistics are read over gRPC either way)",
    )
    ap.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model parameter for both runs (e.g. cudnn_conv_algo_search=0, allow_tf32=true)",
    )
    args = ap.parse_args(argv)
    args.gateways = gateway_count(args.gateways, settings_from_env().stack)
    args.schedulers = scheduler_count(args.schedulers)
    parameters = dict(p.split("=", 1) for p in args.parameter)
    concurrency = args.concurrency or 2 * args.batch
    if find_perf_analyzer() is None:
        print(
            "perf_analyzer is not installed: run scripts/install_perf_analyzer.sh", file=sys.stderr
        )
        return 2

    with tempfile.TemporaryDirectory(prefix="stageserve-gpu-") as tmp:
        repository = Path(tmp) / "models"
        size = {"image_size": args.image_size, "width": args.width, "max_batch_size": args.batch}
        if args.backend == "torch":
            import services.worker.torch_backend  # noqa: F401 (its OpenMP settings, before torch)
            from bench.torch_cnn import write_torch_cnn

            model_file = write_torch_cnn(repository, **size) / "1" / "model.pt"
        else:
            model_file = write_cnn(repository, **size) / "1" / "model.onnx"
        model_dir = model_file.parent.parent
        config = read_config(model_dir)
        set_parameters(config, parameters.items())
        (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
        gpu = detect_gpu(args.device)  # what the worker will pick
        device = "cpu" if gpu is None else f"cuda:{gpu}"
        alone = backend_alone(
            model_file, device, args.batch, args.image_size, args.seconds, parameters
        )
        label = "TorchScript" if args.backend == "torch" else "ONNX Runtime"
        if parameters:
            print(f"model parameters: {parameters}", flush=True)
        print(
            f"{label} alone on {alone.device} ({', '.join(alone.providers)}): "
            f"{alone.images_per_s:,.0f} images/s at batch {args.batch}",
            flush=True,
        )
        names = ["cnn", *(write_variant(model_file.parent.parent, v) for v in args.variant)]
        stack = Stack()
        points = []
        try:
            running = start_services(
                stack,
                repository,
                device=device,
                gateways=args.gateways,
                schedulers=args.schedulers,
                workers=args.workers,
            )
            for name in names:
                for attempt in (1, 2):  # a first try may still meet unwarmed shapes
                    try:
                        point = measure(
                            running.gateway.address,
                            stack,
                            name,
                            concurrency,
                            measurement_ms=args.measurement_ms,
                            stability_pct=args.stability_pct,
                            profile=args.profile,
                            protocol=args.protocol,
                            perf_url=(
                                running.gateway.http_address if args.protocol == "http" else None
                            ),
                        )
                    except PerfAnalyzerUnstable:
                        print(f"{name}: no stable measurement (try {attempt})", flush=True)
                        continue
                    points.append((name, point))
                    break
        finally:
            stack.stop()

    rows = [[f"{label} alone", alone.device, str(args.batch), "-", f"{alone.images_per_s:,.0f}"]]
    rows[0] += ["-", "-", "1.00", "-"]
    for name, point in points:
        r = point.result
        rows.append(
            [
                f"StageServe {name}",
                alone.device,
                f"{point.mean_batch:.1f}",
                str(concurrency),
                f"{r.throughput:,.0f}",
                f"{r.p50_us / 1000:.2f}",
                f"{r.p99_us / 1000:.2f}",
                f"{r.throughput / alone.images_per_s:.2f}",
                " ".join(f"{k[:3]} {v:.0f}" for k, v in point.cpu_us_per_request.items()),
            ]
        )
    print()
    header = ["server", "device", "batch", "conc", "infer/s", "p50 ms", "p99 ms", "ratio"]
    print(text_table([*header, "CPU us/request"], rows))
    print(
        f"(gateways {args.gateways}, schedulers {args.schedulers}, workers {args.workers}, "
        f"perf_analyzer over {args.protocol})"
    )
    if not points or points[0][0] != "cnn":
        print("\nno stable measurement of the base model", file=sys.stderr)
        return 1
    point = points[0][1]
    r = point.result
    ratio = r.throughput / alone.images_per_s
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(
        f"\nStageServe reaches {ratio:.0%} of {label} alone ({verdict} the "
        f"{TARGET_RATIO:.0%} target); CPU us per request by stage: "
        + ", ".join(f"{k} {v:.0f}" for k, v in point.cpu_us_per_request.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
