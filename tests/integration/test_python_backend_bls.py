"""BLS through tritonclient: a model.py calls other models with
pb_utils.InferenceRequest(...).exec() / async_exec(), through the scheduler
(so the target's dynamic batching applies), errors as response.has_error()."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import (
    TensorSpec,
    mlp_reference,
    mlp_weights,
    python_config_text,
    write_mlp,
    write_py_bls,
    write_python_model,
)
from tests.stack import RunningStack, running_stack, wait_until


class TensorIO(TypedDict):
    """The inputs= and outputs= of a config_text call."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


# The batched target: OUT = IN * 3, N = how many requests its execute() got.
COUNT = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.02)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            n = np.full((x.shape[0], 1), len(requests), dtype=np.int32)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * 3), pb_utils.Tensor("N", n)]))
        return out
"""

# The caller: sends IN to the model named by the request parameter "target"
# (sync exec, or async_exec when the parameter "async" is set) and returns the
# answer, or the BLS error as its own response error.
CALLER = """\
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            bls = pb_utils.InferenceRequest(
                model_name=params["target"],
                requested_output_names=["OUT", "N"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")],
            )
            answer = await bls.async_exec() if params.get("async") else bls.exec()
            if answer.has_error():
                out.append(pb_utils.InferenceResponse(error=answer.error()))
            else:
                out.append(pb_utils.InferenceResponse(answer.output_tensors()))
        return out
"""


# A decoupled target: OUT = IN * k for k = 1, 2, 3, then the final flag alone.
GENERATOR = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            for k in (1, 2, 3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * k)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Collects the generator's responses with exec(decoupled=True): OUT = their
# outputs stacked, N = how many responses (the empty final one included).
# Without the "decoupled" parameter it calls exec() and returns the error.
GEN_CALLER = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            bls = pb_utils.InferenceRequest(
                model_name="py_gen", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")])
            if not json.loads(r.parameters()).get("decoupled"):
                out.append(pb_utils.InferenceResponse(error=bls.exec().error()))
                continue
            responses = list(bls.exec(decoupled=True))
            parts = [pb_utils.get_output_tensor_by_name(x, "OUT").as_numpy()
                     for x in responses if x.output_tensors()]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.stack(parts)),
                pb_utils.Tensor("N", np.array([len(responses)], np.int32))]))
        return out
"""

# The time its execute began (time.monotonic(): one clock for every process).
# T: when it ran (time.monotonic(), one clock for every process); a file in
# MARKS (set when the model is written) for each request, after the stamp.
STAMP = """\
import pathlib
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        now = time.monotonic()
        for _ in requests:
            pathlib.Path(MARKS, uuid.uuid4().hex).touch()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("T", np.array([now]))])
                for _ in requests]
"""

# async_exec() as in Triton 2.51: sends py_stamp two requests and py_gen a
# decoupled one, blocks its loop (no await) until py_stamp has run both (its
# files in MARKS; at most 10 s), then awaits the three with asyncio.wait.
# T: when py_stamp ran them, relative to when the caller began to await
# (< 0: before); OUT: py_gen's outputs. Waiting on py_stamp's files, not for
# a fixed time, keeps the test independent of how fast a loaded machine runs
# them; if async_exec sent only when awaited, the wait would time out first.
ASYNC_CALLER = """\
import asyncio
import pathlib
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        marks = pathlib.Path(MARKS)
        before = len(list(marks.iterdir()))
        stamps = [pb_utils.InferenceRequest(model_name="py_stamp", requested_output_names=["T"],
                                            inputs=[x]).async_exec() for _ in range(2)]
        gen = pb_utils.InferenceRequest(model_name="py_gen", requested_output_names=["OUT"],
                                        inputs=[x]).async_exec(decoupled=True)
        deadline = time.monotonic() + 10
        while len(list(marks.iterdir())) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # no await: only requests already sent can run
        awaiting = time.monotonic()
        done, pending = await asyncio.wait([*stamps, gen])
        answers = await asyncio.gather(*stamps)
        assert all(isinstance(a, pb_utils.InferenceResponse) for a in answers), answers
        responses = gen.result()
        assert type(responses).__name__ == "ResponseIterator", type(responses)
        parts = [o.as_numpy() for r in responses for o in r.output_tensors()]
        stamped = [pb_utils.get_output_tensor_by_name(a, "T").as_numpy()[0] for a in answers]
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("T", np.array(stamped) - awaiting),
            pb_utils.Tensor("OUT", np.stack(parts))])]
"""
STUB = '\nparameters { key: "STAGESERVE_INSTANCE_PROCESS" value { string_value: "true" } }\n'


@pytest.fixture(scope="module")
def bls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("bls_repository")
    io = TensorIO(
        inputs=[("IN", "FP32", (4,))],
        outputs=[("OUT", "FP32", (4,)), ("N", "INT32", (1,))],
    )
    write_python_model(
        root,
        "py_count",
        COUNT,
        python_config_text("py_count", **io, max_batch_size=16)
        + "dynamic_batching { max_queue_delay_microseconds: 10000 }\n",
    )
    write_python_model(
        root,
        "py_caller",
        CALLER,
        python_config_text("py_caller", **io, max_batch_size=0, instance_count=8).replace(
            "dims: [ 4 ]", "dims: [ 1, 4 ]"
        ),
    )
    write_mlp(root, "mlp", instance_count=1)
    write_py_bls(root)
    write_python_model(
        root,
        "py_gen",
        GENERATOR,
        python_config_text(
            "py_gen",
            [("IN", "FP32", (4,))],
            [("OUT", "FP32", (4,))],
            max_batch_size=0,
            decoupled=True,
        ),
    )
    write_python_model(
        root,
        "py_gen_caller",
        GEN_CALLER,
        python_config_text(
            "py_gen_caller",
            [("IN", "FP32", (4,))],
            [("OUT", "FP32", (3, 4)), ("N", "INT32", (1,))],
            max_batch_size=0,
        ),
    )
    marks = root.parent / f"{root.name}_stamps"
    marks.mkdir()
    header = f"MARKS = {str(marks)!r}\n"
    write_python_model(
        root,
        "py_stamp",
        header + STAMP,
        python_config_text(
            "py_stamp", [("IN", "FP32", (4,))], [("T", "FP64", (1,))], max_batch_size=0
        ),
    )
    for name, extra in (("py_async", ""), ("py_async_stub", STUB)):
        config = python_config_text(
            name,
            [("IN", "FP32", (4,))],
            [("T", "FP64", (2,)), ("OUT", "FP32", (3, 4))],
            max_batch_size=0,
        )
        write_python_model(root, name, header + ASYNC_CALLER, config + extra)
    with running_stack(root) as s:
        yield s


def _call(stack: RunningStack, value: float, target: str = "py_count", use_async: bool = False):
    x = np.full((1, 4), value, dtype=np.float32)
    inp = grpcclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    params = {"target": target, **({"async": True} if use_async else {})}
    with stack.client() as c:
        return c.infer("py_caller", [inp], parameters=params)


@pytest.mark.parametrize("use_async", [False, True])
def test_bls_to_batched_model_under_concurrency(bls_stack: RunningStack, use_async) -> None:
    def one(i: int):
        r = _call(bls_stack, float(i), use_async=use_async)
        return i, r.as_numpy("OUT"), int(r.as_numpy("N")[0, 0])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    for i, out, _ in results:
        np.testing.assert_array_equal(out, np.full((1, 4), i * 3, dtype=np.float32))
    # 8 caller instances wait on the target at once: the target's batcher joins them.
    assert max(n for *_, n in results) > 1


def test_bls_requests_count_in_target_statistics(bls_stack: RunningStack) -> None:
    with bls_stack.client() as c:

        def target_count() -> int:
            stats = c.get_inference_statistics("py_count", as_json=True)["model_stats"][0]
            return int(stats.get("inference_count", 0))

        before = target_count()
        for i in range(3):
            _call(bls_stack, float(i))
        # The worker publishes its share about once a second.
        assert wait_until(lambda: target_count() >= before + 3, timeout_s=10)


def test_bls_errors_are_responses(bls_stack: RunningStack) -> None:
    with pytest.raises(InferenceServerException) as info:
        _call(bls_stack, 1.0, target="no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "no_such_model" in info.value.message()
    # The target's own validation: mlp wants 256 floats, gets 4.
    with pytest.raises(InferenceServerException) as info:
        _call(bls_stack, 1.0, target="mlp")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    ok = _call(bls_stack, 2.0)
    np.testing.assert_array_equal(ok.as_numpy("OUT"), np.full((1, 4), 6, np.float32))


def test_example_bls_model_calls_onnx_classifier(bls_stack: RunningStack) -> None:
    raw = np.random.default_rng(5).random((2, 256), dtype=np.float32)
    expected = mlp_reference((raw - 0.5) * 2.0, mlp_weights())
    inp = grpcclient.InferInput("INPUT0", [2, 256], "FP32")
    inp.set_data_from_numpy(raw)
    with bls_stack.client() as c:
        r = c.infer("py_bls", [inp])
    np.testing.assert_allclose(r.as_numpy("PROBS"), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("LABEL")[:, 0], expected.argmax(axis=1))


def test_bls_to_decoupled_model(bls_stack: RunningStack) -> None:
    x = np.arange(4, dtype=np.float32)
    inp = grpcclient.InferInput("IN", [4], "FP32")
    inp.set_data_from_numpy(x)
    with bls_stack.client() as c:
        r = c.infer("py_gen_caller", [inp], parameters={"decoupled": True})
        np.testing.assert_array_equal(r.as_numpy("OUT"), np.stack([x, x * 2, x * 3]))
        assert r.as_numpy("N").tolist() == [4]
        with pytest.raises(InferenceServerException) as info:
            c.infer("py_gen_caller", [inp])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "exec(decoupled=True)" in info.value.message()


@pytest.mark.parametrize("model", ["py_async", "py_async_stub"], ids=["in_process", "stub"])
def test_async_exec_runs_before_the_caller_awaits(bls_stack: RunningStack, model: str) -> None:
    """As Triton 2.51: async_exec() returns an asyncio Future already sent, so
    requests made before awaiting run meanwhile, and asyncio.wait takes them."""
    x = np.arange(4, dtype=np.float32)
    inp = grpcclient.InferInput("IN", [4], "FP32")
    inp.set_data_from_numpy(x)
    with bls_stack.client() as c:
        r = c.infer(model, [inp])
    assert (r.as_numpy("T") < 0).all(), r.as_numpy("T")  # ran while the caller was blocked
    np.testing.assert_array_equal(r.as_numpy("OUT"), np.stack([x, x * 2, x * 3]))
