"""A decoupled Python model's instance is free once execute() returns.

The model has ONE instance; its execute starts a thread per request that
sends the responses later (spaced in time, then the final flag) and returns
at once. Triton 2.51 then runs the next request's execute while the first
request's thread is still sending: a second client's response arrives before
the first request's final one. test_triton_does_the_same checks that against
real Triton when .venv-triton is installed and skips cleanly without it.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import ReferenceNotInstalled, _popen, find_triton, stop_process, wait_ready
from stageserve.examples import python_config_text, write_python_model
from stageserve.net import free_port
from tests.stack import running_stack

# IN = [n, gap_ms]: a thread sends n responses gap_ms apart, then the final
# flag alone; execute returns before the first one.
THREADED = """\
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _send(sender, n, gap_s):
    for i in range(n):
        time.sleep(gap_s)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            n, gap_ms = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist()
            sender = r.get_response_sender()
            threading.Thread(target=_send, args=(sender, n, gap_ms / 1000), daemon=True).start()
        return None
"""

MODEL = "py_threaded"
SLOW = [3, 400]  # responses at ~0.4, 0.8, 1.2 s, then the final


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    config = python_config_text(
        MODEL, [("IN", "INT32", (2,))], [("OUT", "INT32", (1,))], max_batch_size=0, decoupled=True
    )
    write_python_model(root, MODEL, THREADED, config)
    return root


class _Stream:
    """One client's stream; answers are (arrival time, value or None, final)."""

    def __init__(self, url: str) -> None:
        self.answers: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._got)

    def _got(self, result, error) -> None:
        if error is not None:
            self.answers.put((time.monotonic(), error.message(), True))
            return
        resp = result.get_response()
        value = int(result.as_numpy("OUT")[0]) if resp.outputs else None
        final = resp.parameters["triton_final_response"].bool_param
        self.answers.put((time.monotonic(), value, final))

    def send(self, values: list[int]) -> None:
        inp = grpcclient.InferInput("IN", [2], "INT32")
        inp.set_data_from_numpy(np.array(values, dtype=np.int32))
        self.client.async_stream_infer(MODEL, [inp], enable_empty_final_response=True)

    def until_final(self, timeout_s: float = 20.0) -> list[tuple[float, int | None, bool]]:
        out = []
        while not out or not out[-1][2]:
            out.append(self.answers.get(timeout=timeout_s))
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def overlap(url: str) -> tuple[list, list]:
    """Client A asks for SLOW responses; 0.1 s later client B asks for one."""
    a, b = _Stream(url), _Stream(url)
    try:
        a.send(SLOW)
        time.sleep(0.1)
        b.send([1, 0])
        return a.until_final(), b.until_final()
    finally:
        a.close()
        b.close()


def assert_overlaps(first: list, second: list) -> None:
    assert [(v, f) for _, v, f in first] == [(0, False), (1, False), (2, False), (None, True)]
    assert [(v, f) for _, v, f in second] == [(0, False), (None, True)]
    # The one instance took B's request while A's thread was still sending:
    # B is done before A's first response (~0.4 s), let alone A's final (~1.2 s).
    assert second[-1][0] < first[0][0]
    assert first[-1][0] - second[0][0] > 0.6


def test_instance_takes_the_next_request_once_execute_returned(repository: Path) -> None:
    with running_stack(repository) as stack:
        wait_ready(stack.url, [MODEL], 120)
        first, second = overlap(stack.url)
        assert_overlaps(first, second)


def test_triton_does_the_same(repository: Path, tmp_path: Path) -> None:
    try:
        install = find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    backends = install.make_backend_dir(tmp_path / "backends")
    port = free_port()
    url = f"127.0.0.1:{port}"
    log = tmp_path / "tritonserver.log"
    cmd = [
        str(install.binary),
        "--model-repository", str(repository),
        "--backend-directory", str(backends),
        "--grpc-port", str(port),
        "--grpc-address", "127.0.0.1",
        "--allow-http", "false",
        "--allow-metrics", "false",
        "--exit-timeout-secs", "5",
    ]  # fmt: skip
    proc = _popen(cmd, log, env=install.env(), cwd=tmp_path)
    try:
        wait_ready(url, [MODEL], 180, [proc], log)
        first, second = overlap(url)
        assert_overlaps(first, second)
    finally:
        stop_process(proc)
