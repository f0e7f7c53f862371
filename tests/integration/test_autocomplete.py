"""Triton's auto-generated configuration through the whole stack: an ONNX
model with no config.pbtxt serves, batched, with the completed config
visible through ModelConfig; with auto-complete off it is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve.autocomplete_options import AutoComplete
from stageserve_tools.examples import identity_model
from tests.integration.helpers import RPC_TIMEOUT_S, stack_retrying


def _bare_model(root: Path) -> None:
    d = root / "bare" / "1"
    d.mkdir(parents=True)
    (d / "model.onnx").write_bytes(identity_model("FP32", (3,), 64).SerializeToString())


def test_a_model_without_config_serves_with_the_generated_one(tmp_path: Path) -> None:
    _bare_model(tmp_path)
    with stack_retrying(tmp_path) as s:
        c = s.client()
        assert c.is_model_ready("bare")
        config = c.get_model_config("bare", client_timeout=RPC_TIMEOUT_S).config
        assert config.platform == "onnxruntime_onnx" and config.backend == "onnxruntime"
        assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
        assert [(t.name, list(t.dims)) for t in config.input] == [("INPUT0", [3])]
        metadata = c.get_model_metadata("bare")
        assert list(metadata.inputs[0].shape) == [-1, 3]
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        inp = grpcclient.InferInput("INPUT0", [2, 3], "FP32")
        inp.set_data_from_numpy(x)
        r = c.infer("bare", [inp], client_timeout=RPC_TIMEOUT_S)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
        too_big = grpcclient.InferInput("INPUT0", [5, 3], "FP32")
        too_big.set_data_from_numpy(np.zeros((5, 3), np.float32))
        with pytest.raises(InferenceServerException, match="batch-size must be <= 4"):
            c.infer("bare", [too_big], client_timeout=RPC_TIMEOUT_S)


def test_with_auto_complete_off_the_model_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    _bare_model(tmp_path)
    with stack_retrying(tmp_path, autocomplete=AutoComplete(enabled=False)) as s:
        c = s.client()
        assert not c.is_model_ready("bare")
        (row,) = [m for m in c.get_model_repository_index().models if m.name == "bare"]
        assert row.state == "UNAVAILABLE" and "no config.pbtxt" in row.reason
