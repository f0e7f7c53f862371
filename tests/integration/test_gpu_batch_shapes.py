"""Batch shapes on a GPU, by default: KIND_GPU models with preferred batch
sizes [4, 8] and max_batch_size 8 pad a batch of 3 without being asked (the
TorchScript model on cuda to 4, the preferred size; the ONNX Runtime model on
the CUDA execution provider to 8, its one shape), answer each request its
own rows, count 3 in the statistics, and warmed up those sizes before READY.
Marked gpu: skips without one (the CPU path is tests/integration/test_batch_padding.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from stageserve.gpus import gpu_count
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import batch_size_model, write_model
from tests.integration.helpers import RPC_TIMEOUT_S, model_stats, tensor_input

pytestmark = pytest.mark.gpu

CONFIG = """name: "{name}"
platform: "{platform}"
max_batch_size: 8
input [ {{ name: "{inp}" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "{out}" data_type: TYPE_FP32 dims: [ 2 ] }} ]
instance_group [ {{ count: 1 kind: KIND_GPU }} ]
dynamic_batching {{ preferred_batch_size: [ 4, 8 ] }}
"""


class _BatchRows(torch.nn.Module):
    """OUTPUT__0 = INPUT__0 + the rows the module ran (the ONNX model's twin)."""

    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return INPUT__0 + INPUT__0.shape[0]


def _repository(root: Path) -> None:
    text = CONFIG.format(name="rows_onnx", platform="onnxruntime_onnx", inp="INPUT", out="OUTPUT")
    write_model(root, "rows_onnx", batch_size_model(2), text)
    torch_dir = root / "rows_torch"
    (torch_dir / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_BatchRows()), str(torch_dir / "1" / "model.pt"))
    (torch_dir / "config.pbtxt").write_text(
        CONFIG.format(
            name="rows_torch", platform="pytorch_libtorch", inp="INPUT__0", out="OUTPUT__0"
        )
    )


def _has_cuda(model: str) -> bool:
    if model == "rows_torch":
        return bool(torch.cuda.is_available())
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def test_kind_gpu_models_pad_and_warm_up_by_default(tmp_path: Path) -> None:
    if gpu_count() == 0:
        pytest.skip("no GPU")
    repo, log_file = tmp_path / "repo", tmp_path / "stack.log"
    _repository(repo)
    stack = Stack(log_argv=["--log-file", str(log_file)])
    try:
        services = start_services(stack, repo, workers=1, device="auto")
        c = grpcclient.InferenceServerClient(services.gateway.address)
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        warmed = {}
        for line in log_file.read_text().splitlines():
            if "shape warm-up done" in line:
                entry = json.loads(line if line.startswith("{") else line[line.index("{") :])
                warmed[entry["model"]] = entry
        checked = 0
        for model, inp, out, sizes in (
            ("rows_onnx", "INPUT", "OUTPUT", [8]),
            ("rows_torch", "INPUT__0", "OUTPUT__0", [4, 8]),
        ):
            if not _has_cuda(model):
                continue  # that backend's CPU-only build: test_gpu_workers checks its refusal
            assert c.is_model_ready(model)
            assert warmed[model]["shapes"] == sizes
            r = c.infer(model, [tensor_input(inp, x, "FP32")], client_timeout=RPC_TIMEOUT_S)
            # padded: the GPU ran the smallest allowed size's rows
            np.testing.assert_array_equal(r.as_numpy(out), x + sizes[0])
            st = model_stats(c, model)
            assert st.inference_count == 3 and st.execution_count == 1
            assert [(b.batch_size, b.compute_infer.count) for b in st.batch_stats] == [(3, 1)]
            checked += 1
        if not checked:
            pytest.skip("neither onnxruntime nor torch can use the GPU here")
    finally:
        stack.stop()
