"""Triton Python-backend models (model.py) through tritonclient: per-request
execution of a batch, initialize args, BYTES, errors with Triton's codes and
messages (checked against Triton 2.51), auto-complete, concurrent instances,
and the Python pre-processing -> ONNX classifier ensemble."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve.net import free_port
from stageserve_tools.examples import (
    TensorSpec,
    mlp_reference,
    mlp_weights,
    python_config_text,
    write_mlp,
    write_py_ensemble,
    write_py_preprocess,
    write_python_model,
)
from tests.stack import RunningStack, running_stack, wait_until


class TensorIO(TypedDict):
    """The inputs= and outputs= of a config_text call."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


# OUT = IN + 1 per request; N = how many requests execute() received together;
# MOST = the most instances that ever executed at once.
ADD_ONE = """\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.delay = float(cfg["parameters"]["delay_s"]["string_value"])
        # model.py globals are per instance (as Triton's stubs); this module,
        # next to model.py, is imported once per worker, so instances share it.
        self.shared = __import__("tests_shared_counter")

    def execute(self, requests):
        c = self.shared
        with c.LOCK:
            c.RUNNING[0] += 1
            c.RUNNING[1] = max(c.RUNNING[1], c.RUNNING[0])
        try:
            time.sleep(self.delay)
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                n = np.full((x.shape[0], 1), len(requests), dtype=np.int32)
                most = np.full((x.shape[0], 1), c.RUNNING[1], dtype=np.int32)
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", x + 1), pb_utils.Tensor("N", n),
                    pb_utils.Tensor("MOST", most)]))
            return out
        finally:
            with c.LOCK:
                c.RUNNING[0] -= 1
"""

SHARED_COUNTER = "import threading\nLOCK = threading.Lock()\nRUNNING = [0, 0]\n"

ARGS = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)

    def execute(self, requests):
        out = []
        for r in requests:
            info = dict(self.args)
            info["model_config"] = json.loads(info["model_config"])
            info["request"] = {
                "id": r.request_id(), "corr": r.correlation_id(), "flags": r.flags(),
                "params": r.parameters(), "outputs": sorted(r.requested_output_names()),
            }
            text = np.array([json.dumps(info).encode()], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", text)]))
        return out
"""

BYTES_ECHO = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
"""

# IN[0] selects the behaviour, so one model shows every error and keeps serving.
FAULTY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        mode = int(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy().reshape(-1)[0])
        if mode == 1:
            raise ValueError("boom")
        if mode == 2:
            raise pb_utils.TritonModelException("model said no")
        if mode == 3:
            return []
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if mode == 4:
                err = pb_utils.TritonError("bad thing", pb_utils.TritonError.INVALID_ARG)
                out.append(pb_utils.InferenceResponse(error=err))
            elif mode == 5:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("plain")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 10)]))
        return out
"""

AUTO = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
        config.set_max_batch_size(8)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]
            )
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def py_metrics_port() -> int:
    """The py_stack gateway's Triton /metrics port."""
    return free_port()


@pytest.fixture(scope="module")
def py_stack(
    tmp_path_factory: pytest.TempPathFactory, py_metrics_port: int
) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("python_repository")
    add_config = python_config_text(
        "py_add",
        [("IN", "FP32", (4,))],
        [("OUT", "FP32", (4,)), ("N", "INT32", (1,)), ("MOST", "INT32", (1,))],
        max_batch_size=4,  # 12 requests need at least 3 batches: 2 instances overlap
        instance_count=2,
    ) + (
        "dynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        'parameters { key: "delay_s" value: { string_value: "0.2" } }\n'
    )
    model_dir = write_python_model(root, "py_add", ADD_ONE, add_config)
    (model_dir / "1" / "tests_shared_counter.py").write_text(SHARED_COUNTER)
    write_python_model(
        root,
        "py_args",
        ARGS,
        python_config_text(
            "py_args", [("IN", "BYTES", (-1,))], [("OUT", "BYTES", (-1,))], max_batch_size=0
        ),
    )
    write_python_model(
        root,
        "py_bytes",
        BYTES_ECHO,
        python_config_text(
            "py_bytes",
            [("IN", "BYTES", (-1,))],
            [("OUT", "BYTES", (-1,))],
            max_batch_size=8,
            dynamic_batching=True,
        ),
    )
    write_python_model(
        root,
        "py_faulty",
        FAULTY,
        python_config_text(
            "py_faulty", [("IN", "FP32", (2,))], [("OUT", "FP32", (2,))], max_batch_size=8
        ),
    )
    write_python_model(root, "py_auto", AUTO, 'backend: "python"\n')
    write_mlp(root, "mlp", instance_count=1)
    write_py_preprocess(root)
    write_py_ensemble(root)
    with running_stack(root, metrics_port=py_metrics_port) as s:
        yield s


def _infer(client, model, arr, datatype="FP32", name="IN", **kwargs):
    inp = grpcclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)
    return client.infer(model, [inp], **kwargs)


def test_batch_reaches_execute_as_separate_requests(py_stack: RunningStack) -> None:
    """Concurrent requests are batched by the scheduler, and execute() gets them
    as a list of requests, each with its own tensors; two instances run at once."""

    def one(i: int):
        with py_stack.client() as c:
            x = np.full((1, 4), i, dtype=np.float32)
            r = _infer(c, "py_add", x)
            return i, r.as_numpy("OUT"), int(r.as_numpy("N")[0, 0]), int(r.as_numpy("MOST")[0, 0])

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    for i, out, _, _ in results:
        np.testing.assert_array_equal(out, np.full((1, 4), i + 1, dtype=np.float32))
    assert max(n for *_, n, _ in results) > 1  # several requests in one execute() list
    # Both instances executed at once (0.2 s executions, 12 requests over 2 instances).
    assert max(m for *_, m in results) == 2


def test_initialize_args_and_request_metadata(py_stack: RunningStack) -> None:
    with py_stack.client() as c:
        arr = np.array([b"x"], dtype=np.object_)
        r = _infer(c, "py_args", arr, "BYTES", request_id="rid7", parameters={"p1": "v", "p2": 3})
    info = json.loads(r.as_numpy("OUT")[0])
    assert info["model_name"] == "py_args"
    assert info["model_version"] == "1"
    assert info["model_instance_kind"] == "CPU"
    assert info["model_instance_name"] == "py_args_0_0"
    assert info["model_instance_device_id"] == "0"
    assert info["model_repository"].endswith("/py_args")
    config = info["model_config"]
    assert config["backend"] == "python" and config["max_batch_size"] == 0
    assert config["input"][0]["dims"] == [-1]  # numbers, as in Triton's JSON
    assert info["request"] == {
        "id": "rid7",
        "corr": 0,
        "flags": 0,
        "params": '{"p1":"v","p2":3}',
        "outputs": ["OUT"],
    }


def test_bytes_exact(py_stack: RunningStack) -> None:
    values = np.array([[b"a\x00b", b"\xff\xfe\x00", b""]], dtype=np.object_)
    with py_stack.client() as c:
        r = _infer(c, "py_bytes", values, "BYTES")
    assert r.as_numpy("OUT").tolist() == values.tolist()


@pytest.mark.parametrize(
    ("mode", "code", "message"),
    [
        (
            1,
            "StatusCode.INTERNAL",
            "Failed to process the request(s) for model 'py_faulty_0_0', message: ValueError: boom",
        ),
        (
            2,
            "StatusCode.INTERNAL",
            "Failed to process the request(s) for model 'py_faulty_0_0', message: "
            "TritonModelException: model said no",
        ),
        (
            3,
            "StatusCode.INTERNAL",
            "Failed to process the request(s) for model 'py_faulty_0_0', message: Number of "
            "InferenceResponse objects do not match the number of InferenceRequest objects. "
            "InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0",
        ),
        (4, "StatusCode.INVALID_ARGUMENT", "bad thing"),
        (5, "StatusCode.INTERNAL", "plain"),
    ],
)
def test_model_errors_keep_serving(
    py_stack: RunningStack, py_metrics_port: int, mode, code, message
) -> None:
    before = _backend_failures(py_metrics_port, "py_faulty")
    before_any = _backend_failures(py_metrics_port, "py_faulty", reason="")
    with py_stack.client() as c:
        with pytest.raises(InferenceServerException) as info:
            _infer(c, "py_faulty", np.full((1, 2), mode, dtype=np.float32))
        assert info.value.status() == code
        assert info.value.message() == message
        ok = _infer(c, "py_faulty", np.zeros((1, 2), dtype=np.float32))
        np.testing.assert_array_equal(ok.as_numpy("OUT"), np.zeros((1, 2), np.float32))
    if mode <= 3:
        # A failed execute crosses the scheduler as BACKEND_FAILED: Triton 2.51
        # counts it reason="BACKEND" (checked against it, modes 1 and 3).
        assert _backend_failures(py_metrics_port, "py_faulty") == before + 1
    else:
        # An error response is the model's answer: Triton 2.51 counts the
        # request a success, no failure of any reason (bench/triton_diff.py).
        assert _backend_failures(py_metrics_port, "py_faulty", reason="") == before_any


def _backend_failures(port: int, model: str, reason: str = "BACKEND") -> float:
    """nv_inference_request_failure{reason=`reason`} of `model` at the gateway
    ("": every reason)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    prefix = "nv_inference_request_failure{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
        and f'model="{model}"' in line
        and (not reason or f'reason="{reason}"' in line)
    )


def test_auto_complete_config(py_stack: RunningStack) -> None:
    with py_stack.client() as c:
        config = c.get_model_config("py_auto", as_json=True)["config"]
        assert config["max_batch_size"] == 8
        assert [t["name"] for t in config["input"]] == ["IN"]
        assert config["output"][0]["dims"] == ["4"]
        assert "dynamic_batching" in config
        r = _infer(c, "py_auto", np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(r.as_numpy("OUT"), np.full((2, 4), 2, np.float32))


def test_python_preprocess_feeds_onnx_classifier(py_stack: RunningStack) -> None:
    rng = np.random.default_rng(3)
    raw = rng.random((3, 256), dtype=np.float32)
    expected = mlp_reference((raw - 0.5) * 2.0, mlp_weights())
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with py_stack.client() as c:
                r = _infer(c, "ensemble_py_mlp", raw, name="RAW")
                np.testing.assert_allclose(r.as_numpy("PROBS"), expected, rtol=1e-4, atol=1e-6)
        except BaseException as exc:  # collected: asserted below on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with py_stack.client() as c:
        stats = c.get_inference_statistics("py_preprocess", as_json=True)
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) >= 8


FINALIZING = """\
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "finalized")

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
            for r in requests
        ]

    def finalize(self):
        with open(self.marker, "w") as f:
            f.write("done")
"""

BROKEN = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights here")

    def execute(self, requests):
        return []
"""


def test_load_failure_and_finalize_on_unload(tmp_path) -> None:
    """initialize raising makes the load fail with its reason; unloading a model
    runs finalize() (explicit model control)."""
    io: TensorIO = {"inputs": [("IN", "FP32", (2,))], "outputs": [("IN", "FP32", (2,))]}
    write_python_model(
        tmp_path, "py_final", FINALIZING, python_config_text("py_final", **io, max_batch_size=4)
    )
    write_python_model(
        tmp_path, "py_broken", BROKEN, python_config_text("py_broken", **io, max_batch_size=4)
    )
    with running_stack(tmp_path, control_mode="explicit") as s, s.client() as c:
        with pytest.raises(InferenceServerException) as info:
            c.load_model("py_broken")
        assert "Failed to initialize model 'py_broken_0_0': RuntimeError: no weights here" in (
            info.value.message()
        )
        c.load_model("py_final")
        r = _infer(c, "py_final", np.ones((1, 2), np.float32))
        np.testing.assert_array_equal(r.as_numpy("IN"), np.ones((1, 2), np.float32))
        marker = tmp_path / "py_final" / "finalized"
        assert not marker.exists()
        c.unload_model("py_final")
        assert wait_until(marker.exists, timeout_s=20)


def test_asyncio_client_concurrent_requests(py_stack: RunningStack) -> None:
    """tritonclient.grpc.aio: concurrent BYTES requests, each answered with its own bytes."""
    import asyncio

    import tritonclient.grpc.aio as aioclient

    async def main() -> list[list[bytes]]:
        async with aioclient.InferenceServerClient(py_stack.url) as c:

            async def one(i: int) -> list[bytes]:
                values = np.array([[bytes([i, 0, 255]), b"\x80" * i]], dtype=np.object_)
                inp = aioclient.InferInput("IN", [1, 2], "BYTES")
                inp.set_data_from_numpy(values)
                r = await c.infer("py_bytes", [inp])
                return r.as_numpy("OUT")[0].tolist()

            return await asyncio.gather(*(one(i) for i in range(16)))

    for i, got in enumerate(asyncio.run(main())):
        assert got == [bytes([i, 0, 255]), b"\x80" * i]


def test_metadata_platform_is_python(py_stack: RunningStack) -> None:
    """As Triton 2.51 answers for a backend: "python" config."""
    with py_stack.client() as c:
        meta = c.get_model_metadata("py_bytes", as_json=True)
    assert meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "IN", "datatype": "BYTES", "shape": ["-1", "-1"]}]
