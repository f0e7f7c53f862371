"""`python -m bench.http`: the HTTP/REST front against gRPC, StageServe and Triton in one run.

For each server in turn (only one running at a time: StageServe, then real
Triton 2.51 with its HTTP endpoint enabled), on the benchmark models of
bench.references (identity FP32 [16] and the mlp, the same ONNX bytes for
both servers), runs ``perf_analyzer -i grpc`` and ``-i http`` at each
concurrency and prints infer/s, p50, p99 and the CPU the server's processes
used per inference. ``--http-servers`` instead compares the embeddable HTTP
servers the gateway can run (uvicorn+httptools, granian's embedded mode) on
StageServe alone, with the gateway process's own CPU per inference: the
measurement that chose the default (services/gateway/http/server.py).

  python -m bench.http                                   # both servers, identity + mlp, c=1 8 64
  python -m bench.http --http-servers --models identity   # uvicorn vs granian
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.perf_analyzer import PerfAnalyzerError, PerfAnalyzerUnstable, run_perf
from bench.references import (
    BenchModel,
    RunningServer,
    StageServeServer,
    TritonServer,
    bench_models,
    tree_cpu_seconds,
)

# GatewaySettings.http_server's variable (stageserve/settings.py): the HTTP front's server.
SERVER_ENV = "STAGESERVE_GATEWAY_HTTP_SERVER"


@dataclass
class Row:
    server: str
    model: str
    protocol: str
    concurrency: int
    throughput: float | None
    p50_us: float | None
    p99_us: float | None
    cpu_us_per_inf: float | None
    note: str = ""


def measure(
    label: str,
    url: str,
    protocol: str,
    model: str,
    concurrency: int,
    pids: Sequence[int],
    measurement_ms: int,
    input_data: Path | None = None,
) -> Row:
    """One perf_analyzer run; ``input_data``: its ``--input-data`` file
    (BenchModel.write_input_data: real numbers, not random bytes)."""
    cpu0, t0 = tree_cpu_seconds(pids), time.monotonic()
    note = ""
    try:
        r = run_perf(
            url,
            model,
            concurrency,
            measurement_ms=measurement_ms,
            stability_pct=25,
            protocol=protocol,
            input_data=input_data,
            extra_args=["--max-trials", "4"],
        )
    except PerfAnalyzerError as exc:
        # Noisy shared machine: one more try over exactly 3 windows whatever
        # their spread (-s 1000), marked.
        first = str(exc).splitlines()[0]
        note = "unstable" if isinstance(exc, PerfAnalyzerUnstable) else f"retried: {first[:60]}"
        try:
            r = run_perf(
                url,
                model,
                concurrency,
                measurement_ms=measurement_ms,
                stability_pct=1000,
                protocol=protocol,
                input_data=input_data,
                extra_args=["--max-trials", "3"],
            )
        except PerfAnalyzerError:
            return Row(label, model, protocol, concurrency, None, None, None, None, note)
    wall = time.monotonic() - t0
    cores = (tree_cpu_seconds(pids) - cpu0) / wall
    cpu = cores / r.throughput * 1e6 if r.throughput else None
    return Row(label, model, protocol, concurrency, r.throughput, r.p50_us, r.p99_us, cpu, note)


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    head = "| server | model | protocol | conc | infer/s | p50 ms | p99 ms | CPU us/inf | note |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        p50 = r.p50_us / 1000 if r.p50_us else None
        p99 = r.p99_us / 1000 if r.p99_us else None
        lines.append(
            f"| {r.server} | {r.model} | {r.protocol} | {r.concurrency} | {_fmt(r.throughput)} "
            f"| {_fmt(p50, 2)} | {_fmt(p99, 2)} | {_fmt(r.cpu_us_per_inf)} | {r.note} |"
        )
    return "\n".join(lines)


def _input_data(models: Sequence[BenchModel], workdir: Path) -> dict[str, Path]:
    """Each model's perf_analyzer --input-data file (the rows bench.compare sends)."""
    return {m.name: m.write_input_data(workdir / "perf-input" / f"{m.name}.json") for m in models}


def run_fronts(args: argparse.Namespace, workdir: Path) -> list[Row]:
    rows: list[Row] = []
    models = bench_models(args.models)
    data = _input_data(models, workdir)
    for name in args.servers:
        print(f"== {name}", flush=True)
        server: RunningServer
        if name == "triton":
            server = TritonServer(workdir / name, models, http=True)
        else:
            server = StageServeServer(workdir / name, models)
        with server:
            for model in args.models:
                for c in args.concurrency:
                    for protocol in ("grpc", "http"):
                        url = server.http_url if protocol == "http" else server.url
                        row = measure(
                            name,
                            url,
                            protocol,
                            model,
                            c,
                            server.pids(),
                            args.measurement_ms,
                            data[model],
                        )
                        print(table([row]).splitlines()[-1], flush=True)
                        rows.append(row)
    return rows


def run_http_servers(args: argparse.Namespace, workdir: Path) -> list[Row]:
    rows: list[Row] = []
    models = bench_models(args.models)
    data = _input_data(models, workdir)
    for kind in args.http_server_kinds:
        os.environ[SERVER_ENV] = kind  # the gateway child inherits it
        try:
            server = StageServeServer(workdir / kind, models)
        finally:
            del os.environ[SERVER_ENV]
        with server:
            gateway = [c.proc.pid for c in server.stack.children if c.name == "gateway"]
            for model in args.models:
                for c in args.concurrency:
                    row = measure(
                        f"stageserve/{kind}",
                        server.http_url,
                        "http",
                        model,
                        c,
                        gateway,
                        args.measurement_ms,
                        data[model],
                    )
                    row.note = (row.note + " gateway CPU only").strip()
                    print(table([row]).splitlines()[-1], flush=True)
                    rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__)
    ap.add_argument("--servers", nargs="+", default=["stageserve", "triton"])
    ap.add_argument("--models", nargs="+", default=["identity", "mlp"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--measurement-ms", type=int, default=3000)
    ap.add_argument("--http-servers", action="store_true", help="compare uvicorn and granian")
    ap.add_argument("--http-server-kinds", nargs="+", default=["uvicorn", "granian"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        rows = (run_http_servers if args.http_servers else run_fronts)(args, Path(tmp))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
