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

The fronts are asked only once the server said it opened them (Triton's
"Started ..." log lines, `stageserve up`'s announce line), which both do only
after their startup load decided: their first answers are final. Triton's
ports are chosen before it starts and bound only after its models load, so
another process on the machine can take one meanwhile; Triton then exits 1
("already in use"), which says nothing about the flags: the cell runs again
on fresh ports. `stageserve up` binds port 0 and announces what it got.
"""

from __future__ import annotations

import functools
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.references import (
    BENCH_DIR,
    TRITON_SELF_ABORT,
    bench_model,
    find_triton,
    stageserve_config_text,
    stop_process,
    triton_config_text,
)
from stageserve.net import free_port
from stageserve_tools.examples import write_model
from tests.integration.up_process import UpProcess

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


def write_probe_model(root: Path, name: str, triton: bool, corrupt: bool) -> Path:
    """An identity ONNX model named `name` (its model.onnx not ONNX when
    `corrupt`); for Triton with the Python-backend model.py that runs it."""
    model = bench_model("identity")
    text = triton_config_text(model) if triton else stageserve_config_text(model)
    text = text.replace('name: "identity"', f'name: "{name}"')
    model_dir = write_model(root, name, CORRUPT_ONNX if corrupt else model.onnx, text)
    if triton:
        (model_dir / "1" / "model.py").write_bytes((BENCH_DIR / "triton_model.py").read_bytes())
    return model_dir


def write_repository(root: Path, triton: bool) -> Path:
    for name in MODELS:
        write_probe_model(root, name, triton, corrupt=name == "bad")
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


def _watch(
    proc: subprocess.Popen, fronts: Callable[[], tuple[str, str] | None], timeout_s: float
) -> Outcome:
    """Wait for the process to exit, or for `fronts` to give its (gRPC, HTTP)
    addresses (once the server said it opened them) and for them to answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return Outcome(code)
        urls = fronts()
        answers = _answers(*urls) if urls is not None else None
        if answers is not None:
            return answers
        time.sleep(0.2)
    raise TimeoutError(f"no answer and no exit within {timeout_s:.0f}s")


_TRITON_FRONT = re.compile(r"Started (GRPCInferenceService|HTTPService) at (\S+?)\"")
PORT_TAKEN = "already in use"
PORT_TRIES = 3


def _triton_fronts(log: Path) -> tuple[str, str] | None:
    """The addresses Triton logged it serves on, once it logged both."""
    started = dict(_TRITON_FRONT.findall(log.read_text(errors="replace")))
    if "GRPCInferenceService" in started and "HTTPService" in started:
        return started["GRPCInferenceService"], started["HTTPService"]
    return None


def probe_triton(
    workdir: Path, mode: str, exit_on_error: bool, strict: bool
) -> tuple[Outcome, Path]:
    """Triton's outcome, and its log."""
    install = find_triton()
    repo = workdir / "triton_repo"
    if not repo.exists():
        write_repository(repo, triton=True)
    for attempt in range(1, PORT_TRIES + 1):
        cmd = [
            str(install.binary),
            "--model-repository", str(repo),
            "--backend-directory", str(install.make_backend_dir(workdir / "triton_backends")),
            "--grpc-port", str(free_port()), "--grpc-address", "127.0.0.1",
            "--http-port", str(free_port()), "--http-address", "127.0.0.1",
            "--allow-metrics", "false",
            "--disable-auto-complete-config",
            "--exit-timeout-secs", "5",
            *flag_args(mode, exit_on_error, strict),
        ]  # fmt: skip
        log_path = workdir / f"triton-{mode}-{exit_on_error}-{strict}-{attempt}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=install.env(),
                cwd=workdir,
                start_new_session=True,
            )
            try:
                outcome = _watch(proc, functools.partial(_triton_fronts, log_path), 180)
            finally:
                stop_process(proc)
        text = log_path.read_text(errors="replace")
        if outcome.exit_code is None or (PORT_TAKEN not in text and TRITON_SELF_ABORT not in text):
            return outcome, log_path
    return outcome, log_path


def probe_stageserve(
    workdir: Path, mode: str, exit_on_error: bool, strict: bool
) -> tuple[Outcome, list[dict[str, str]]]:
    """The outcome, and `stageserve up`'s startup summary lines (stdout when it
    serves, stderr when it exits)."""
    repo = workdir / "stageserve_repo"
    if not repo.exists():
        write_repository(repo, triton=False)

    def fronts() -> tuple[str, str] | None:
        info = up.info()
        return None if info is None else (info["grpc"], info["http"])

    with UpProcess(repo, flag_args(mode, exit_on_error, strict)) as up:
        outcome = _watch(up.proc, fronts, 180)
    return outcome, up.events("model not loaded")


if __name__ == "__main__":  # record Triton's table: python -m tests.integration.startup_flags
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "explicit"):
            for exit_on_error in (True, False):
                for strict in (True, False):
                    got, _ = probe_triton(Path(tmp), mode, exit_on_error, strict)
                    print(f"({mode!r}, {exit_on_error}, {strict}): {got},", flush=True)
