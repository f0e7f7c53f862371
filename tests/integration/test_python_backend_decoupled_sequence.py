"""A decoupled Python model under the sequence batcher (a streaming model that
keeps per-sequence state, as streaming ASR or a token generator does): each
request's responses reach the stream as the model sends them, the sequence's
requests run in order, and a sequence ends with its END request, as real
Triton 2.51 answers the same model.py and the same calls.

EXPECTED was recorded from Triton 2.51; test_triton_gives_the_same runs the
calls against Triton again when .venv-triton is installed (about 15 s) and
skips cleanly without it.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from tests.integration.helpers import triton_grpc
from tests.integration.test_python_backend_sequence import sequence_config
from tests.stack import running_stack

# Per sequence, a running sum of IN kept by the model (keyed by correlation
# id). Each request gets one response per unit of IN (the sum so far, then
# the count of responses sent), then the final flag alone; IN < 0 answers an
# error as the final response.
MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            ready = int(pb_utils.get_input_tensor_by_name(r, "READY").as_numpy().reshape(-1)[0])
            if not ready:  # a padding row: nobody waits for it
                continue
            x = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)[0])
            corr = r.correlation_id()
            if x < 0:
                err = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=err),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            total = self.sums.get(corr, 0) + x
            self.sums[corr] = total
            for i in range(x):
                out = np.array([[total, i]], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
            if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                self.sums.pop(corr, None)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

MODELS = {"dseq_direct": "direct", "dseq_oldest": "oldest"}


def _config(name: str, strategy: str) -> str:
    return sequence_config(
        name, strategy, out_dims=2, extra="model_transaction_policy { decoupled: true }\n"
    )


def write_repository(root: Path) -> Path:
    for name, strategy in MODELS.items():
        version = root / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(MODEL)
        (root / name / "config.pbtxt").write_text(_config(name, strategy))
    return root


# (IN, correlation id, start, end), one call at a time, interleaving two
# sequences, so the answers do not depend on timing.
CALLS = [
    (2, 11, True, False),
    (1, 12, True, False),
    (3, 11, False, False),
    (0, 12, False, False),  # no response, only the final flag
    (-1, 11, False, False),  # an error as the final response; the sequence goes on
    (1, 11, False, True),
    (2, 12, False, True),
    (1, 11, True, True),  # 11 again: a new sequence, its sum starts at zero
]

# What each call's stream brought: ("out", [sum, i], final) for a response,
# ("final",) for the empty final response, ("error", message) for an error.
EXPECTED = [
    [("out", [2, 0], False), ("out", [2, 1], False), ("final",)],
    [("out", [1, 0], False), ("final",)],
    [("out", [5, 0], False), ("out", [5, 1], False), ("out", [5, 2], False), ("final",)],
    [("final",)],
    [("error", "negative input")],
    [("out", [6, 0], False), ("final",)],
    [("out", [3, 0], False), ("out", [3, 1], False), ("final",)],
    [("out", [1, 0], False), ("final",)],
]


class SequenceStream:
    """One client stream; `send` runs one request and returns what came back:
    ("out", [sum, i], final) per response, ("final",) for the empty final
    response, ("error", message) for an error."""

    def __init__(self, url: str) -> None:
        self.answers: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))

    def send(self, model: str, value: int, sid: int, start: bool, end: bool) -> list[tuple]:
        inp = grpcclient.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], np.int32))
        self.client.async_stream_infer(
            model, [inp], sequence_id=sid, sequence_start=start, sequence_end=end,
            enable_empty_final_response=True,
        )  # fmt: skip
        got: list[tuple] = []
        while True:
            result, error = self.answers.get(timeout=30)
            if error is not None:
                return [*got, ("error", error.message())]
            final = result.get_response().parameters["triton_final_response"].bool_param
            out = result.as_numpy("OUT")
            got.append(("final",) if out is None else ("out", out.reshape(-1).tolist(), final))
            if final:
                return got

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def run_calls(url: str, model: str) -> list[list[tuple]]:
    stream = SequenceStream(url)
    try:
        return [stream.send(model, *call) for call in CALLS]
    finally:
        stream.close()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("decoupled_sequence") / "repo")


@pytest.fixture(scope="module")
def stack_url(repository: Path) -> Iterator[str]:
    with running_stack(repository) as stack:
        wait_ready(stack.url, list(MODELS), 120)
        yield stack.url


def test_stageserve_streams_a_decoupled_sequence_model(stack_url: str) -> None:
    for model in MODELS:
        assert run_calls(stack_url, model) == EXPECTED, model


def _one_sequence(url: str, model: str, sid: int, values: list[int]) -> list[list[tuple]]:
    """One client stream running one whole sequence."""
    stream = SequenceStream(url)
    try:
        last = len(values) - 1
        return [stream.send(model, v, sid, n == 0, n == last) for n, v in enumerate(values)]
    finally:
        stream.close()


def test_concurrent_sequences_keep_their_own_order_and_state(stack_url: str) -> None:
    """Eight sequences at once, batched together: each request's responses
    carry its own sequence's running sum, in order."""
    values = [1, 2, 3, 2, 1]
    sums = [sum(values[: i + 1]) for i in range(len(values))]
    expected = [
        [*(("out", [total, i], False) for i in range(v)), ("final",)]
        for v, total in zip(values, sums, strict=True)
    ]
    with ThreadPoolExecutor(8) as pool:
        for model in MODELS:
            runs = [pool.submit(_one_sequence, stack_url, model, 100 + k, values) for k in range(8)]
            for run in runs:
                assert run.result() == expected, model


def test_triton_gives_the_same(repository: Path, tmp_path: Path) -> None:
    with triton_grpc(repository, tmp_path, list(MODELS)) as url:
        for model in MODELS:
            assert run_calls(url, model) == EXPECTED, model
