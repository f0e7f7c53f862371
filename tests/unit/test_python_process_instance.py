"""services/worker/python_backend/process_instance.py without a stack: a real
stub process per instance, batches as ExecuteRequests, as the worker sends them."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from services.worker.python_backend import pb_utils
from services.worker.python_backend.bls_wire import (
    request_from_wire,
    request_to_wire,
    response_to_wire,
    responses_from_wire,
)
from services.worker.python_backend.instance import PythonModelError, StillSending
from services.worker.python_backend.process_instance import (
    InstanceProcessError,
    ProcessInstance,
    runs_in_process,
)
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools.examples import python_config_text
from tests.procs import alive

MODEL = """\
import os
import socket
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if os.path.exists(os.path.join(args["model_repository"], "refuse")):
            raise RuntimeError("refused")
        self.name = args["model_instance_name"]

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x[0, 0] == -1:
            os._exit(3)
        if x[0, 0] == -2:
            raise ValueError("model says no")
        if x[0, 0] == -4:  # its socket ends 0.3 s before its process does
            for fd in range(3, 256):
                try:
                    s = socket.socket(fileno=fd)
                except OSError:
                    continue  # not a socket
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.detach()
            time.sleep(0.3)
            os._exit(3)
        if x[0, 0] == -3:  # BLS, with no BLS client in the worker (this test's process)
            pb_utils.InferenceRequest(model_name="m").exec()
        pid = np.full((x.shape[0], 1), os.getpid(), np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]) for _ in requests]
"""

DECOUPLED = """\
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        senders = [r.get_response_sender() for r in requests]

        def later():
            time.sleep(0.2)
            out = pb_utils.Tensor("PID", np.zeros((1, 1), np.int64))
            for s in senders:
                s.send(pb_utils.InferenceResponse([out]),
                       flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        threading.Thread(target=later).start()
        return None
"""


def _instance(tmp_path: Path, source: str, decoupled: bool = False) -> ProcessInstance:
    text = python_config_text(
        "m",
        [("IN", "FP32", (2,))],
        [("PID", "INT64", (1,))],
        max_batch_size=0 if decoupled else 4,
        decoupled=decoupled,
    )
    (tmp_path / "1").mkdir(exist_ok=True)
    path = tmp_path / "1" / "model.py"
    path.write_text(source)
    return ProcessInstance(
        path,
        to_spec(parse_config_text(text)),
        "{}",
        instance_name="m_0_0",
        kind="KIND_CPU",
        device_id=-1,
        version=1,
    )


def _batch(value: float, requests: int = 1) -> pb.ExecuteRequest:
    req = pb.ExecuteRequest(request_batch_sizes=[1] * requests)
    x = np.full((requests, 2), value, np.float32)
    req.inputs.add(name="IN", datatype="FP32", shape=[requests, 2], raw=numpy_to_raw(x))
    for _ in range(requests):
        req.requested.add()
    return req


def _done(result: pb.ExecuteResponse | StillSending) -> pb.ExecuteResponse:
    """A non-decoupled model's batch: answered when execute_batch returns."""
    assert isinstance(result, pb.ExecuteResponse)
    return result


def _pid(resp: pb.ExecuteResponse | StillSending) -> int:
    resp = _done(resp)
    t = resp.results[0].outputs[0]
    return int(raw_to_numpy(t.raw, t.datatype, t.shape)[0, 0])


def test_batches_run_in_the_stub_and_model_errors_stay_batch_errors(tmp_path: Path) -> None:
    inst = _instance(tmp_path, MODEL)
    try:
        resp = _done(inst.execute_batch(_batch(1.0, requests=3), None))
        assert resp.failure == pb.FAILURE_NONE and len(resp.results) == 3
        pid = _pid(resp)
        assert pid != os.getpid() and alive(pid)
        failed = _done(inst.execute_batch(_batch(-2.0), None))
        assert failed.failure == pb.BACKEND_FAILED
        assert failed.message == (
            "Failed to process the request(s) for model 'm_0_0', message: ValueError: model says no"
        )
        # no BLS client: exec() raises, as in-process
        bls = _done(inst.execute_batch(_batch(-3.0), None))
        assert bls.failure == pb.BACKEND_FAILED
        assert bls.message.endswith(
            "message: TritonModelException: BLS requests can only be executed inside a model"
        )
        assert _pid(inst.execute_batch(_batch(1.0), None)) == pid  # the same stub serves on
    finally:
        inst.close()
    assert not alive(pid)


def test_a_dead_stub_fails_its_batch_and_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inst = _instance(tmp_path, MODEL)
    caplog.set_level(logging.ERROR)
    try:
        first = _pid(inst.execute_batch(_batch(1.0), None))
        dead = _done(inst.execute_batch(_batch(-1.0), None))
        assert (dead.failure, dead.message) == (
            pb.BACKEND_FAILED,
            "Stub process 'm_0_0' is not healthy.",
        )
        second = _pid(inst.execute_batch(_batch(1.0), None))
        assert second != first and not alive(first)
        os.kill(second, 9)  # killed while idle: the next batch finds a new stub
        time.sleep(0.5)
        third = _pid(inst.execute_batch(_batch(1.0), None))
        assert third not in (first, second)
        late = _done(inst.execute_batch(_batch(-4.0), None))
        assert (late.failure, late.message) == (
            pb.BACKEND_FAILED,
            "Stub process 'm_0_0' is not healthy.",
        )
        assert _pid(inst.execute_batch(_batch(1.0), None)) != third
    finally:
        inst.close()
    # The log says how each stub ended: its own exit status, even when its
    # socket closed before it exited (a dying process's files close before
    # it can be reaped; the -4 stub makes that window wide), not -9 from a
    # kill of ours in that window.
    died = [
        r.status  # type: ignore[attr-defined]  # set by the log call's extra=
        for r in caplog.records
        if r.getMessage() == "python stub died"
    ]
    assert died == [3, -9, 0]  # 0: the stub ends itself when its socket does


def test_a_stub_that_cannot_restart_fails_batches_until_it_can(tmp_path: Path) -> None:
    inst = _instance(tmp_path, MODEL)
    try:
        (tmp_path / "refuse").write_text("")
        dead = _done(inst.execute_batch(_batch(-1.0), None))
        assert dead.message == "Stub process 'm_0_0' is not healthy."
        again = _done(inst.execute_batch(_batch(1.0), None))
        assert again.failure == pb.BACKEND_FAILED
        assert again.message.startswith("Stub process 'm_0_0' is not healthy: it could not")
        assert "RuntimeError: refused" in again.message
        (tmp_path / "refuse").unlink()
        assert _done(inst.execute_batch(_batch(1.0), None)).failure == pb.FAILURE_NONE
    finally:
        inst.close()


def test_initialize_failure_fails_the_load(tmp_path: Path) -> None:
    (tmp_path / "refuse").write_text("")
    with pytest.raises(PythonModelError, match="Failed to initialize model 'm_0_0': RuntimeError"):
        _instance(tmp_path, MODEL)
    with pytest.raises(PythonModelError, match="SyntaxError"):
        _instance(tmp_path, "def broken(:\n")


def test_decoupled_finals_after_execute_returned(tmp_path: Path) -> None:
    inst = _instance(tmp_path, DECOUPLED, decoupled=True)
    parts: list[pb.ExecuteResponse] = []
    try:
        result = inst.execute_batch(_batch(1.0, requests=2), parts.append)
        assert isinstance(result, StillSending)  # the instance is free, as in-process
        last = result.last.result(timeout=10)
        assert last.failure == pb.FAILURE_NONE
        finals = sorted(p.request_index for m in parts for p in m.parts if p.final)
        assert finals == [0, 1]
        assert any(m.execute_returned for m in parts)
    finally:
        inst.close()


def test_the_parameter_chooses_per_model() -> None:
    def spec(value: str | None):
        text = python_config_text(
            "m", [("IN", "FP32", (2,))], [("O", "FP32", (2,))], max_batch_size=0
        )
        if value is not None:
            text += (
                'parameters { key: "STAGESERVE_INSTANCE_PROCESS" '
                f'value {{ string_value: "{value}" }} }}\n'
            )
        return to_spec(parse_config_text(text))

    assert runs_in_process(spec("true"), False) and runs_in_process(spec("YES"), False)
    assert not runs_in_process(spec("false"), True) and not runs_in_process(spec("0"), True)
    assert not runs_in_process(spec(None), False)  # the worker's default: in-process
    assert runs_in_process(spec(None), True)  # STAGESERVE_WORKER_PYTHON_INSTANCE_PROCESS=1
    with pytest.raises(InstanceProcessError, match="must be true or false, not 'maybe'"):
        runs_in_process(spec("maybe"), False)


def test_bls_values_cross_the_process_boundary_unchanged() -> None:
    raw = np.array([b"a\x00b", b"\xff\xfe"], dtype=np.object_)
    request = pb_utils.InferenceRequest(
        model_name="t",
        requested_output_names=["B", "A"],
        inputs=[pb_utils.Tensor("S", raw), pb_utils.Tensor("F", np.ones((2, 3), np.float16))],
        model_version=2,
        correlation_id="seq",
        request_id="r1",
        flags=1,
        timeout=5,
        parameters={"k": 1},
    )
    back = request_from_wire(request_to_wire(request))
    assert back.model_name() == "t" and back._requested == ["B", "A"]
    assert back.inputs()[0].as_numpy().tolist() == [b"a\x00b", b"\xff\xfe"]
    assert back.inputs()[1].as_numpy().dtype == np.float16
    assert (back.model_version(), back.correlation_id(), back.request_id()) == (2, "seq", "r1")
    assert (back.flags(), back.timeout(), back.parameters()) == (1, 5, '{"k":1}')
    responses = [
        pb_utils.InferenceResponse([pb_utils.Tensor("O", raw)]),
        pb_utils.InferenceResponse(
            error=pb_utils.TritonError("no", pb_utils.TritonError.NOT_FOUND)
        ),
    ]
    ok, err = responses_from_wire([response_to_wire(r) for r in responses])
    assert ok.output_tensors()[0].as_numpy().tolist() == [b"a\x00b", b"\xff\xfe"]
    error = err.error()
    assert err.has_error() and error is not None
    assert error.code() == pb_utils.TritonError.NOT_FOUND
    assert error.message() == "no"
