"""Probe what a server does when a model fails to load at startup.

One repository: ``good`` (an identity ONNX model) and ``bad`` (its
``model.onnx`` is not an ONNX file). The server starts on it with
``--exit-on-error`` and ``--strict-readiness`` set one way or the other, in
``--model-control-mode none`` (everything loads) or ``explicit`` (both named
with ``--load-model``). :func:`probe` reports whether it exits (and how) or,
while it runs, what ServerLive / ServerReady / ModelReady answer on gRPC and
HTTP. The same probe runs ``stageserve up`` and the real Triton 2.51 (its
Python-backend twin of the ONNX model, bench/triton_model.py, loads the same
bytes and fails on the same corrupt file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.references import (
    BENCH_DIR,
    bench_model,
    find_triton,
    stageserve_config_text,
    stop_process,
    triton_config_text,
)
from stageserve.net import free_port
from stageserve_tools.examples import write_model

CORRUPT_ONNX = b"this is not an ONNX model\n"
MODELS = ("good", "bad")


@dataclass(frozen=True)
class Outcome:
    """What a server did: ``exit_code`` when it exited within the wait, else the
    answers of the running server (gRPC and HTTP agree, or ``probe`` fails)."""

    exit_code: int | None
    live: bool | None = None
    ready: bool | None = None
    good_ready: bool | None = None
    bad_ready: bool | None = None


def write_repository(root: Path, triton: bool) -> Path:
    model = bench_model("identity")
    for name in MODELS:
        text = triton_config_text(model) if triton else stageserve_config_text(model)
        text = text.replace('name: "identity"', f'name: "{name}"')
        onnx = model.onnx if name == "good" else CORRUPT_ONNX
        model_dir = write_model(root, name, onnx, text)
        if triton:
            (model_dir / "1" / "model.py").write_bytes((BENCH_DIR / "triton_model.py").read_bytes())
    return root


def flag_args(mode: str, exit_on_error: bool, strict: bool) -> list[str]:
    args = [
        "--model-control-mode", mode,
        "--exit-on-error", str(exit_on_error).lower(),
        "--strict-readiness", str(strict).lower(),
    ]  # fmt: skip
    if mode == "explicit":
        args += ["--load-model", "good", "--load-model", "bad"]
    return args


def _answers(grpc_url: str, http_url: str) -> Outcome | None:
    """The health answers once both fronts respond, else None."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    g = grpcclient.InferenceServerClient(grpc_url)
    h = httpclient.InferenceServerClient(http_url)
    try:
        both = []
        for client in (g, h):
            both.append(
                Outcome(
                    None,
                    client.is_server_live(),
                    client.is_server_ready(),
                    client.is_model_ready("good"),
                    client.is_model_ready("bad"),
                )
            )
    except (InferenceServerException, ConnectionError, OSError):
        return None
    finally:
        g.close()
        h.close()
    assert both[0] == both[1], f"gRPC answers {both[0]}, HTTP answers {both[1]}"
    return both[0]


def _collect(stream: IO[str] | None, into: list[str]) -> threading.Thread:
    """Read a pipe to its end in a thread (a full pipe would block the server)."""
    assert stream is not None
    thread = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    thread.start()
    return thread


def _watch(
    proc: subprocess.Popen,
    grpc_url: str,
    http_url: str,
    timeout_s: float,
    started: Callable[[], bool] = lambda: True,
) -> Outcome:
    """Wait for the process to exit or its fronts to answer, once `started`
    says its startup is over (Triton opens its fronts only after its startup
    loads, so there the first answers count)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return Outcome(code)
        answers = _answers(grpc_url, http_url) if started() else None
        if answers is not None:
            time.sleep(1.0)  # a server about to exit would have done so by now
            code = proc.poll()
            return Outcome(code) if code is not None else answers
        time.sleep(0.2)
    raise TimeoutError(f"no answer and no exit within {timeout_s:.0f}s")


def probe_triton(workdir: Path, mode: str, exit_on_error: bool, strict: bool) -> Outcome:
    install = find_triton()
    repo = workdir / "triton_repo"
    if not repo.exists():
        write_repository(repo, triton=True)
    grpc_port, http_port = free_port(), free_port()
    cmd = [
        str(install.binary),
        "--model-repository", str(repo),
        "--backend-directory", str(install.make_backend_dir(workdir / "triton_backends")),
        "--grpc-port", str(grpc_port), "--grpc-address", "127.0.0.1",
        "--http-port", str(http_port), "--http-address", "127.0.0.1",
        "--allow-metrics", "false",
        "--disable-auto-complete-config",
        "--exit-timeout-secs", "5",
        *flag_args(mode, exit_on_error, strict),
    ]  # fmt: skip
    log = (workdir / f"triton-{mode}-{exit_on_error}-{strict}.log").open("wb")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=install.env(),
        cwd=workdir,
        start_new_session=True,
    )
    try:
        return _watch(proc, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", 180)
    finally:
        stop_process(proc)
        log.close()


def probe_stageserve(
    workdir: Path, mode: str, exit_on_error: bool, strict: bool
) -> tuple[Outcome, list[dict[str, str]]]:
    """The outcome, and `stageserve up`'s startup summary lines (stdout when it
    serves, stderr when it exits)."""
    repo = workdir / "stageserve_repo"
    if not repo.exists():
        write_repository(repo, triton=False)
    grpc_port, http_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "stageserve.cli", "up",
        "--model-repository", str(repo),
        "--grpc-port", str(grpc_port), "--grpc-address", "127.0.0.1",
        "--http-port", str(http_port), "--http-address", "127.0.0.1",
        "--metrics-port", str(free_port()),
        "--device", "cpu",
        *flag_args(mode, exit_on_error, strict),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
        start_new_session=True,
    )
    out: list[str] = []
    err: list[str] = []
    readers = [_collect(proc.stdout, out), _collect(proc.stderr, err)]
    try:
        outcome = _watch(
            proc,
            f"127.0.0.1:{grpc_port}",
            f"127.0.0.1:{http_port}",
            180,
            started=lambda: any('"stageserve up"' in line for line in out),
        )
    finally:
        stop_process(proc)
        for reader in readers:
            reader.join(10)
    return outcome, [e for e in map(_event, (*out, *err)) if e.get("event") == "model not loaded"]


def _event(line: str) -> dict[str, str]:
    try:
        parsed = json.loads(line)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


if __name__ == "__main__":  # record Triton's table: python -m tests.integration.startup_flags
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "explicit"):
            for exit_on_error in (True, False):
                for strict in (True, False):
                    got = probe_triton(Path(tmp), mode, exit_on_error, strict)
                    print(f"({mode!r}, {exit_on_error}, {strict}): {got},", flush=True)
