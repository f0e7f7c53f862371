"""Load for a live stack, so that every dashboard panel has something to show.

Three phases of rising concurrency on `simple` and `mlp`, with perf_analyzer
(bench/perf_analyzer.py finds it: $PERF_ANALYZER or .venv-perf) when it is
installed, otherwise with tritonclient threads. Invalid requests (a wrong
shape, which the gateway rejects: a Triton failure with reason OTHER and gRPC
INVALID_ARGUMENT) are sent during the middle phase, so the error panels move
and settle again. deploy/smoke.py --render uses it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Concurrency per model: (first phase, step per phase); batches and queues grow
# with load. Linear, because that is what perf_analyzer's --concurrency-range does.
CONCURRENCY = {"simple": (2, 5), "mlp": (1, 6)}
PHASES = 3
BAD_REQUESTS_PER_S = 10.0


@dataclass
class LoadReport:
    tool: str
    # Counted by several threads without a lock: close enough for a summary line.
    ok: int = 0  # tritonclient requests only; perf_analyzer counts its own
    failed: int = 0
    end: float = 0.0  # when the last phase ended (before the clients stopped)

    def summary(self) -> str:
        own = "" if self.tool == "tritonclient" else " (its own requests not counted here)"
        return f"{self.tool}{own}: {self.ok} ok, {self.failed} failed or invalid requests"


def _simple_request(bad: bool = False):
    import numpy as np
    import tritonclient.grpc as grpcclient

    shape = [1, 3] if bad else [1, 16]  # [1, 3]: wrong shape, rejected by the gateway
    a = np.arange(shape[1], dtype=np.int32).reshape(shape)
    inputs = [grpcclient.InferInput(n, shape, "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs


def _mlp_request():
    import numpy as np
    import tritonclient.grpc as grpcclient

    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 256], "FP32")]
    inputs[0].set_data_from_numpy(x)
    return inputs


def _loop(url: str, stop: threading.Event, send: Callable, report: LoadReport) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        while not stop.is_set():
            try:
                send(client)
                report.ok += 1
            except Exception:  # noqa: BLE001 - counted; the dashboards show why
                report.failed += 1
    finally:
        client.close()


def _bad_loop(url: str, stop: threading.Event, report: LoadReport) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        while not stop.wait(1.0 / BAD_REQUESTS_PER_S):
            with contextlib.suppress(Exception):
                client.infer("simple", _simple_request(bad=True))
            report.failed += 1
    finally:
        client.close()


def concurrency(model: str, phase: int) -> int:
    first, step = CONCURRENCY[model]
    return first + phase * step


def _client_phase(url: str, phase: int, stop: threading.Event, report: LoadReport):
    senders = [lambda c: c.infer("simple", _simple_request())] * concurrency("simple", phase)
    senders += [lambda c: c.infer("mlp", _mlp_request())] * concurrency("mlp", phase)
    return [threading.Thread(target=_loop, args=(url, stop, s, report)) for s in senders]


def perf_analyzer_args(url: str, model: str, phase_s: float) -> list[str]:
    """One perf_analyzer run over every phase: three windows per concurrency level.

    -s 100 makes any three windows "stable", so each level lasts 3 x -p and
    perf_analyzer moves on to the next one without a pause."""
    first, step = CONCURRENCY[model]
    levels = f"{first}:{concurrency(model, PHASES - 1)}:{step}"
    window_ms = str(max(1000, int(phase_s * 1000 / 3)))
    args = ["-i", "grpc", "-u", url, "-m", model, "--concurrency-range", levels]
    return args + ["-p", window_ms, "-s", "100", "-r", "3"]


def _find_perf_analyzer():
    """bench/perf_analyzer.py's finder ($PERF_ANALYZER or .venv-perf), or None."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from bench.perf_analyzer import find_perf_analyzer
    except ImportError:
        return None
    return find_perf_analyzer()


def _perf_processes(url: str, phase_s: float) -> list[subprocess.Popen]:
    pa = _find_perf_analyzer()
    if pa is None:
        raise RuntimeError("perf_analyzer not found: run scripts/install_perf_analyzer.sh")
    procs = []
    for model in CONCURRENCY:
        procs.append(
            subprocess.Popen(
                pa.command(*perf_analyzer_args(url, model, phase_s)),
                env=pa.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def _stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """perf_analyzer ends on its own after the last level; stop stragglers."""
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait()


def pick_tool(tool: str = "auto") -> str:
    """perf_analyzer if asked for or (auto) installed, else tritonclient."""
    if tool != "auto":
        return tool
    return "perf_analyzer" if _find_perf_analyzer() is not None else "tritonclient"


def run_load(url: str, seconds: float = 60.0, tool: str = "auto") -> LoadReport:
    """Put PHASES of rising load on the gateway at `url` for `seconds` in all."""
    report = LoadReport(pick_tool(tool))
    phase_s = seconds / PHASES
    procs = _perf_processes(url, phase_s) if report.tool == "perf_analyzer" else []
    for phase in range(PHASES):
        stop = threading.Event()
        threads = [] if procs else _client_phase(url, phase, stop, report)
        if phase == PHASES // 2:
            threads.append(threading.Thread(target=_bad_loop, args=(url, stop, report)))
        for t in threads:
            t.start()
        levels = ", ".join(f"{m}={concurrency(m, phase)}" for m in CONCURRENCY)
        print(f"load: phase {phase + 1}/{PHASES}: concurrency {levels}")
        time.sleep(phase_s)
        report.end = time.time()
        stop.set()
        for t in threads:
            t.join(30)
    _stop_processes(procs, grace_s=10.0)
    return report
