"""`python -m bench.compare`: StageServe side by side with real Triton and MLServer.

Builds the benchmark models (``identity`` FP32 [16], the ``mlp``
256-1024-1024-10 and ``cnn``, the compute-bound ResNet-style CNN of
bench/cnn.py on [3, 32, 32] images; same ONNX bytes for every server), then
for each server in turn -- only one running at a time -- starts it on free
ports, checks that it answers the same numbers as numpy for a fixed input
(through ``tritonclient.grpc``), runs ``perf_analyzer`` over gRPC at each
concurrency and stops it. Prints infer/s, p50, p99 and the server's CPU use per server,
and the ratios StageServe/Triton and StageServe/MLServer; writes CSV, a
markdown copy of the tables and (with matplotlib) a throughput-vs-p99 plot.
Where a model has a target (:data:`TARGETS`: ``cnn`` at c=8 and c=32,
StageServe >= 0.95x Triton's throughput with p99 <= 1.2x Triton's), it also
prints whether the measured ratios meet it.

  scripts/install_perf_analyzer.sh && scripts/install_references.sh   # once
  python -m bench.compare                                # all servers, all 3 models, c=1 8 32 64
  python -m bench.compare --servers triton stageserve --models cnn --concurrency 8 32
  python -m bench.compare --servers triton stageserve --models mlp --concurrency 8 64
  python -m bench.compare --servers mlserver mlserver-proxy --models identity   # proxy cost
  python -m bench.compare --servers triton stageserve-python --models numpy   # issue 10

Model ``numpy`` (not in the default set): an MLP 1024-2048-2048-16 that the
Python-backend servers run as a ``model.py`` doing the forward pass in numpy
(bench/numpy_model.py, ~1 ms per batch of 1); ONNX servers get its ONNX twin.

Servers: ``triton`` (tritonserver 2.51, Python backend running ONNX Runtime),
``mlserver`` (MLServer 1.7, custom ONNX Runtime runtime, adaptive batching,
ModelConfig added in-process), ``mlserver-proxy`` (the same MLServer behind a
byte-forwarding gRPC proxy that answers ModelConfig; not in the default set)
``stageserve`` and ``stageserve-python`` (StageServe serving the very
repository Triton gets: Triton's ``model.py`` running ONNX Runtime, in the
worker's Python backend; not in the default set). See docs/benchmarks.md.

``cores`` is the average number of CPU cores the server's processes (all of
them: Triton's stubs, MLServer's workers, every StageServe service and
Redis) used while perf_analyzer ran; ``cpu us/inf`` = cores / throughput;
``spread`` = (max - min) / mean throughput of the 3 windows perf_analyzer
averaged; ``batch`` = inferences per model execution from ModelStatistics
(MLServer has no statistics RPC).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.perf_analyzer import (
    PerfAnalyzerError,
    PerfAnalyzerNotInstalled,
    PerfAnalyzerUnstable,
    find_perf_analyzer,
    run_perf,
)
from bench.references import (
    DEFAULT_MODELS,
    MODELS,
    ReferenceNotInstalled,
    ServerStartError,
    bench_models,
    check_consistency,
    find_mlserver_python,
    find_triton,
    start_server,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
ALL_SERVERS = (
    "triton",
    "mlserver",
    "mlserver-proxy",
    "stageserve",
    "stageserve-python",
    "stageserve-python-process",
)
DEFAULT_SERVERS = ("triton", "mlserver", "stageserve")
REFERENCES = ("triton", "mlserver")  # the ratios' denominators
OURS = "stageserve"
LABELS = {
    "triton": "Triton",
    "mlserver": "MLServer",
    "mlserver-proxy": "MLServer+proxy",
    "stageserve": "StageServe",
    "stageserve-python": "StageServe+model.py",
    "stageserve-python-process": "StageServe+model.py (stubs)",
}


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Measurement:
    """One perf_analyzer run."""

    server: str
    model: str
    concurrency: int
    throughput: float  # infer/s
    p50_us: float
    p99_us: float
    server_cores: float | None = None  # average cores the server used during the run
    window_spread: float | None = None  # (max-min)/mean infer/s of the 3 windows averaged
    avg_batch: float | None = None  # inferences per model execution (ModelStatistics)
    stability_pct: int = 0
    stable: bool = True  # False: only stable after relaxing stability_pct
    repeat: int = 0


@dataclass(frozen=True)
class Point:
    """The median of the repeats of one (server, model, concurrency)."""

    server: str
    model: str
    concurrency: int
    throughput: float
    p50_us: float
    p99_us: float
    server_cores: float | None = None
    repeats: int = 1
    throughput_min: float | None = None
    throughput_max: float | None = None
    window_spread: float | None = None  # worst over the repeats
    avg_batch: float | None = None
    stable: bool = True

    @property
    def cpu_us_per_infer(self) -> float | None:
        if self.server_cores is None or self.throughput <= 0:
            return None
        return self.server_cores * 1e6 / self.throughput

    @property
    def per_core(self) -> float | None:
        """Inferences per second per core the server used."""
        if not self.server_cores:
            return None
        return self.throughput / self.server_cores


def summarize(measurements: Iterable[Measurement]) -> list[Point]:
    """Group by (server, model, concurrency), median over repeats, first-seen order."""
    groups: dict[tuple[str, str, int], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.server, m.model, m.concurrency), []).append(m)
    points = []
    for (server, model, conc), ms in groups.items():
        cores = [m.server_cores for m in ms if m.server_cores is not None]
        thr = [m.throughput for m in ms]
        spreads = [m.window_spread for m in ms if m.window_spread is not None]
        batches = [m.avg_batch for m in ms if m.avg_batch is not None]
        points.append(
            Point(
                server=server,
                model=model,
                concurrency=conc,
                throughput=statistics.median(thr),
                p50_us=statistics.median(m.p50_us for m in ms),
                p99_us=statistics.median(m.p99_us for m in ms),
                server_cores=statistics.median(cores) if cores else None,
                repeats=len(ms),
                throughput_min=min(thr),
                throughput_max=max(thr),
                window_spread=max(spreads) if spreads else None,
                avg_batch=statistics.median(batches) if batches else None,
                stable=all(m.stable for m in ms),
            )
        )
    return points


@dataclass(frozen=True)
class Ratio:
    """StageServe over a reference at one (model, concurrency); None when either is missing."""

    model: str
    concurrency: int
    reference: str
    throughput: float | None  # > 1: StageServe serves more
    p50: float | None  # < 1: StageServe answers faster
    p99: float | None
    per_core: float | None  # > 1: StageServe serves more per core it uses


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(
    points: Sequence[Point], ours: str = OURS, references: Sequence[str] = REFERENCES
) -> list[Ratio]:
    index = {(p.server, p.model, p.concurrency): p for p in points}
    present = {p.server for p in points}
    if ours not in present:
        return []
    references = [r for r in references if r in present]
    keys = []
    for p in points:
        if (p.model, p.concurrency) not in keys:
            keys.append((p.model, p.concurrency))
    out = []
    for model, conc in keys:
        mine = index.get((ours, model, conc))
        for ref in references:
            theirs = index.get((ref, model, conc))
            if mine is None or theirs is None:
                out.append(Ratio(model, conc, ref, None, None, None, None))
                continue
            out.append(
                Ratio(
                    model,
                    conc,
                    ref,
                    _div(mine.throughput, theirs.throughput),
                    _div(mine.p50_us, theirs.p50_us),
                    _div(mine.p99_us, theirs.p99_us),
                    _div(mine.per_core, theirs.per_core),
                )
            )
    return out


@dataclass(frozen=True)
class Target:
    """A goal for StageServe / ``reference`` on one model at some concurrencies."""

    model: str
    concurrency: tuple[int, ...]
    reference: str
    min_throughput: float  # StageServe infer/s at least this times the reference's
    max_p99: float  # StageServe p99 at most this times the reference's
    source: str


#: Issue 15 (target 4): on the compute-bound CNN, at c=8 and c=32, StageServe
#: serves at least 0.95x Triton's inferences per second at a p99 of at most
#: 1.2x Triton's.
TARGETS = (Target("cnn", (8, 32), "triton", 0.95, 1.2, "issue 15"),)


@dataclass(frozen=True)
class TargetCheck:
    target: Target
    concurrency: int
    throughput: float | None  # the measured ratios (None: a side has no figure)
    p99: float | None

    @property
    def throughput_met(self) -> bool | None:
        return None if self.throughput is None else self.throughput >= self.target.min_throughput

    @property
    def p99_met(self) -> bool | None:
        return None if self.p99 is None else self.p99 <= self.target.max_p99

    @property
    def met(self) -> bool | None:
        """True: both ratios meet the target; False: one misses; None: no figure."""
        parts = (self.throughput_met, self.p99_met)
        if False in parts:
            return False
        return None if None in parts else True


def target_checks(rs: Sequence[Ratio], targets: Sequence[Target] = TARGETS) -> list[TargetCheck]:
    """One check per target concurrency that was run against the target's reference."""
    index = {(r.model, r.concurrency, r.reference): r for r in rs}
    out = []
    for t in targets:
        for conc in t.concurrency:
            r = index.get((t.model, conc, t.reference))
            if r is not None:
                out.append(TargetCheck(t, conc, r.throughput, r.p99))
    return out


# --------------------------------------------------------------------------- formatting


def proxy_overhead(points: Sequence[Point]) -> list[Ratio]:
    """MLServer behind the ModelConfig proxy over MLServer alone (when both were run)."""
    return ratios(points, ours="mlserver-proxy", references=("mlserver",))


def python_ratios(points: Sequence[Point], ours: str = "stageserve-python") -> list[Ratio]:
    """StageServe serving Triton's own model.py files over Triton serving them
    (ours: "stageserve-python-process" for a stub process per instance)."""
    return ratios(points, ours=ours, references=("triton",))


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _grid(
    header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool, left: int = 3
) -> str:
    """A text (or markdown) table; the first ``left`` columns align left, the rest right."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |"]
        lines.append(
            "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"
        )
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def format_points(points: Sequence[Point], markdown: bool = False) -> str:
    """One row per (model, concurrency, server): infer/s, p50/p99 ms, CPU use."""
    header = [
        "model", "conc", "server", "infer/s", "spread", "p50 ms", "p99 ms", "cores",
        "cpu us/inf", "batch",
    ]  # fmt: skip
    order = {s: i for i, s in enumerate(ALL_SERVERS)}
    rows = []
    for p in sorted(
        points, key=lambda p: (MODELS.index(p.model) if p.model in MODELS else 99,
                               p.concurrency, order.get(p.server, 99))
    ):  # fmt: skip
        thr = _num(p.throughput, 0)
        if p.repeats > 1:
            thr += f" ({_num(p.throughput_min)}-{_num(p.throughput_max)})"
        if not p.stable:
            thr += " *"
        rows.append(
            [
                p.model,
                str(p.concurrency),
                LABELS.get(p.server, p.server),
                thr,
                "-" if p.window_spread is None else f"{p.window_spread:.0%}",
                _num(p.p50_us / 1000, 2),
                _num(p.p99_us / 1000, 2),
                _num(p.server_cores, 2),
                _num(p.cpu_us_per_infer, 0),
                _num(p.avg_batch, 1),
            ]
        )
    return _grid(header, rows, markdown)


def format_ratios(rs: Sequence[Ratio], markdown: bool = False, ours_label: str = "SS") -> str:
    """Ours / reference: throughput (>1 better), p50 and p99 (<1 better), per core."""
    refs: list[str] = []
    for r in rs:
        if r.reference not in refs:
            refs.append(r.reference)
    header = ["model", "conc"]
    for ref in refs:
        lab = f"{ours_label}/{LABELS.get(ref, ref)}"
        header += [f"{lab} infer/s", f"{lab} p50", f"{lab} p99", f"{lab} per-core"]
    by_key: dict[tuple[str, int], dict[str, Ratio]] = {}
    for r in rs:
        by_key.setdefault((r.model, r.concurrency), {})[r.reference] = r
    rows = []
    for (model, conc), per_ref in by_key.items():
        row = [model, str(conc)]
        for ref in refs:
            ratio = per_ref.get(ref)
            row += [
                _ratio(ratio.throughput if ratio else None),
                _ratio(ratio.p50 if ratio else None),
                _ratio(ratio.p99 if ratio else None),
                _ratio(ratio.per_core if ratio else None),
            ]
        rows.append(row)
    return _grid(header, rows, markdown, left=2)


def format_targets(checks: Sequence[TargetCheck], markdown: bool = False) -> str:
    """The target ratios (SS/reference infer/s and p99) next to their goals, met or not."""
    header = ["model", "conc", "target", "SS/ref infer/s", "goal", "SS/ref p99", "goal", "met"]
    rows = []
    for c in checks:
        t = c.target
        verdict = {True: "yes", False: "NO", None: "-"}[c.met]
        rows.append(
            [
                t.model,
                str(c.concurrency),
                f"{t.source}, vs {LABELS.get(t.reference, t.reference)}",
                _ratio(c.throughput),
                f">= {t.min_throughput:.2f}x",
                _ratio(c.p99),
                f"<= {t.max_p99:.2f}x",
                verdict,
            ]
        )
    return _grid(header, rows, markdown)


def target_record(c: TargetCheck) -> dict:
    """A check as meta.json records it."""
    t = c.target
    return {
        "model": t.model,
        "concurrency": c.concurrency,
        "reference": t.reference,
        "source": t.source,
        "throughput_ratio": c.throughput,
        "min_throughput_ratio": t.min_throughput,
        "p99_ratio": c.p99,
        "max_p99_ratio": t.max_p99,
        "met": c.met,
    }


CSV_FIELDS = (
    "server", "model", "concurrency", "repeats", "infer_per_s", "infer_per_s_min",
    "infer_per_s_max", "p50_us", "p99_us", "server_cores", "cpu_us_per_infer",
    "infer_per_s_per_core", "window_spread", "avg_batch", "stable",
)  # fmt: skip


def points_csv(points: Sequence[Point]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)

    def cell(v: float | None) -> str:
        return "" if v is None else f"{v:.6g}"

    for p in points:
        w.writerow(
            [
                p.server, p.model, p.concurrency, p.repeats, cell(p.throughput),
                cell(p.throughput_min), cell(p.throughput_max), cell(p.p50_us),
                cell(p.p99_us), cell(p.server_cores), cell(p.cpu_us_per_infer),
                cell(p.per_core), cell(p.window_spread), cell(p.avg_batch), int(p.stable),
            ]
        )  # fmt: skip
    return buf.getvalue()


def ratios_csv(rs: Sequence[Ratio]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["model", "concurrency", "reference", "throughput", "p50", "p99", "per_core"])
    for r in rs:
        w.writerow(
            [r.model, r.concurrency, r.reference]
            + ["" if v is None else f"{v:.4f}" for v in (r.throughput, r.p50, r.p99, r.per_core)]
        )
    return buf.getvalue()


def measurements_csv(ms: Sequence[Measurement]) -> str:
    buf = io.StringIO()
    names = [f.name for f in Measurement.__dataclass_fields__.values()]
    w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    w.writeheader()
    for m in ms:
        w.writerow(asdict(m))
    return buf.getvalue()


def write_results(
    out: Path,
    measurements: Sequence[Measurement],
    meta: dict,
    *,
    plot: bool = True,
) -> dict[str, Path]:
    """compare.csv, ratios.csv, raw.csv, compare.md, meta.json and compare.png in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = summarize(measurements)
    rs = ratios(points)
    proxy = proxy_overhead(points)
    python = python_ratios(points)
    stubs = python_ratios(points, ours="stageserve-python-process")
    checks = target_checks(rs)
    files = {
        "points": out / "compare.csv",
        "ratios": out / "ratios.csv",
        "raw": out / "raw.csv",
        "markdown": out / "compare.md",
        "meta": out / "meta.json",
    }
    files["points"].write_text(points_csv(points))
    files["ratios"].write_text(ratios_csv(rs))
    files["raw"].write_text(measurements_csv(measurements))
    files["markdown"].write_text(
        "\n\n".join(
            [format_points(points, markdown=True)]
            + ([format_ratios(rs, markdown=True)] if rs else [])
            + ([format_targets(checks, markdown=True)] if checks else [])
            + ([format_ratios(proxy, markdown=True, ours_label="proxy")] if proxy else [])
            + ([format_ratios(python, markdown=True, ours_label="SS-py")] if python else [])
            + ([format_ratios(stubs, markdown=True, ours_label="SS-stub")] if stubs else [])
        )
        + "\n"
    )
    if checks:
        meta = {**meta, "targets": [target_record(c) for c in checks]}
    files["meta"].write_text(json.dumps(meta, indent=2, default=str) + "\n")
    if plot:
        png = plot_points(points, out / "compare.png")
        if png is not None:
            files["plot"] = png
    return files


def plot_points(points: Sequence[Point], path: Path) -> Path | None:
    """Throughput (x) vs p99 latency (y): one panel per model, one line per server."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "plot skipped: matplotlib is not installed "
            "(pip install 'matplotlib>=3.8'; CSV and markdown were written)",
            file=sys.stderr,
        )
        return None
    models = [m for m in MODELS if any(p.model == m for p in points)]
    models += sorted({p.model for p in points} - set(models))
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for server in ALL_SERVERS:
            pts = sorted(
                (p for p in points if p.model == model and p.server == server),
                key=lambda p: p.concurrency,
            )
            if not pts:
                continue
            xs = [p.throughput for p in pts]
            ys = [p.p99_us / 1000 for p in pts]
            ax.plot(xs, ys, marker="o", label=LABELS.get(server, server))
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"c{p.concurrency}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)  # fmt: skip
        ax.set_title(f"{model}")
        ax.set_xlabel("throughput (infer/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("perf_analyzer over gRPC: throughput vs p99 (labels: concurrency)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- running


def _server_options(server: str, args: argparse.Namespace) -> tuple[str, dict]:
    if server == "triton":
        return "triton", {"instances": args.instances}
    if server in ("mlserver", "mlserver-proxy"):
        return "mlserver", {
            "instances": args.instances,
            "parallel_workers": args.mlserver_workers,
            "max_batch_time_s": args.mlserver_batch_time_ms / 1000,
            "config_rpc": "proxy" if server == "mlserver-proxy" else "inject",
        }
    if server in ("stageserve", "stageserve-python", "stageserve-python-process"):
        options = {"instances": args.instances, "workers": args.stageserve_workers}
        if server != "stageserve":
            options["python"] = True  # the model.py files Triton serves, unchanged
        if server == "stageserve-python-process":
            options["python_process"] = True  # each instance in its stub process
        return "stageserve", options
    raise ValueError(server)


def _check_installed(server: str) -> str | None:
    try:
        if server == "triton":
            find_triton()
        elif server.startswith("mlserver"):
            find_mlserver_python()
    except ReferenceNotInstalled as exc:
        return str(exc)
    return None


_PASS_RE = re.compile(r"Pass \[(\d+)\] throughput: ([0-9.]+) infer/sec")


def window_spread(stdout: str, windows: int = 3) -> float | None:
    """(max - min) / mean throughput of the last ``windows`` measurement windows.

    Parsed from perf_analyzer's ``-v`` lines ``Pass [N] throughput: X infer/sec``;
    perf_analyzer reports the merge of the last 3 windows, so this is the
    spread of what was averaged. None when there are too few lines.
    """
    values = [float(m.group(2)) for m in _PASS_RE.finditer(stdout)][-windows:]
    if len(values) < windows or sum(values) <= 0:
        return None
    return (max(values) - min(values)) / (sum(values) / len(values))


def measure_point(
    label: str,
    server,
    model: str,
    concurrency: int,
    args,
    repeat: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
    input_data: Path | None = None,
) -> Measurement:
    """One perf_analyzer run (``shapes``: its ``--shape`` per input;
    ``input_data``: its ``--input-data``, BenchModel.write_input_data).

    When perf_analyzer finds no stable window triple within --max-trials, the
    point is measured once more over exactly 3 windows with the criterion
    relaxed to --unstable-retry-pct, and marked unstable; its window spread
    tells how noisy it was.
    """
    trials = args.max_trials
    pct = args.stability_pct
    stable = True
    for attempt in range(2):
        extra = ["--max-trials", str(trials), "-v"]
        counts0 = execution_counts(server.url, model)
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        try:
            r = run_perf(
                server.url,
                model,
                concurrency,
                measurement_ms=args.measurement_ms,
                stability_pct=pct,
                extra_args=extra,
                shapes=shapes,
                input_data=input_data,
            )
        except PerfAnalyzerUnstable:
            if attempt == 1 or args.unstable_retry_pct <= pct:
                raise
            print(
                f"    {model} c={concurrency}: unstable at {pct}%, "
                f"retrying at {args.unstable_retry_pct}%",
                flush=True,
            )
            pct, trials, stable = args.unstable_retry_pct, 3, False
            continue
        wall = time.monotonic() - t0
        cores = (server.cpu_seconds() - cpu0) / wall if wall > 0 else None
        counts1 = execution_counts(server.url, model)
        batch = None
        if counts0 and counts1 and counts1[1] > counts0[1]:
            batch = (counts1[0] - counts0[0]) / (counts1[1] - counts0[1])
        return Measurement(
            server=label,
            model=model,
            concurrency=concurrency,
            throughput=r.throughput,
            p50_us=r.p50_us,
            p99_us=r.p99_us,
            server_cores=cores,
            window_spread=window_spread(r.stdout),
            avg_batch=batch,
            stability_pct=pct,
            stable=stable,
            repeat=repeat,
        )
    raise AssertionError("unreachable")


def execution_counts(url: str, model: str) -> tuple[int, int] | None:
    """(inference_count, execution_count) from ModelStatistics; None where unsupported."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model)
    except InferenceServerException:  # MLServer: UNIMPLEMENTED
        return None
    finally:
        client.close()
    return (
        sum(s.inference_count for s in stats.model_stats),
        sum(s.execution_count for s in stats.model_stats),
    )


def _repeats_for(concurrency: int, args) -> int:
    if args.repeat_concurrency and concurrency not in args.repeat_concurrency:
        return 1
    return max(1, args.repeats)


def run_server(
    label: str, args, models, workdir: Path, log, measurements: list[Measurement], info: dict
) -> None:
    """Start one server, check its answers, measure every point, stop it.

    Appends to ``measurements`` as it goes (so an interrupted run keeps what it
    measured) and records startup time, version and failures in ``info``.
    """
    kind, options = _server_options(label, args)
    t0 = time.monotonic()
    info["options"] = options
    with start_server(kind, workdir, models, **options) as server:
        info["startup_s"] = round(time.monotonic() - t0, 1)
        info["notes"] = server.notes
        info["version"] = _server_version(server.url)
        check_consistency(server.url, models)
        log(
            f"{LABELS[label]} ({info['version']}) up in {info['startup_s']}s at {server.url}; "
            "consistency check passed"
        )
        for bench_model in models:
            model = bench_model.name
            data = bench_model.write_input_data(workdir / "perf-input" / f"{model}.json")
            for c in args.concurrency:
                for rep in range(_repeats_for(c, args)):
                    try:
                        m = measure_point(
                            label, server, model, c, args, rep, bench_model.input_shapes, data
                        )
                    except PerfAnalyzerError as exc:
                        log(f"  {model} c={c}: FAILED ({str(exc).splitlines()[0]})")
                        info.setdefault("failures", []).append(f"{model} c={c}: {exc}")
                        continue
                    measurements.append(m)
                    spread = "" if m.window_spread is None else f"  spread {m.window_spread:.0%}"
                    log(
                        f"  {model:8s} c={c:<3d} {m.throughput:9.1f} infer/s  "
                        f"p50 {m.p50_us / 1000:7.2f} ms  p99 {m.p99_us / 1000:7.2f} ms  "
                        f"cores {m.server_cores or 0:.2f}{spread}"
                        + ("" if m.avg_batch is None else f"  batch {m.avg_batch:.1f}")
                        + ("" if m.stable else f"  (stable only at -s {m.stability_pct})")
                    )
    info["wall_s"] = round(time.monotonic() - t0, 1)


def _server_version(url: str) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        md = client.get_server_metadata()
        return f"{md.name} {md.version}"
    except Exception:  # noqa: BLE001 - a version string is informative only
        return "?"
    finally:
        client.close()


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--servers", nargs="+", default=list(DEFAULT_SERVERS), choices=ALL_SERVERS)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--measurement-ms", type=int, default=5000, help="perf_analyzer -p")
    ap.add_argument("--stability-pct", type=int, default=30, help="perf_analyzer -s")
    ap.add_argument("--max-trials", type=int, default=5, help="perf_analyzer --max-trials")
    ap.add_argument(
        "--unstable-retry-pct", type=int, default=1000,
        help="rerun an unstable point once, 3 windows at this -s (marked '*'); <= -s: no retry",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="runs per point (median reported)")
    ap.add_argument(
        "--repeat-concurrency", nargs="*", type=int, default=None,
        help="only these concurrencies get --repeats (default: all)",
    )  # fmt: skip
    ap.add_argument("--instances", type=int, default=1, help="model instances, every server")
    ap.add_argument("--mlserver-workers", type=int, default=0, help="MLServer parallel_workers")
    ap.add_argument("--mlserver-batch-time-ms", type=float, default=1.0,
                    help="MLServer max_batch_time")  # fmt: skip
    ap.add_argument("--stageserve-workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if find_perf_analyzer() is None:
        print("perf_analyzer is not installed: run scripts/install_perf_analyzer.sh",
              file=sys.stderr)  # fmt: skip
        return 2
    servers = []
    for s in args.servers:
        missing = _check_installed(s)
        if missing:
            print(f"skipping {s}: {missing}", file=sys.stderr)
        else:
            servers.append(s)
    if not servers:
        return 2

    started = time.monotonic()
    models = bench_models(args.models)
    measurements: list[Measurement] = []
    meta: dict = {
        "command": " ".join(["python -m bench.compare", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "stageserve_commit": _git_commit(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": {},
    }
    failed = False
    try:
        for label in servers:
            info: dict = {}
            meta["servers"][label] = info
            with tempfile.TemporaryDirectory(prefix=f"bench-compare-{label}-") as tmp:
                try:
                    run_server(label, args, models, Path(tmp), log, measurements, info)
                except (ServerStartError, AssertionError, RuntimeError) as exc:
                    log(f"{LABELS[label]}: FAILED: {exc}")
                    info["error"] = str(exc)
                    failed = True
    except (KeyboardInterrupt, PerfAnalyzerNotInstalled) as exc:
        log(f"interrupted ({type(exc).__name__}); writing what was measured")
        failed = True
    meta["wall_s"] = round(time.monotonic() - started, 1)

    points = summarize(measurements)
    print()
    print(format_points(points))
    print()
    rs = ratios(points)
    if rs:
        print(format_ratios(rs))
        print()
    checks = target_checks(rs)
    if checks:
        print("Targets (StageServe / reference at the target's concurrencies):")
        print(format_targets(checks))
        print()
    proxy = proxy_overhead(points)
    if proxy:
        print("ModelConfig proxy overhead (MLServer behind the proxy / MLServer alone):")
        print(format_ratios(proxy, ours_label="proxy"))
        print()
    python = python_ratios(points)
    if python:
        print("The same model.py files (StageServe+model.py / Triton):")
        print(format_ratios(python, ours_label="SS-py"))
        print()
    stubs = python_ratios(points, ours="stageserve-python-process")
    if stubs:
        print("The same model.py files, a stub process per instance (StageServe / Triton):")
        print(format_ratios(stubs, ours_label="SS-stub"))
        print()
    files = write_results(args.out, measurements, meta, plot=not args.no_plot)
    print(f"total {meta['wall_s']:.0f}s; wrote " + ", ".join(str(p) for p in files.values()))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
