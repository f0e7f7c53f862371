"""Drive NVIDIA's ``perf_analyzer`` (tritonclient 2.50.0) and parse what it reports.

The binary lives in its own virtualenv (``scripts/install_perf_analyzer.sh``,
default ``.venv-perf`` at the repo root) and needs ``libcudart.so.12`` from the
venv's ``nvidia-cuda-runtime-cu12`` on ``LD_LIBRARY_PATH``, even with no GPU.

Flags used by :func:`run_perf`::

    perf_analyzer -i grpc -u URL -m MODEL --concurrency-range C:C
                  -p MEASUREMENT_MS -s STABILITY_PCT [--percentile=N]
                  [--shape NAME:D1,D2,...] --verbose-csv -f perf.csv

perf_analyzer takes each input's shape from ``ModelMetadata`` (the batch
dimension dropped when ``max_batch_size > 0``) and uses a ``--shape`` only
for an input with a variable (-1) dimension; for fixed dims such as the
benchmark CNN's ``[3, 32, 32]`` a ``--shape`` is accepted and ignored, so
passing every input's shape is safe and states in the command line what is
sent (``test_run_perf_sends_image_shaped_inputs`` checks both cases with the
real binary).

``--verbose-csv`` adds ``Avg latency`` (only when no ``--percentile`` is given),
``request/response`` and ``response wait`` columns. The CSV always carries the
p50/p90/p95/p99 client latencies, and the server-side breakdown (queue,
compute input/infer/output) when the server's metadata lists the
``statistics`` extension.

Exit codes seen from 2.50: 0 ok, 2 "Failed to obtain stable measurement",
99 any other error (unknown model, connection refused, bad flag, ``--help``).

Run ``python -m bench.perf_analyzer -u 127.0.0.1:8001 -m MODEL -c 1 2 4`` for a table.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ".venv-perf"
CSV_NAME = "perf.csv"

EXIT_UNSTABLE = 2


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer exited non-zero (or timed out); carries its output."""

    def __init__(self, message: str, *, cmd: Sequence[str], returncode: int | None, output: str):
        super().__init__(f"{message}\n$ {' '.join(cmd)}\n{output.strip()}")
        self.cmd = list(cmd)
        self.returncode = returncode
        self.output = output


class PerfAnalyzerUnstable(PerfAnalyzerError):
    """Exit code 2: no stable measurement within --max-trials windows."""


class PerfAnalyzerNotInstalled(FileNotFoundError):
    """No perf_analyzer binary (run scripts/install_perf_analyzer.sh)."""


@dataclass(frozen=True)
class PerfAnalyzer:
    """A runnable perf_analyzer: the binary and the environment to run it in."""

    binary: Path
    env: dict[str, str] = field(repr=False)
    lib_dir: Path | None = None  # directory holding libcudart.so.12, if from a venv
    tritonclient_version: str | None = None

    def command(self, *args: str) -> list[str]:
        return [str(self.binary), *args]


def _venv_path(venv: str | os.PathLike[str] | None) -> Path:
    raw = Path(venv if venv is not None else os.environ.get("PERF_VENV", DEFAULT_VENV))
    return raw if raw.is_absolute() else REPO_ROOT / raw


def _cudart_dir(venv: Path) -> Path | None:
    for lib in sorted(venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib")):
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def _tritonclient_version(venv: Path) -> str | None:
    for dist in sorted(venv.glob("lib/python3*/site-packages/tritonclient-*.dist-info")):
        return dist.name.removeprefix("tritonclient-").removesuffix(".dist-info")
    return None


def find_perf_analyzer(venv: str | os.PathLike[str] | None = None) -> PerfAnalyzer | None:
    """Locate perf_analyzer and the environment it needs.

    ``$PERF_ANALYZER`` (a binary path, e.g. in the Triton SDK container) wins;
    otherwise the binary of ``venv`` (default ``$PERF_VENV`` or ``.venv-perf``,
    relative to the repo root), returned only if that venv also has
    ``libcudart.so.12``. Returns ``None`` when neither is there.

    ``PATH`` is deliberately not searched: the main environment's tritonclient
    wheel puts its own (older) ``perf_analyzer`` there, which cannot find
    ``libcudart.so.12``.
    """
    explicit = os.environ.get("PERF_ANALYZER")
    if venv is None and explicit:
        binary = Path(explicit)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            return None
        root = binary.resolve().parent.parent
        lib_dir = _cudart_dir(root)
        return PerfAnalyzer(binary, _env_with(lib_dir), lib_dir, _tritonclient_version(root))
    root = _venv_path(venv)
    binary = root / "bin" / "perf_analyzer"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return None
    lib_dir = _cudart_dir(root)
    if lib_dir is None:
        return None
    return PerfAnalyzer(binary, _env_with(lib_dir), lib_dir, _tritonclient_version(root))


def _env_with(lib_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if lib_dir is not None:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{lib_dir}:{old}" if old else str(lib_dir)
    return env


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ServerStats:
    """Server-side averages per request, in microseconds (from ModelStatistics)."""

    network_us: float  # "Network+Server Send/Recv": client wait minus server-accounted time
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float

    @property
    def compute_us(self) -> float:
        return self.compute_input_us + self.compute_infer_us + self.compute_output_us


@dataclass(frozen=True)
class PerfResult:
    model: str
    concurrency: int
    throughput: float  # inferences/s
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    avg_us: float | None  # None when --percentile was given (perf_analyzer omits it)
    client_send_us: float | None = None
    client_recv_us: float | None = None
    request_count: int | None = None
    server: ServerStats | None = None
    stdout: str = field(default="", repr=False)
    csv: str = field(default="", repr=False)


_CSV_SERVER_COLUMNS = (
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
)


def parse_csv(text: str) -> list[dict[str, float]]:
    """Rows of a ``-f`` report, as {column header: number}. Empty cells are dropped."""
    rows: list[dict[str, float]] = []
    reader = csv.DictReader(io.StringIO(text.strip()))
    for raw in reader:
        row: dict[str, float] = {}
        for key, value in raw.items():
            if key is None or value is None or value.strip() == "":
                continue
            row[key.strip()] = float(value)
        if row:
            rows.append(row)
    return rows


_NUM = r"([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)"
_STDOUT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("request_count", re.compile(rf"^\s*Request count: {_NUM}", re.M)),
    ("throughput", re.compile(rf"^\s*Throughput: {_NUM} infer/sec", re.M)),
    ("avg_us", re.compile(rf"^\s*Avg latency: {_NUM} usec", re.M)),
    ("server_request_us", re.compile(rf"^\s*Avg request latency: {_NUM} usec", re.M)),
    ("server_queue_us", re.compile(rf"\+ queue {_NUM} usec")),
    ("server_compute_input_us", re.compile(rf"\+ compute input {_NUM} usec")),
    ("server_compute_infer_us", re.compile(rf"\+ compute infer {_NUM} usec")),
    ("server_compute_output_us", re.compile(rf"\+ compute output {_NUM} usec")),
)
_PCT_RE = re.compile(rf"^\s*p([0-9]+) latency: {_NUM} usec", re.M)
_BLOCK_RE = re.compile(r"^Request concurrency: ([0-9]+)\s*$", re.M)


def parse_stdout(text: str) -> dict[int, dict[str, float]]:
    """Per-concurrency numbers from perf_analyzer's console report.

    Keys: request_count, throughput, avg_us (absent with --percentile), pNN_us,
    and server_* when the server reports statistics.
    """
    out: dict[int, dict[str, float]] = {}
    starts = list(_BLOCK_RE.finditer(text))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        block = text[m.end() : end]
        # The closing summary ("Inferences/Second vs. ...") is not part of a block.
        block = block.split("\nInferences/Second vs.", 1)[0]
        vals: dict[str, float] = {}
        for key, pat in _STDOUT_PATTERNS:
            hit = pat.search(block)
            if hit:
                vals[key] = float(hit.group(1))
        for hit in _PCT_RE.finditer(block):
            vals[f"p{hit.group(1)}_us"] = float(hit.group(2))
        out[int(m.group(1))] = vals
    return out


def _server_from_csv(row: dict[str, float]) -> ServerStats | None:
    if not all(c in row for c in _CSV_SERVER_COLUMNS):
        return None
    return ServerStats(*(row[c] for c in _CSV_SERVER_COLUMNS))


def build_result(model: str, concurrency: int, csv_text: str, stdout: str) -> PerfResult:
    """Combine the CSV report (preferred) and the console report into a PerfResult."""
    console = parse_stdout(stdout).get(concurrency, {})
    rows = [r for r in parse_csv(csv_text) if int(r.get("Concurrency", -1)) == concurrency]
    if rows:
        row = rows[0]
        avg = row.get("Avg latency", console.get("avg_us"))
        count = console.get("request_count")
        return PerfResult(
            model=model,
            concurrency=concurrency,
            throughput=row["Inferences/Second"],
            p50_us=row["p50 latency"],
            p90_us=row["p90 latency"],
            p95_us=row["p95 latency"],
            p99_us=row["p99 latency"],
            avg_us=avg,
            client_send_us=row.get("Client Send"),
            client_recv_us=row.get("Client Recv"),
            request_count=int(count) if count is not None else None,
            server=_server_from_csv(row),
            stdout=stdout,
            csv=csv_text,
        )
    if "throughput" not in console or "p50_us" not in console:
        raise ValueError(f"no result for concurrency {concurrency} in perf_analyzer output")
    server = None
    if "server_queue_us" in console:
        server = ServerStats(
            network_us=float("nan"),
            queue_us=console["server_queue_us"],
            compute_input_us=console.get("server_compute_input_us", 0.0),
            compute_infer_us=console.get("server_compute_infer_us", 0.0),
            compute_output_us=console.get("server_compute_output_us", 0.0),
        )
    count = console.get("request_count")
    return PerfResult(
        model=model,
        concurrency=concurrency,
        throughput=console["throughput"],
        p50_us=console["p50_us"],
        p90_us=console["p90_us"],
        p95_us=console["p95_us"],
        p99_us=console["p99_us"],
        avg_us=console.get("avg_us"),
        request_count=int(count) if count is not None else None,
        server=server,
        stdout=stdout,
        csv=csv_text,
    )


# --------------------------------------------------------------------------- running


def perf_args(
    url: str,
    model: str,
    concurrency: int,
    *,
    measurement_ms: int = 5000,
    stability_pct: int = 20,
    percentile: int | None = None,
    protocol: str = "grpc",
    csv_path: str = CSV_NAME,
    extra_args: Sequence[str] = (),
    shapes: Mapping[str, Sequence[int]] | None = None,
    input_data: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The perf_analyzer argument list used by :func:`run_perf` (without the binary).

    ``shapes``: input name -> dims without the batch dimension, one
    ``--shape NAME:D1,D2,...`` each. ``input_data``: ``--input-data`` (a JSON
    file, or a directory with one raw file per input); None: perf_analyzer's
    random data.
    """
    args = [
        "-i", protocol,
        "-u", url,
        "-m", model,
        "--concurrency-range", f"{concurrency}:{concurrency}",
        "-p", str(measurement_ms),
        "-s", str(stability_pct),
    ]  # fmt: skip
    if percentile is not None:
        args.append(f"--percentile={percentile}")
    args += shape_args(shapes or {})
    if input_data is not None:
        args += ["--input-data", str(input_data)]
    args += ["--verbose-csv", "-f", csv_path, *extra_args]
    return args


def shape_args(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """``--shape NAME:D1,D2,...`` per input (dims without the batch dimension)."""
    out = []
    for name, dims in shapes.items():
        if not dims or any(int(d) < 1 for d in dims):
            raise ValueError(f"--shape {name}: dims must be positive, got {list(dims)}")
        out += ["--shape", f"{name}:{','.join(str(int(d)) for d in dims)}"]
    return out


def run_perf(
    url: str,
    model: str,
    concurrency: int,
    *,
    measurement_ms: int = 5000,
    stability_pct: int = 20,
    percentile: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
    protocol: str = "grpc",
    analyzer: PerfAnalyzer | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    input_data: str | os.PathLike[str] | None = None,
) -> PerfResult:
    """Run one perf_analyzer measurement at a fixed concurrency.

    ``percentile`` (e.g. 99) makes perf_analyzer stabilise on that percentile
    instead of the average latency; it then reports no average (``avg_us`` is
    None). ``shapes`` and ``input_data``: see :func:`perf_args`. ``timeout_s`` defaults to
    enough for 10 trials of ``measurement_ms`` plus a minute. Raises
    :class:`PerfAnalyzerUnstable` (exit 2), :class:`PerfAnalyzerError` (other
    failures, timeouts) or :class:`PerfAnalyzerNotInstalled`.
    """
    pa = analyzer or find_perf_analyzer()
    if pa is None:
        raise PerfAnalyzerNotInstalled(
            "perf_analyzer not found; run scripts/install_perf_analyzer.sh"
        )
    if timeout_s is None:
        timeout_s = 60.0 + 10 * measurement_ms / 1000.0
    args = perf_args(
        url,
        model,
        concurrency,
        measurement_ms=measurement_ms,
        stability_pct=stability_pct,
        percentile=percentile,
        protocol=protocol,
        extra_args=extra_args,
        shapes=shapes,
        input_data=input_data,
    )
    cmd = pa.command(*args)
    # Run inside a scratch dir with a relative -f: for ensembles perf_analyzer also
    # writes "<composing>_v<ver>.<csv name>" files relative to its cwd.
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        try:
            proc = subprocess.run(
                cmd,
                cwd=tmp,
                env=pa.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
            raise PerfAnalyzerError(
                f"perf_analyzer timed out after {timeout_s:.0f}s",
                cmd=cmd,
                returncode=None,
                output=partial,
            ) from exc
        output = proc.stdout
        if proc.returncode != 0:
            kind = PerfAnalyzerUnstable if proc.returncode == EXIT_UNSTABLE else PerfAnalyzerError
            raise kind(
                f"perf_analyzer exited with {proc.returncode}",
                cmd=cmd,
                returncode=proc.returncode,
                output=output,
            )
        csv_file = Path(tmp) / CSV_NAME
        csv_text = csv_file.read_text() if csv_file.exists() else ""
    try:
        return build_result(model, concurrency, csv_text, output)
    except (ValueError, KeyError) as exc:
        raise PerfAnalyzerError(
            f"could not parse perf_analyzer output: {exc}",
            cmd=cmd,
            returncode=proc.returncode,
            output=output,
        ) from exc


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:,.{digits}f}"


def format_table(rows: Iterable[PerfResult]) -> str:
    """A fixed-width text table of results (latencies in microseconds)."""
    header = (
        "model", "conc", "infer/s", "avg_us", "p50_us", "p90_us", "p99_us",
        "queue_us", "compute_us",
    )  # fmt: skip
    body: list[tuple[str, ...]] = []
    for r in rows:
        body.append(
            (
                r.model,
                str(r.concurrency),
                _fmt(r.throughput, 1),
                _fmt(r.avg_us),
                _fmt(r.p50_us),
                _fmt(r.p90_us),
                _fmt(r.p99_us),
                _fmt(r.server.queue_us if r.server else None),
                _fmt(r.server.compute_us if r.server else None),
            )
        )
    return text_table(header, body)


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned."""
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run perf_analyzer at a few concurrencies.")
    ap.add_argument("-u", "--url", default="127.0.0.1:8001")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("-p", "--measurement-ms", type=int, default=5000)
    ap.add_argument("-s", "--stability-pct", type=int, default=20)
    ap.add_argument("--percentile", type=int, default=None)
    ap.add_argument("extra", nargs="*", help="passed to perf_analyzer after --")
    ns = ap.parse_args(argv)
    results = []
    for c in ns.concurrency:
        try:
            results.append(
                run_perf(
                    ns.url,
                    ns.model,
                    c,
                    measurement_ms=ns.measurement_ms,
                    stability_pct=ns.stability_pct,
                    percentile=ns.percentile,
                    extra_args=ns.extra,
                )
            )
        except (PerfAnalyzerError, PerfAnalyzerNotInstalled) as exc:
            print(exc, file=sys.stderr)
            return 1
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
