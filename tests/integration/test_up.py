"""`stageserve up`: the one command that starts everything, and stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from stageserve.net import free_port
from stageserve.service_runtime import EXIT_BACKSTOP_S, SHUTDOWN_SLACK_S
from tests.procs import alive

#: The longest a stage may live after its SIGTERM: its gRPC grace (5 s), the
#: watchdog's slack, the alarm's backstop (service_runtime), plus 5 s for a
#: loaded machine to schedule the exit.
STAGE_EXIT_BOUND_S = 5 + SHUTDOWN_SLACK_S + 1 + EXIT_BACKSTOP_S + 5


def _start_up(repository: Path, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, dict]:
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stageserve.cli",
            "up",
            "--model-repository",
            str(repository),
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{") and '"stageserve up"' in line:
            return proc, json.loads(line)
    proc.kill()
    pytest.fail("stageserve up did not report its services")


def _infer_simple(address: str) -> None:
    client = grpcclient.InferenceServerClient(address)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)


def test_up_serves_and_ctrl_c_stops_every_process(example_repository: Path) -> None:
    proc, info = _start_up(example_repository)
    try:
        pids = info["pids"]
        assert set(pids) >= {"redis", "ratelimiter", "worker-0", "scheduler", "gateway"}
        assert len(set(pids.values())) == len(pids)  # each stage its own process
        port = info["grpc"].rsplit(":", 1)[1]
        _infer_simple(f"127.0.0.1:{port}")
        http_port = info["http"].rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready") as ready:
            assert ready.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_launcher_leaves_no_orphans(example_repository: Path, tmp_path: Path) -> None:
    stderr_path = tmp_path / "stderr.log"  # the children write theirs here too
    with stderr_path.open("w") as stderr:
        proc, info = _start_up(example_repository, stderr)
    pids = info["pids"]
    proc.kill()  # SIGKILL: no chance to clean up; children die with it
    proc.wait(10)
    deadline = time.monotonic() + STAGE_EXIT_BOUND_S
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    leftover = [n for n, p in pids.items() if alive(p)]
    for name in leftover:  # where is it stuck? (service_runtime: SIGUSR1 dumps stacks)
        os.kill(pids[name], signal.SIGUSR1)
    time.sleep(1 if leftover else 0)
    for name in leftover:  # never leave them running, even when failing
        os.kill(pids[name], signal.SIGKILL)
    log = stderr_path.read_text()
    assert not leftover, log[-20000:]
    if "Timeout (" in log:
        # The shutdown watchdog (service_runtime.SHUTDOWN_SLACK_S) ended a
        # stage whose teardown hung: no orphan, so no failure, but its stack
        # dump names where it hung; it lands in the warnings summary.
        stacks = log[log.index("Timeout (") :][:20000]
        warnings.warn(f"a stage needed the shutdown watchdog:\n{stacks}", stacklevel=1)
