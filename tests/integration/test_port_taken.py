"""A port that another process holds: `stageserve up` ends as tritonserver 2.51 does.

Triton, with its gRPC, HTTP or metrics port taken, logs one line (`failed to
start HTTP service: Unavailable - Socket '0.0.0.0:8000' already in use`) and
exits 1. `stageserve up` gives the same line (the gateway's log, and the
launcher's "startup failed" event, which names the stage) and exit code, and
no Python traceback. Both servers run here against a port held by this test.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.references import find_triton, stop_process
from stageserve.net import free_port
from tests.integration.up_process import UpProcess, json_line

FRONTS = {"GRPC": "--grpc-port", "HTTP": "--http-port", "Metrics": "--metrics-port"}
TRITON_LINE = re.compile(
    r"failed to start (\w+) service: Unavailable - Socket '[^']+' already in use"
)
# A five-process start on the shared 2-core machine; Triton's takes ~2 s.
EXIT_BOUND_S = 120.0


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on every interface that this test listens on (so nobody else can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _triton(repo: Path, workdir: Path, flag: str, port: int) -> tuple[int, str]:
    install = find_triton()
    ports = {f: str(free_port()) for f in FRONTS.values()}
    ports[flag] = str(port)
    cmd = [
        str(install.binary),
        "--model-repository", str(repo),
        "--backend-directory", str(install.make_backend_dir(workdir / "backends")),
        *(arg for f, p in ports.items() for arg in (f, p)),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=install.env(),
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=EXIT_BOUND_S)
    finally:
        stop_process(proc)
    return proc.returncode, out


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_taken_port_exits_1_with_tritons_line(front: str, held_port: int, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    flag = FRONTS[front]
    triton_code, triton_out = _triton(repo, tmp_path, flag, held_port)
    assert triton_code == 1, triton_out[-2000:]
    assert [m.group(1) for m in TRITON_LINE.finditer(triton_out)] == [front], triton_out[-2000:]

    with UpProcess(repo, [flag, str(held_port)]) as up:
        try:
            served = up.wait(EXIT_BOUND_S)
        except TimeoutError as exc:
            pytest.fail(f"{exc}; its log:\n" + "".join((up.out + up.err)[-60:]))
        assert served is None, "stageserve up served on a port it cannot hold"
        assert up.proc.returncode == 1
    output = "".join(up.out + up.err)
    assert "Traceback" not in output, output[-4000:]
    logged = [json_line(line).get("msg", "") for line in up.err]
    assert [m.group(1) for m in map(TRITON_LINE.search, logged) if m] == [front], output[-4000:]
    (failed,) = up.events("startup failed", "err")
    assert failed["error"].startswith("gateway did not become ready (exit code 1): ")
    assert str(held_port) in failed["error"] and TRITON_LINE.search(failed["error"])
