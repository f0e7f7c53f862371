"""`stageserve up --workers auto --workers-per-device N`: N worker processes on
each GPU, or on the one device without a GPU; both serve the model's
instances. With an explicit --workers count the flag is refused (exit 2)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from stageserve_tools.examples import python_config_text, write_python_model
from tests.integration.up_process import UpProcess

#: Answers the pid of the process that executes it (the worker's Python
#: instance), after a pause long enough that concurrent requests overlap.
PID_SOURCE = """\
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)
        pid = np.array([os.getpid()], dtype=np.int64)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]) for _ in requests
        ]
"""


def test_explicit_worker_count_with_per_device_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stageserve.cli", "up", "--model-repository", str(tmp_path),
         "--workers", "2", "--workers-per-device", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--workers-per-device needs --workers auto" in done.stderr


def test_two_workers_on_the_one_device_both_serve(tmp_path: Path) -> None:
    config = python_config_text(
        "pid", [("X", "INT64", (1,))], [("PID", "INT64", (1,))], max_batch_size=0
    )
    write_python_model(tmp_path, "pid", PID_SOURCE, config)
    with UpProcess(tmp_path, ["--workers", "auto", "--workers-per-device", "2"]) as running:
        info = running.wait(180)
        assert info is not None, "".join(running.err[-40:])
        workers = sorted(name for name in info["pids"] if name.startswith("worker"))
        assert workers == ["worker-0", "worker-1"]

        def one(_: int) -> int:
            with grpcclient.InferenceServerClient(running.grpc_url()) as client:
                x = grpcclient.InferInput("X", [1], "INT64")
                x.set_data_from_numpy(np.zeros(1, dtype=np.int64))
                out = client.infer("pid", [x], client_timeout=30).as_numpy("PID")
                assert out is not None
                return int(out[0])

        # Both workers registered an instance: concurrent requests land on both.
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        with ThreadPoolExecutor(8) as pool:
            while len(seen) < 2 and time.monotonic() < deadline:
                seen |= set(pool.map(one, range(16)))
        assert len(seen) == 2, f"one instance served every request: {seen}"
