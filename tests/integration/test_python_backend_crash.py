"""A model.py that kills its process: in-process instances share the worker's
fate, so its in-flight request fails UNAVAILABLE naming the worker, and the
model keeps serving on the other worker (docs/python_backend.md)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import python_config_text, write_python_model
from tests.stack import running_stack, wait_until

CRASHER = """\
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x.reshape(-1)[0] < 0:
            os._exit(3)  # as a segfault in a C extension would
        return [
            pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
            for r in requests
        ]
"""


def _infer(client, value: float):
    inp = grpcclient.InferInput("IN", [1, 2], "FP32")
    inp.set_data_from_numpy(np.full((1, 2), value, np.float32))
    return client.infer("py_crash", [inp], client_timeout=30)


def test_crashing_model_fails_its_request_and_model_keeps_serving(tmp_path) -> None:
    text = python_config_text(
        "py_crash", [("IN", "FP32", (2,))], [("IN", "FP32", (2,))], max_batch_size=4
    )
    write_python_model(tmp_path, "py_crash", CRASHER, text)
    with running_stack(tmp_path, workers=2) as s, s.client() as c:
        with pytest.raises(InferenceServerException) as info:
            _infer(c, -1.0)
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert "worker" in info.value.message()

        def serves() -> bool:
            try:
                return float(_infer(c, 2.0).as_numpy("IN")[0, 0]) == 2.0
            except InferenceServerException:
                return False

        assert wait_until(serves, timeout_s=20, interval_s=0.2)
        # The crashed worker's sockets close just before the kernel makes it a
        # zombie, so the scheduler (and `serves`) can see it gone a moment
        # before poll() does.
        assert wait_until(lambda: sum(w.proc.poll() is None for w in s.workers) == 1, 10)
