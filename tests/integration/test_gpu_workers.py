"""The GPU path end to end: `--workers auto` starts one worker per GPU, each
on its own cuda:i, and KIND_GPU models (ONNX on the CUDA execution provider,
TorchScript on cuda) answer within the numeric policy's tolerance of the
float64 reference (docs/gpu.md): TF32's by default, FP32's where the model
sets allow_tf32 false. Marked gpu: skips without one."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from services.worker.numeric_policy import DEFAULT_ALLOW_TF32, tolerance
from stageserve.gpus import gpu_count
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import mlp_reference, mlp_weights, write_mlp
from stageserve_tools.torch_examples import write_torch_mlp
from tests.integration.helpers import RPC_TIMEOUT_S, tensor_input

pytestmark = pytest.mark.gpu


FP32_PARAMETER = 'parameters { key: "allow_tf32" value { string_value: "false" } }\n'


def _gpu_repository(root: Path) -> None:
    write_mlp(root, "mlp_gpu", kind="KIND_GPU")
    fp32_dir = write_mlp(root, "mlp_gpu_fp32", kind="KIND_GPU")
    fp32_config = fp32_dir / "config.pbtxt"
    fp32_config.write_text(fp32_config.read_text() + FP32_PARAMETER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model_dir = write_torch_mlp(root, "torch_mlp_gpu", instance_count=1)
    config = (model_dir / "config.pbtxt").read_text().replace("KIND_CPU", "KIND_GPU")
    (model_dir / "config.pbtxt").write_text(config)


def _backend_has_cuda(model: str) -> bool:
    if model.startswith("torch"):
        import torch

        return bool(torch.cuda.is_available())
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def test_one_worker_per_gpu_serves_kind_gpu_models(tmp_path: Path) -> None:
    gpus = gpu_count()
    if gpus == 0:
        pytest.skip("no GPU")
    _gpu_repository(tmp_path)
    stack = Stack()
    try:
        services = start_services(stack, tmp_path, workers="auto", device="auto")
        assert len(services.workers) == gpus
        c = grpcclient.InferenceServerClient(services.gateway.address)
        x = np.random.default_rng(0).standard_normal((8, 256), dtype=np.float32)
        want = mlp_reference(x, mlp_weights())
        # TorchScript's TF32 switch is one per worker (numeric_policy.py), so
        # only ONNX Runtime is checked with both settings in this one stack.
        for model, name_in, name_out, tf32 in (
            ("mlp_gpu", "INPUT0", "OUTPUT0", DEFAULT_ALLOW_TF32),
            ("mlp_gpu_fp32", "INPUT0", "OUTPUT0", False),
            ("torch_mlp_gpu", "INPUT__0", "OUTPUT__0", DEFAULT_ALLOW_TF32),
        ):
            if not _backend_has_cuda(model):
                # A CPU-only onnxruntime or torch on a GPU machine: the KIND_GPU
                # instance fails its load, as Triton's backends built without GPU do.
                assert not c.is_model_ready(model)
                index = c.get_model_repository_index().models
                reasons = [m.reason for m in index if m.name == model]
                assert any("GPU instances not supported" in r for r in reasons), reasons
                continue
            assert c.is_model_ready(model)
            r = c.infer(model, [tensor_input(name_in, x, "FP32")], client_timeout=RPC_TIMEOUT_S)
            atol = tolerance(tf32, float(np.abs(want).max()))
            np.testing.assert_allclose(r.as_numpy(name_out), want, rtol=0, atol=atol, err_msg=model)
    finally:
        stack.stop()


def test_cuda_sessions_get_the_configured_provider_options(tmp_path: Path) -> None:
    """In process, no stack: what the CUDA EP was given, read back from ORT,
    and the answers of both TF32 settings against float64."""
    import onnxruntime as ort

    from services.worker.onnx_backend import OnnxInstance
    from services.worker.onnx_options import (
        DEFAULT_CUDNN_CONV_ALGO_SEARCH,
        ONE_SHAPE_CUDNN_CONV_ALGO_SEARCH,
        ort_options,
    )

    if gpu_count() == 0 or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no GPU, or no CUDA execution provider")
    path = write_mlp(tmp_path, "mlp", kind="KIND_GPU") / "1" / "model.onnx"
    x = np.random.default_rng(0).standard_normal((8, 256), dtype=np.float32)
    want = mlp_reference(x, mlp_weights())
    for parameters, one_shape, tf32, search in (
        ({}, False, DEFAULT_ALLOW_TF32, DEFAULT_CUDNN_CONV_ALGO_SEARCH),
        ({}, True, DEFAULT_ALLOW_TF32, ONE_SHAPE_CUDNN_CONV_ALGO_SEARCH),
        ({"allow_tf32": "false", "cudnn_conv_algo_search": "1"}, True, False, "HEURISTIC"),
    ):
        options = ort_options(parameters, gpu=True, device_id=0, one_shape=one_shape)
        session = OnnxInstance(path, "cuda:0", cpu_fallback=False, options=options)
        given = session._session.get_provider_options()["CUDAExecutionProvider"]
        assert given["cudnn_conv_algo_search"] == search
        assert given["use_tf32"] == ("1" if tf32 else "0")
        got = session.run({"INPUT0": x})["OUTPUT0"]
        atol = tolerance(tf32, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=str(parameters))
