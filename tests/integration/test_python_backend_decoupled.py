"""Decoupled Python models through tritonclient's stream: every response reaches
the client as the model sends it, with Triton's triton_final_response parameter
and enable_empty_final_response; errors and ModelInfer as Triton 2.51 answers."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import (
    ensemble_config,
    python_config_text,
    write_py_stream,
    write_python_model,
)
from tests.stack import RunningStack, running_stack

# IN = [n, mode]: mode 0 sends n responses then the final flag alone; mode 1
# sends the last response with the final flag; mode 2 raises; mode 3 returns a
# list (not allowed for decoupled models); mode 4 sends an error as final;
# mode 5 sends n responses and lets go of its sender without the final flag.
DECOUPLED = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            n, mode = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist()
            if mode == 2:
                raise ValueError("stream boom")
            if mode == 3:
                return [pb_utils.InferenceResponse([]) for _ in requests]
            sender = r.get_response_sender()
            if mode == 4:
                err = pb_utils.TritonError("stream error", pb_utils.TritonError.UNAVAILABLE)
                sender.send(pb_utils.InferenceResponse(error=err),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            for i in range(n):
                final = mode == 1 and i == n - 1
                sender.send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0,
                )
            if mode == 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.fixture(scope="module")
def dec_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("decoupled_repository")
    write_py_stream(root)
    write_python_model(
        root,
        "py_dec",
        DECOUPLED,
        python_config_text(
            "py_dec",
            [("IN", "INT32", (2,))],
            [("OUT", "INT32", (1,))],
            max_batch_size=0,
            decoupled=True,
        ),
    )
    steps = '  step [ { model_name: "py_dec" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Y" } } ]'  # noqa: E501
    (root / "ens_dec" / "1").mkdir(parents=True)
    (root / "ens_dec" / "config.pbtxt").write_text(
        ensemble_config(
            "ens_dec",
            steps,
            '{ name: "X" data_type: TYPE_INT32 dims: [ 2 ] }',
            '{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }',
            mbs=0,
        )
    )
    with running_stack(root) as s:
        yield s


def _stream(stack, model, requests, count, empty_final=False, timeout_s=20.0):
    """Send (id, [a, b]) requests on one stream; collect `count` answers with arrival times."""
    got: queue.Queue = queue.Queue()
    client = stack.client()
    client.start_stream(callback=lambda result, error: got.put((time.monotonic(), result, error)))
    try:
        for rid, values in requests:
            inp = grpcclient.InferInput("IN", [2], "INT32")
            inp.set_data_from_numpy(np.array(values, dtype=np.int32))
            client.async_stream_infer(
                model, [inp], request_id=rid, enable_empty_final_response=empty_final
            )
        return [got.get(timeout=timeout_s) for _ in range(count)]
    finally:
        client.stop_stream()
        client.close()


def _summary(answers):
    out = []
    for _, result, error in answers:
        if error is not None:
            out.append(("error", error.message()))
            continue
        resp = result.get_response()
        final = resp.parameters["triton_final_response"].bool_param
        value = int(result.as_numpy("OUT")[0]) if resp.outputs else None
        out.append((resp.id, value, final))
    return out


def test_responses_arrive_as_sent(dec_stack: RunningStack) -> None:
    """py_stream sends a response every 300 ms: the first reaches the client
    long before the model finishes."""
    answers = _stream(dec_stack, "py_stream", [("a", [3, 300])], 3)
    assert _summary(answers) == [("a", 0, False), ("a", 1, False), ("a", 2, False)]
    assert answers[-1][0] - answers[0][0] > 0.45
    with dec_stack.client() as c:  # the request's compute time spans its responses
        stats = c.get_inference_statistics("py_stream", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == 1
    assert int(stats["inference_stats"]["compute_infer"]["ns"]) > 500_000_000


def test_final_flag_and_empty_final_response(dec_stack: RunningStack) -> None:
    assert _summary(_stream(dec_stack, "py_dec", [("a", [2, 0])], 3, empty_final=True)) == [
        ("a", 0, False),
        ("a", 1, False),
        ("a", None, True),
    ]
    # The final flag with the last response: that response is marked final.
    assert _summary(_stream(dec_stack, "py_dec", [("b", [2, 1])], 2)) == [
        ("b", 0, False),
        ("b", 1, True),
    ]
    # Zero responses and no empty final: nothing comes back for "z" (the later
    # request on the same instance answers, and only it).
    answers = _stream(dec_stack, "py_dec", [("z", [0, 0]), ("c", [1, 1])], 1)
    assert _summary(answers) == [("c", 0, True)]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            2,
            "Failed to process the request(s) for model 'py_dec_0_0', message: "
            "ValueError: stream boom",
        ),
        (
            3,
            "Failed to process the request(s) for model 'py_dec_0_0', message: Python model "
            "'py_dec_0_0' is using the decoupled mode and the execute function must return None.",
        ),
        (4, "stream error"),
    ],
)
def test_errors_reach_the_stream_and_model_keeps_serving(dec_stack, mode, message) -> None:
    answers = _stream(dec_stack, "py_dec", [("e", [1, mode]), ("ok", [1, 1])], 2)
    assert sorted(_summary(answers), key=str) == sorted(
        [("error", message), ("ok", 0, True)], key=str
    )


def test_a_sender_released_without_its_final_ends_its_request(dec_stack) -> None:
    """Beyond Triton, which leaves that request open for ever: once nothing
    can send its final flag, the request ends INTERNAL; the model serves on."""
    answers = _stream(dec_stack, "py_dec", [("r", [1, 5]), ("ok", [1, 1])], 3, timeout_s=10)
    message = (
        "Failed to process the request(s) for model 'py_dec_0_0', message: the response "
        "sender was released without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL"
    )
    assert sorted(_summary(answers), key=str) == sorted(
        [("r", 0, False), ("error", message), ("ok", 0, True)], key=str
    )


def test_model_infer_on_decoupled_model_is_unimplemented(dec_stack: RunningStack) -> None:
    inp = grpcclient.InferInput("IN", [2], "INT32")
    inp.set_data_from_numpy(np.array([1, 1], dtype=np.int32))
    with dec_stack.client() as c, pytest.raises(InferenceServerException) as info:
        c.infer("py_dec", [inp])
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert info.value.message() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )


def test_decoupled_ensemble_step_is_refused(dec_stack: RunningStack) -> None:
    inp = grpcclient.InferInput("X", [2], "INT32")
    inp.set_data_from_numpy(np.array([1, 1], dtype=np.int32))
    with dec_stack.client() as c, pytest.raises(InferenceServerException) as info:
        c.infer("ens_dec", [inp])
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "decoupled" in info.value.message()
