"""A decoupled Python model's instance is free once execute() returns.

The model has ONE instance; its execute starts a thread per request that
sends the responses later (spaced in time, then the final flag) and returns
at once. Triton 2.51 then runs the next request's execute while the first
request's thread is still sending: a second client's response arrives before
the first request's final one. The same scenarios run against real Triton
(`triton` fixture) when .venv-triton is installed and skip cleanly without it.

With that overlap, what happens to a request after its execute returned must
still end it exactly once: an error its thread sends, execute raising after it
started a thread, the worker dying, the model being unloaded.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from stageserve_tools.examples import python_config_text, write_python_model
from tests.integration.helpers import (
    registered_instances,
    skip_if_triton_crashed,
    triton_grpc,
    worker_id,
)
from tests.stack import running_stack, wait_until

# IN = [n, gap_ms]: a thread sends n responses gap_ms apart, then the final
# flag alone; execute returns before the first one. n = -1: after gap_ms the
# thread sends an error as the final response. n = -2: execute raises right
# after starting a thread that would send one response and the final flag.
# A response sent after finalize() carries -9 instead of its number.
THREADED = """\
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FINALIZED = threading.Event()


def _send(sender, n, gap_s):
    try:
        if n == -1:
            time.sleep(gap_s)
            err = pb_utils.TritonError("late error", pb_utils.TritonError.UNAVAILABLE)
            sender.send(pb_utils.InferenceResponse(error=err), flags=FINAL)
            return
        for i in range(1 if n == -2 else n):
            time.sleep(gap_s)
            out = np.array([-9 if FINALIZED.is_set() else i], np.int32)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        sender.send(flags=FINAL)
    except Exception:  # a sender closed by the server: nothing left to say
        pass


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "finalized")

    def finalize(self):
        FINALIZED.set()
        open(self.marker, "w").close()

    def execute(self, requests):
        for r in requests:
            n, gap_ms = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist()
            sender = r.get_response_sender()
            threading.Thread(target=_send, args=(sender, n, gap_ms / 1000), daemon=True).start()
            if n == -2:
                raise ValueError("raised after starting a sender")
        return None
"""

MODEL = "py_threaded"
SLOW = [3, 600]  # responses at ~0.6, 1.2, 1.8 s, then the final
SLOW_ANSWERS = [(0, False), (1, False), (2, False), (None, True)]
RAISED = (
    "Failed to process the request(s) for model 'py_threaded_0_0', message: "
    "ValueError: raised after starting a sender"
)


def write_repository(root: Path) -> Path:
    config = python_config_text(
        MODEL, [("IN", "INT32", (2,))], [("OUT", "INT32", (1,))], max_batch_size=0, decoupled=True
    )
    write_python_model(root, MODEL, THREADED, config)
    return root


@pytest.fixture(scope="module", params=["stageserve", "triton"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The gRPC address of StageServe, then of real Triton, on the same model."""
    root = write_repository(tmp_path_factory.mktemp("repo"))
    if request.param == "triton":
        with triton_grpc(root, tmp_path_factory.mktemp("triton"), [MODEL]) as url:
            yield url
        return
    with running_stack(root) as stack:
        wait_ready(stack.url, [MODEL], 120)
        yield stack.url


class _Stream:
    """One client's stream; answers are (arrival time, value or error message, final)."""

    def __init__(self, url: str) -> None:
        self.answers: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._got)

    def _got(self, result, error) -> None:
        if error is not None:  # an error ends its request (Triton's final flag)
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

    def until_final(self, timeout_s: float = 20.0) -> list[tuple[float, int | str | None, bool]]:
        out: list[tuple[float, int | str | None, bool]] = []
        while not out or not out[-1][2]:
            out.append(self.answers.get(timeout=timeout_s))
        return out

    def nothing_more(self, wait_s: float = 0.6) -> bool:
        with contextlib.suppress(queue.Empty):
            self.answers.get(timeout=wait_s)
            return False
        return True

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def overlap(url: str, first_values: list[int]) -> tuple[list, list]:
    """Client A sends first_values; 0.1 s later client B asks for one response."""
    with skip_if_triton_crashed(url):
        a, b = _Stream(url), _Stream(url)
        try:
            a.send(first_values)
            time.sleep(0.1)
            b.send([1, 0])
            first, second = a.until_final(), b.until_final()
            assert a.nothing_more(), "a second final answer"
            return first, second
        finally:
            a.close()
            b.close()


def _values(answers: list) -> list:
    return [(v, f) for _, v, f in answers]


def test_instance_takes_the_next_request_once_execute_returned(server: str) -> None:
    first, second = overlap(server, SLOW)
    assert _values(first) == SLOW_ANSWERS
    assert _values(second) == [(0, False), (None, True)]
    # The one instance took B's request while A's thread was still sending:
    # B is done before A's first response (~0.6 s), let alone A's final (~1.8 s).
    assert second[-1][0] < first[0][0]
    assert first[-1][0] - second[0][0] > 0.6


def test_error_sent_after_execute_returned_ends_the_request(server: str) -> None:
    first, second = overlap(server, [-1, 600])
    assert _values(first) == [("late error", True)]
    assert _values(second) == [(0, False), (None, True)]
    assert second[-1][0] < first[0][0]


def test_execute_raising_after_starting_a_sender_answers_once(server: str) -> None:
    """The request fails with execute's exception; what its thread sends
    afterwards reaches nobody (overlap() checks nothing follows the final)."""
    first, second = overlap(server, [-2, 300])
    assert len(first) == 1
    assert first[0][1].startswith(RAISED)  # Triton appends the traceback's location
    assert _values(second) == [(0, False), (None, True)]


def test_worker_killed_while_senders_send(tmp_path: Path) -> None:
    """The grant went back when execute returned; the worker then dies mid-stream:
    the open request gets one error final, and a new worker serves the next."""
    root = write_repository(tmp_path / "repo")
    with running_stack(root) as stack:
        wait_ready(stack.url, [MODEL], 120)
        a = _Stream(stack.url)
        try:
            a.send(SLOW)
            got = [a.answers.get(timeout=20)]
            assert got[0][1:] == (0, False)
            stack.workers[0].proc.kill()
            stack.workers[0].proc.wait(10)
            got += a.until_final()
            assert len(got) == 2, got
            assert "worker" in got[1][1] and "failed" in got[1][1], got
            assert a.nothing_more()
        finally:
            a.close()
        fresh = worker_id(stack.start_worker().proc.pid)
        assert wait_until(
            lambda: (
                {i.split("/")[0] for i in registered_instances(stack.redis_url, MODEL)} == {fresh}
            ),
            timeout_s=60,
        )
        first, second = overlap(stack.url, [2, 100])
        assert _values(first) == [(0, False), (1, False), (None, True)]
        assert _values(second) == [(0, False), (None, True)]


@contextlib.contextmanager
def explicit_server(kind: str, tmp_path: Path) -> Iterator[str]:
    """StageServe or Triton with explicit model control, the model loaded."""
    root = write_repository(tmp_path / "repo")
    if kind == "triton":
        extra = ("--model-control-mode", "explicit", "--load-model", MODEL)
        with triton_grpc(root, tmp_path, [MODEL], *extra) as url:
            yield url
        return
    with running_stack(root, control_mode="explicit", load_models=(MODEL,)) as stack:
        wait_ready(stack.url, [MODEL], 120)
        yield stack.url


@pytest.mark.parametrize("action", ["unload", "reload"])
@pytest.mark.parametrize("kind", ["stageserve", "triton"])
def test_unload_waits_for_senders(kind: str, action: str, tmp_path: Path) -> None:
    """Unloading (or reloading: new files) the model while a request's thread
    still sends: the request gets every response (none sent after the old
    instance's finalize, which would carry -9) and its final, then the old
    instance is finalized. StageServe's gateway drains a model's requests
    before an unload; a reload does not, the worker waits for the batch."""
    with explicit_server(kind, tmp_path) as url, grpcclient.InferenceServerClient(url) as c:
        a = _Stream(url)
        try:
            a.send(SLOW)
            got = [a.answers.get(timeout=20)]
            if action == "reload":
                model_py = tmp_path / "repo" / MODEL / "1" / "model.py"
                model_py.write_text(model_py.read_text() + "# reloaded\n")
                c.load_model(MODEL)
            else:
                c.unload_model(MODEL)
            got += a.until_final()
            assert _values(got) == SLOW_ANSWERS
        finally:
            a.close()
        marker = tmp_path / "repo" / MODEL / "finalized"
        assert wait_until(marker.exists, timeout_s=20)
