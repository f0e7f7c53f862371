"""Every tool in the repository starts: `python -m bench.*`, deploy/*.py, scripts/*.sh.

Each entry point runs here as a user runs it, as its own process, at tiny sizes
on the CPU (a few seconds each), and must exit 0 with its report's landmark in
the output; so a tool whose entry point no longer starts (an argument it passes
that a callee no longer takes, an import that moved) fails CI instead of the
next person who measures. Where a tool needs what a CPU host lacks, the reason
is in :data:`SMOKE` and the test says it when it skips.

:func:`test_every_entry_point_has_a_smoke_run` fails when a module or script is
added without a row here (or, for a module without a ``__main__`` block, a
place in :data:`LIBRARIES`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.perf_analyzer import find_perf_analyzer
from bench.references import ReferenceNotInstalled, find_triton
from stageserve.net import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180.0


def _no_perf_analyzer() -> str | None:
    if find_perf_analyzer() is None:
        return "perf_analyzer is not installed (scripts/install_perf_analyzer.sh)"
    return None


def _no_triton() -> str | None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        return str(exc)
    return None


def _no_mlserver() -> str | None:
    venv = ROOT / os.environ.get("MLSERVER_VENV", ".venv-mlserver")
    if not (venv / "bin" / "python").exists():
        return f"MLServer is not installed at {venv} (scripts/install_references.sh mlserver)"
    return None


def _no_prometheus() -> str | None:
    if shutil.which("prometheus") is None:
        return "no prometheus binary (Debian package prometheus; scripts/validate_deploy.sh)"
    return None


@dataclass(frozen=True)
class Smoke:
    """argv after the interpreter (``python`` for .py, ``bash`` for .sh), a text
    its output must hold, and what it needs that a host may lack."""

    argv: tuple[str, ...]
    expect: str
    missing: tuple[Callable[[], str | None], ...] = ()
    until: str | None = None  # a long-running tool: SIGINT once this is printed
    env: dict[str, str] = field(default_factory=dict)
    exit_codes: tuple[int, ...] = (0,)
    # a server to start first (python argv); {server} in argv is its port
    beside: tuple[str, ...] = ()


PY = ("-m",)
TINY_PERF = ("--measurement-ms", "300")
# A smoke run, not a figure: any windows will do (on a loaded host perf_analyzer
# finds no stable measurement at the tools' default percentages).
ANY_WINDOWS = ("--stability-pct", "1000")

# entry point -> its smoke run
SMOKE: dict[str, Smoke] = {
    "bench/__main__.py": Smoke(
        (*PY, "bench", "--models", "simple", "--concurrency", "1", *TINY_PERF, *ANY_WINDOWS),
        "infer/s",
        (_no_perf_analyzer,),
    ),
    "bench/cache.py": Smoke(
        (
            *PY,
            "bench.cache",
            "--caches",
            "local",
            "--models",
            "mlp",
            "--distinct",
            "3",
            "--rounds",
            "1",
        ),
        '"hit_rate": 0.5',
    ),  # fmt: skip
    # The two Triton diffs run whole in test_log_settings.py / test_trace_diff.py.
    "bench/log_settings_diff.py": Smoke(("-m", "bench.log_settings_diff", "--help"), "--record"),
    "bench/trace_diff.py": Smoke(("-m", "bench.trace_diff", "--help"), "--verbose"),
    # a run is one stack and one perf_analyzer point per variant (~40 s on the CPU):
    # Builds an environment with numpy from PyPI; test_python_exec_env.py does that once.
    "bench/python_exec_env.py": Smoke(("-m", "bench.python_exec_env", "--help"), "--numpy"),
    "bench/scheduler_cost.py": Smoke(
        (
            *PY,
            "bench.scheduler_cost",
            "--concurrency",
            "1",
            "--rounds",
            "1",
            *TINY_PERF,
            *ANY_WINDOWS,
        ),
        "CPU us per inference",
        (_no_perf_analyzer,),
    ),
    # In one process, no stack: a few batches per step.
    "bench/gateway_work.py": Smoke(
        (*PY, "bench.gateway_work", "--repeats", "1", "--number", "3"),
        "whole path, fresh messages",
    ),
    "bench/scheduler_work.py": Smoke(
        (
            *PY,
            "bench.scheduler_work",
            "--requests",
            "4",
            "--repeats",
            "1",
            "--number",
            "3",
            "--shm",
        ),
        "tensors in shared memory",
    ),
    "bench/tensor_shm_cost.py": Smoke(
        (*PY, "bench.tensor_shm_cost", "--repeat", "3", "--rounds", "1", "--sizes", "1024"),
        "shm us",
    ),
    "bench/trace_cost.py": Smoke(
        (*PY, "bench.trace_cost", "--concurrency", "1", "--rounds", "1", *TINY_PERF, *ANY_WINDOWS),
        "| rate 1 |",
        (_no_perf_analyzer,),
    ),  # fmt: skip
    "bench/ceiling.py": Smoke(
        (
            *PY,
            "bench.ceiling",
            "--variants",
            "direct",
            "--concurrency",
            "1",
            *TINY_PERF,
            *ANY_WINDOWS,
        ),
        "infer/s",
        (_no_perf_analyzer,),
    ),
    "bench/chaos.py": Smoke(
        (
            *PY,
            "bench.chaos",
            "--stages",
            "scheduler",
            "--clients",
            "1",
            "--baseline-s",
            "0.5",
            "--window-s",
            "2",
        ),
        "goals",
        exit_codes=(0, 1),  # its verdict on issue 14's goals: a measurement, not a start-up
    ),  # fmt: skip
    "bench/compare.py": Smoke(
        (
            *PY,
            "bench.compare",
            "--servers",
            "stageserve",
            "--models",
            "identity",
            "--concurrency",
            "1",
            "--max-trials",
            "2",
            "--no-plot",
            "--out",
            "{tmp}",
            *TINY_PERF,
            *ANY_WINDOWS,
        ),
        "StageServe",
        (_no_perf_analyzer,),
    ),  # fmt: skip
    # CPU EP: no GPU here; the same code path picks CUDA where there is one.
    "bench/gpu.py": Smoke(
        (
            *PY,
            "bench.gpu",
            "--device",
            "cpu",
            "--batch",
            "2",
            "--image-size",
            "16",
            "--width",
            "4",
            "--seconds",
            "0.3",
            "--concurrency",
            "2",
            "--variant",
            "two:instances=2;execute_delay_ms=1",
            *TINY_PERF,
            *ANY_WINDOWS,
        ),
        "StageServe cnn_two",
        (_no_perf_analyzer,),
    ),  # fmt: skip
    "bench/http.py": Smoke(
        (
            *PY,
            "bench.http",
            "--servers",
            "stageserve",
            "--models",
            "identity",
            "--concurrency",
            "1",
            *TINY_PERF,
        ),
        "http",
        (_no_perf_analyzer,),
    ),  # fmt: skip
    # Runs inside MLServer's own venv (CI installs Triton only); bench.compare starts it.
    "bench/mlserver_boot.py": Smoke(
        (
            *PY,
            "bench.compare",
            "--servers",
            "mlserver",
            "--models",
            "identity",
            "--concurrency",
            "1",
            "--max-trials",
            "2",
            "--no-plot",
            "--out",
            "{tmp}",
            *TINY_PERF,
            *ANY_WINDOWS,
        ),
        "mlserver",
        (_no_perf_analyzer, _no_mlserver),
    ),  # fmt: skip
    # Against bench.ceiling's one-process server, which speaks Triton's protocol.
    "bench/perf_analyzer.py": Smoke(
        (
            *PY,
            "bench.perf_analyzer",
            "-u",
            "127.0.0.1:{server}",
            "-m",
            "id16",
            "-c",
            "1",
            "-p",
            "300",
            # a start-up check, not a measurement: any stable-enough window will do
            # on a loaded machine (perf_analyzer gives up after 10 windows)
            "-s",
            "100",
        ),
        "id16",
        (_no_perf_analyzer,),
        beside=("-m", "bench.ceiling", "--serve", "direct", "--port", "{server}"),
    ),  # fmt: skip
    "bench/python_backend.py": Smoke(
        (
            *PY,
            "bench.python_backend",
            "--instances",
            "1",
            "--seconds",
            "0.3",
            "--models",
            "trivial",
        ),
        "| trivial | 1 | process |",
    ),  # fmt: skip
    "bench/ratelimit_cost.py": Smoke(
        (*PY, "bench.ratelimit_cost", "-c", "1", *TINY_PERF), "rl_us/req"
    ),
    "bench/references.py": Smoke(
        (*PY, "bench.references", "stageserve", "--models", "identity"),
        "consistency check passed",
        until="Ctrl-C stops it",
    ),
    "bench/scale.py": Smoke(
        (
            *PY,
            "bench.scale",
            "--gateways",
            "2",
            "--models",
            "identity",
            "--concurrency",
            "1",
            "--max-trials",
            "3",
            # a smoke run, not a figure: any 3 windows will do on a busy host
            "--stability-pct",
            "1000",
            *TINY_PERF,
        ),
        "req/msg sched",
        (_no_perf_analyzer,),
    ),  # fmt: skip
    "bench/sequence_work.py": Smoke(
        (*PY, "bench.sequence_work", "--requests", "3", "--batches", "3", "--repeats", "1"),
        "commit the states (Redis, wall)",
    ),
    "bench/stream_vs_unary.py": Smoke(
        (*PY, "bench.stream_vs_unary", "--seconds", "0.3", "--inflight", "1"), "stream"
    ),
    "bench/script_lane.py": Smoke(
        (*PY, "bench.script_lane", "--calls", "20", "--rounds", "1"), "cpu us/call"
    ),
    "bench/transport.py": Smoke(
        (*PY, "bench.transport", "--seconds", "0.3", "--inflight", "1"), "calls/s"
    ),
    "bench/triton_diff.py": Smoke((*PY, "bench.triton_diff"), "", (_no_triton,)),
    "bench/triton_priority.py": Smoke(
        (
            *PY,
            "bench.triton_priority",
            "--server",
            "stageserve",
            "--layout",
            "models",
            "--seconds",
            "0.5",
            "--clients",
            "2",
        ),
        "picks",
    ),  # fmt: skip
    "deploy/checks.py": Smoke(("deploy/checks.py",), "k8s: ok"),
    # Needs Prometheus to scrape; --render also drives deploy/load.py and
    # deploy/render_dashboards.py against it.
    "deploy/smoke.py": Smoke(
        (
            "deploy/smoke.py",
            "--workers",
            "1",
            "--load-seconds",
            "2",
            "--render",
            "{tmp}",
            "--render-load-seconds",
            "2",
            "--load-tool",
            "tritonclient",
        ),
        "",
        (_no_prometheus,),
    ),  # fmt: skip
    "deploy/grafana/generate_dashboards.py": Smoke(
        ("deploy/grafana/generate_dashboards.py", "--check"), ""
    ),  # --check: reads and compares, writes nothing
    "deploy/render_dashboards.py": Smoke(("deploy/render_dashboards.py", "--help"), "--prometheus"),
    # Installs (sourced by test.sh and up.sh): the run re-checks an installed
    # venv (its stamp newer than pyproject.toml) and puts it first on PATH.
    "scripts/dev_env.sh": Smoke(
        ("-c", "source scripts/dev_env.sh && command -v python"),
        "{venv}/bin/python",
        env={"STAGESERVE_VENV": "{venv}"},
    ),
    # Idempotent: with perf_analyzer installed it re-checks the binary (well under a second).
    "scripts/install_perf_analyzer.sh": Smoke(
        ("scripts/install_perf_analyzer.sh",), "perf_analyzer", (_no_perf_analyzer,)
    ),
    # Idempotent: with Triton installed, re-checks it with a smoke start of tritonserver.
    "scripts/install_references.sh": Smoke(
        ("scripts/install_references.sh", "triton"),
        "",
        (_no_triton,),
        env={"SKIP_PERF_ANALYZER": "1"},
    ),
    # Needs a GPU host, the wheel bundle and the onnxruntime-gpu parts copied
    # there (docs/gpu.md): bash -n parses it; test_dry_gpu_host_check.py puts
    # every step's command line through its program's parser; each step it
    # runs (pytest -m gpu, bench.gpu, bench.scale) has its own smoke run or
    # GPU-marked test.
    "scripts/gpu_host_check.sh": Smoke(("-n", "scripts/gpu_host_check.sh"), ""),
    # Downloads ~290 MB (the GPU host's wheels): bash -n parses it; it was run
    # to build the bundle of the H100 runs in docs/benchmarks.md.
    "scripts/gpu_bundle.sh": Smoke(("-n", "scripts/gpu_bundle.sh"), ""),
    # The whole suite, this test included, cannot run inside itself: bash -n
    # parses it; each step it runs (dev_env.sh, the install scripts,
    # validate_deploy.sh, ruff, mypy, pytest) runs on its own elsewhere.
    "scripts/test.sh": Smoke(("-n", "scripts/test.sh"), ""),
    "scripts/up.sh": Smoke(
        (
            "scripts/up.sh",
            "--grpc-port",
            "{port}",
            "--http-port",
            "{port}",
            "--metrics-port",
            "{port}",
            "--device",
            "cpu",
        ),
        "",
        until='"event": "stageserve up"',
        env={"STAGESERVE_VENV": "{venv}"},
    ),  # fmt: skip
    "scripts/validate_deploy.sh": Smoke(("scripts/validate_deploy.sh", "--help"), "--live"),
}

# Modules with no entry point of their own (each is run by one above).
LIBRARIES = {
    "bench/__init__.py",
    "bench/blas_coretype.py",
    "bench/chaos_audit.py",
    "bench/cnn.py",
    "bench/mlserver_runtime.py",
    "bench/numpy_model.py",
    "bench/profile.py",
    "bench/torch_cnn.py",
    "bench/triton_model.py",
    "deploy/load.py",
}


def _entry_points() -> set[str]:
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.sh")}
    for pattern in ("bench/*.py", "deploy/**/*.py"):
        found |= {str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)}
    return found


def test_every_entry_point_has_a_smoke_run() -> None:
    found = _entry_points()
    assert sorted(found - SMOKE.keys() - LIBRARIES) == [], "add a smoke run to SMOKE"
    assert sorted((SMOKE.keys() | LIBRARIES) - found) == [], "listed here, gone from the tree"
    for path in LIBRARIES:
        text = (ROOT / path).read_text()
        assert '__name__ == "__main__"' not in text, f"{path} is an entry point: give it a Smoke"


def _fake_venv(tmp: Path) -> Path:
    """An installed-looking venv for scripts that source dev_env.sh: its python
    and stageserve are this interpreter's, its stamp is newer than pyproject.toml
    (so nothing is installed into the shared environment)."""
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    real_bin = Path(sys.executable).parent
    for name in ("python", "python3", "stageserve"):
        (venv / "bin" / name).symlink_to(real_bin / name)
    (venv / ".stageserve-installed").touch()
    return venv


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise AssertionError(f"the server beside the tool did not listen on {port}")


@contextlib.contextmanager
def _beside(argv: Sequence[str]) -> Iterator[int | None]:
    """The smoke run's server, on a free port, for the length of the run."""
    if not argv:
        yield None
        return
    port = free_port()
    cmd = [sys.executable, *(a.replace("{server}", str(port)) for a in argv)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_listening(port, proc)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run(smoke: Smoke, tmp: Path, server: int | None) -> tuple[int, str]:
    venv = _fake_venv(tmp)

    def fill(text: str) -> str:
        text = text.replace("{tmp}", str(tmp / "out")).replace("{venv}", str(venv))
        text = text.replace("{server}", str(server))
        while "{port}" in text:
            text = text.replace("{port}", str(free_port()), 1)
        return text

    interpreter = (
        ["bash"]
        if smoke.argv[0].endswith(".sh") or smoke.argv[0] in ("-c", "-n")
        else [sys.executable]
    )
    cmd = [*interpreter, *map(fill, smoke.argv)]
    env = {**os.environ, **{k: fill(v) for k, v in smoke.env.items()}}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    # A tool that hangs (or leaves a child holding its stdout) is killed, whole group.
    watchdog = threading.Timer(TIMEOUT_S, _kill_group, (proc,))
    watchdog.start()
    try:
        signalled = smoke.until is None
        for line in proc.stdout:
            lines.append(line)
            if not signalled and smoke.until is not None and smoke.until in line:
                proc.send_signal(signal.SIGINT)
                signalled = True
        code = proc.wait(TIMEOUT_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    return code, "".join(lines)


@pytest.mark.parametrize("entry_point", sorted(SMOKE))
def test_smoke_run(entry_point: str, tmp_path: Path) -> None:
    smoke = SMOKE[entry_point]
    for check in smoke.missing:
        reason = check()
        if reason is not None:
            pytest.skip(f"{entry_point}: {reason}")
    with _beside(smoke.beside) as server:
        code, output = _run(smoke, tmp_path, server)
    tail = output[-4000:]
    assert code in smoke.exit_codes, f"{entry_point} exited {code}:\n{tail}"
    expect = smoke.expect.replace("{venv}", str(tmp_path / "venv"))
    assert expect in output, f"{entry_point}: no {expect!r} in its output:\n{tail}"
