"""PythonInstance (the worker side of pb_utils) on its own: a formed batch
split into requests, per-request results and errors, decoupled parts."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from services.worker.python_backend import pb_utils
from services.worker.python_backend.instance import (
    PythonInstance,
    PythonModelError,
    StillSending,
    config_json,
)
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools.examples import python_config_text

SOURCE = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x.reshape(-1)[0] < 0:
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative", pb_utils.TritonError.INVALID_ARG)))
                continue
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", x * 2),
                pb_utils.Tensor("ROWS", np.array([[x.shape[0]]] * x.shape[0], np.int32)),
            ]))
        return out if requests[0].request_id() != "short" else out[:-1]
"""

STREAM = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for i in range(2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i]))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# execute starts a thread that sends one response and the final flag once
# the test sets GO, and returns at once.
THREADED = """\
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

GO = threading.Event()
SENT = threading.Event()
ERRORS = []


class TritonPythonModel:
    def execute(self, requests):
        senders = [r.get_response_sender() for r in requests]

        def later():
            GO.wait(10)
            try:
                for s in senders:
                    s.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7]))]),
                           flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:
                ERRORS.append(exc)
            SENT.set()

        threading.Thread(target=later, daemon=True).start()
        return None
"""


def _instance(tmp_path: Path, source: str, **config) -> PythonInstance:
    text = python_config_text(
        "m",
        [("IN", "FP32", (2,))],
        [("OUT", "FP32", (2,)), ("ROWS", "INT32", (1,))],
        **config,
    )
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.py").write_text(source)
    config_proto = parse_config_text(text)
    return PythonInstance(
        tmp_path / "m" / "1" / "model.py",
        to_spec(config_proto),
        config_json(config_proto),
        instance_name="m_0_0",
        kind="KIND_CPU",
        device_id=-1,
        version=1,
    )


def _batch(parts: list[np.ndarray], outputs: list[list[str]], ids=None) -> pb.ExecuteRequest:
    x = np.concatenate(parts)
    req = pb.ExecuteRequest(request_batch_sizes=[len(p) for p in parts])
    req.inputs.add(name="IN", datatype="FP32", shape=list(x.shape), raw=numpy_to_raw(x))
    for i, names in enumerate(outputs):
        req.requested.add(names=names)
        req.request_info.add(request_id=(ids or [""] * len(parts))[i])
    return req


def _one_request() -> pb.ExecuteRequest:
    """A batch of one request of a model without batching."""
    req = pb.ExecuteRequest(request_batch_sizes=[1])
    a = np.ones((2,), np.float32)
    req.inputs.add(name="IN", datatype="FP32", shape=[2], raw=numpy_to_raw(a))
    req.requested.add()
    return req


def test_batch_split_per_request(tmp_path: Path) -> None:
    inst = _instance(tmp_path, SOURCE, max_batch_size=8)
    a = np.ones((1, 2), np.float32)
    b = np.full((3, 2), 2, np.float32)
    c = np.full((1, 2), -1, np.float32)
    resp = inst.execute_batch(_batch([a, b, c], [[], ["OUT"], []]), None)
    assert isinstance(resp, pb.ExecuteResponse)
    assert resp.failure == pb.FAILURE_NONE and len(resp.results) == 3
    first = {t.name: raw_to_numpy(t.raw, t.datatype, t.shape) for t in resp.results[0].outputs}
    np.testing.assert_array_equal(first["OUT"], a * 2)
    assert first["ROWS"].tolist() == [[1]]
    second = resp.results[1].outputs
    assert [t.name for t in second] == ["OUT"] and list(second[0].shape) == [3, 2]
    assert (resp.results[2].failure, resp.results[2].message) == (pb.INVALID_INPUT, "negative")


def test_wrong_number_of_responses(tmp_path: Path) -> None:
    inst = _instance(tmp_path, SOURCE, max_batch_size=8)
    a = np.ones((1, 2), np.float32)
    resp = inst.execute_batch(_batch([a, a], [[], []], ids=["short", ""]), None)
    assert isinstance(resp, pb.ExecuteResponse)
    assert resp.failure == pb.BACKEND_FAILED
    assert "InferenceRequest(s) size is:2, and InferenceResponse(s) size is:1" in resp.message


def test_decoupled_parts_then_end(tmp_path: Path) -> None:
    inst = _instance(tmp_path, STREAM, max_batch_size=0, decoupled=True)
    parts: list[pb.ExecuteResponse] = []
    req = _one_request()
    resp = inst.execute_batch(req, parts.append)
    assert isinstance(resp, pb.ExecuteResponse)
    assert resp.failure == pb.FAILURE_NONE and not resp.more
    assert all(p.more for p in parts)
    flat = [(q.request_index, q.has_response, q.final) for p in parts for q in p.parts]
    assert flat == [(0, True, False), (0, True, False), (0, False, True)]
    # Every final came before execute returned: no execute_returned message.
    assert not any(p.execute_returned for p in parts)


def test_decoupled_execute_returns_before_the_finals(tmp_path: Path) -> None:
    """The instance thread is free once execute returned (Triton's semantics):
    the worker is told (execute_returned), the senders go on, and the batch's
    last message comes after every final part."""
    inst = _instance(tmp_path, THREADED, max_batch_size=0, decoupled=True)
    parts: list[pb.ExecuteResponse] = []
    req = _one_request()
    pending = inst.execute_batch(req, parts.append)
    assert isinstance(pending, StillSending)
    assert [(p.more, p.execute_returned, len(p.parts)) for p in parts] == [(True, True, 0)]
    assert not pending.last.done()
    inst.model.execute.__globals__["GO"].set()
    last = pending.last.result(timeout=10)
    assert last.failure == pb.FAILURE_NONE and not last.more and not last.execute_returned
    flat = [(q.request_index, q.has_response, q.final) for p in parts for q in p.parts]
    assert flat == [(0, True, True)]
    assert parts[-1].parts[0].compute_infer_ns > 0


def test_model_without_execute_does_not_load(tmp_path: Path) -> None:
    with pytest.raises(PythonModelError, match="no execute method"):
        _instance(tmp_path, "class TritonPythonModel:\n    pass\n", max_batch_size=0)


def test_config_json_numbers_and_text() -> None:
    text = python_config_text("m", [("IN", "FP32", (-1, 2))], [], max_batch_size=4)
    text = text.replace("output [\n\n]", "") + (
        'parameters { key: "k" value: { string_value: "5" } }\n'
    )
    config = json.loads(config_json(parse_config_text(text)))
    assert config["input"][0]["dims"] == [-1, 2]
    assert config["parameters"]["k"]["string_value"] == "5"
    assert config["max_batch_size"] == 4 and config["backend"] == "python"


def test_decoupled_send_after_the_worker_stopped_waiting(tmp_path: Path) -> None:
    """The worker's wait for the last message was cancelled (its scheduler
    stream went away): the model's later send still returns normally."""
    inst = _instance(tmp_path, THREADED, max_batch_size=0, decoupled=True)
    req = _one_request()
    pending = inst.execute_batch(req, None)
    assert isinstance(pending, StillSending) and pending.last.cancel()
    model = inst.model.execute.__globals__
    model["GO"].set()
    assert model["SENT"].wait(10)
    assert model["ERRORS"] == []


# An `async def execute` that starts a BLS call with async_exec() and never
# awaits it (the fake BLS client below never answers).
FORGETS = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        pb_utils.InferenceRequest(
            model_name="other", requested_output_names=[], inputs=[]
        ).async_exec()
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros((1, 2), np.float32))])
            for _ in requests
        ]
"""


class _SilentBls:
    """A BLS client whose calls never answer."""

    def __init__(self) -> None:
        self.sent = 0

    def execute_async(self, request, decoupled: bool):
        self.sent += 1

        async def never() -> None:
            await asyncio.sleep(3600)

        return never()


def test_an_unawaited_async_exec_is_cancelled_quietly_at_unload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Triton's async_exec() future left pending at unload says nothing; an
    asyncio Task would log "Task was destroyed but it is pending!" when the
    instance's loop closes under it. Close cancels the tasks left on it."""
    inst = _instance(tmp_path, FORGETS, max_batch_size=8)
    bls = _SilentBls()
    saved, pb_utils.InferenceRequest._bls = pb_utils.InferenceRequest._bls, bls
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        resp = inst.execute_batch(_batch([np.ones((1, 2), np.float32)], [[]]), None)
        assert isinstance(resp, pb.ExecuteResponse)
        assert resp.failure == pb.FAILURE_NONE and len(resp.results) == 1 and bls.sent == 1
        inst.close()
        gc.collect()
    finally:
        pb_utils.InferenceRequest._bls = saved
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
