"""services.worker.torch_backend: Triton's naming rules, parameters, datatypes,
threads, and errors, on TorchScript modules built here."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.backends import BackendError
from services.worker.torch_backend import (
    TorchInstance,
    argument_positions,
    output_positions,
    torch_options,
)


class _Mixed(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 2, (b.float() + 1).to(torch.bfloat16)


class _Wrong(torch.nn.Module):
    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return INPUT__0.double()


def _save(tmp_path: Path, module: torch.nn.Module, name: str) -> Path:
    path = tmp_path / f"{name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(module), str(path))
    return path


def test_inputs_map_by_argument_name_else_by_index() -> None:
    assert argument_positions(["b", "a"], ["a", "b"]) == {"b": 1, "a": 0}
    assert argument_positions(["INPUT__1", "INPUT__0"], ["x", "y"]) == {
        "INPUT__1": 1,
        "INPUT__0": 0,
    }
    with pytest.raises(BackendError, match="neither an argument of forward"):
        argument_positions(["z"], ["x", "y"])
    with pytest.raises(BackendError, match="forward\\(\\) takes 2"):
        argument_positions(["INPUT__2"], ["x", "y"])


def test_outputs_map_by_index_suffix_else_config_order() -> None:
    assert output_positions(["OUTPUT__1", "OUTPUT__0"]) == {"OUTPUT__1": 1, "OUTPUT__0": 0}
    assert output_positions(["prob", "label"]) == {"prob": 0, "label": 1}


def test_parameters_accepted_and_refused() -> None:
    opts = torch_options(
        {
            "INFERENCE_MODE": "false",
            "DISABLE_OPTIMIZED_EXECUTION": "true",
            "ENABLE_NVFUSER": "false",
            "INTRA_OP_THREAD_COUNT": "3",
        }
    )
    assert not opts.inference_mode and not opts.optimized_execution
    assert opts.intra_op_threads == 3
    assert torch_options({}).inference_mode  # Triton's default
    for params, match in (
        ({"ENABLE_NVFUSER": "true"}, "ENABLE_NVFUSER.*NVFuser"),
        ({"ENABLE_JIT_EXECUTOR": "false"}, "ENABLE_JIT_EXECUTOR.*per process"),
        ({"DISABLE_CUDNN": "true"}, "DISABLE_CUDNN.*per process"),
        ({"ENABLE_WEIGHT_SHARING": "true"}, "ENABLE_WEIGHT_SHARING"),
        ({"ENABLE_JIT_PROFILING": "false"}, "every other TorchScript model"),
        ({"INFERENCE_MODE": "sometimes"}, "true or false"),
        ({"INTRA_OP_THREAD_COUNT": "many"}, "integer"),
    ):
        with pytest.raises(BackendError, match=match):
            torch_options(params)


def test_run_by_name_with_bf16_and_a_subset_of_outputs(tmp_path: Path) -> None:
    path = _save(tmp_path, _Mixed(), "mixed")
    inst = TorchInstance(
        path, "cpu", 1, {"b": "INT32", "a": "FP32"}, {"OUT__0": "FP32", "OUT__1": "BF16"}
    )
    a = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), np.float32).reshape(2, 3)
    b = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = inst.run({"a": a, "b": b})
    np.testing.assert_array_equal(out["OUT__0"], a * 2)
    # bfloat16 words: small integers are exact in bfloat16
    words = out["OUT__1"]
    assert words.dtype == np.uint16
    floats = (words.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(floats, b + 1)
    assert list(inst.run({"a": a, "b": b}, ["OUT__1"])) == ["OUT__1"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    path = _save(tmp_path, _Wrong(), "wrong")
    inst = TorchInstance(path, "cpu", 1, {"INPUT__0": "FP32"}, {"OUTPUT__0": "FP32"})
    with pytest.raises(BackendError, match="TYPE_FP32 in the configuration.*torch.float64"):
        inst.run({"INPUT__0": np.zeros((1, 2), np.float32)})
    with pytest.raises(BackendError, match="is FP32 but the array is int32"):
        inst.run({"INPUT__0": np.zeros((1, 2), np.int32)})
    with pytest.raises(BackendError, match="does not support"):
        TorchInstance(path, "cpu", 1, {"INPUT__0": "BYTES"}, {"OUTPUT__0": "FP32"})
    with pytest.raises(BackendError, match="failed to load TorchScript"):
        (tmp_path / "junk.pt").write_bytes(b"not a model")
        TorchInstance(tmp_path / "junk.pt", "cpu", 1, {"INPUT__0": "FP32"}, {})
    with pytest.raises(BackendError, match="not found"):
        TorchInstance(tmp_path / "nope.pt", "cpu", 1, {"INPUT__0": "FP32"}, {})


def test_each_instance_sets_its_thread_share_on_its_own_thread(tmp_path: Path) -> None:
    path = _save(tmp_path, _Wrong(), "threads")
    seen = {}

    def run(threads: int) -> None:
        inst = TorchInstance(path, "cpu", threads, {"INPUT__0": "FP32"}, {})
        inst.run({"INPUT__0": np.zeros((1, 2), np.float32)}, [])
        seen[threads] = torch.get_num_threads()  # OpenMP's count is per thread

    for n in (1, 2):
        t = threading.Thread(target=run, args=(n,))
        t.start()
        t.join()
    assert seen == {1: 1, 2: 2}


@pytest.mark.gpu
def test_kind_gpu_instance_runs_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = _save(tmp_path, _Mixed(), "gpu")
    inst = TorchInstance(path, "cuda:0", 1, {"a": "FP32", "b": "INT32"}, {"OUT__0": "FP32"})
    assert inst.device == "cuda:0"
    a = np.ones((2, 3), np.float32)
    out = inst.run({"a": a, "b": np.ones((2, 3), np.int32)}, ["OUT__0"])
    np.testing.assert_array_equal(out["OUT__0"], a * 2)


def test_cuda_request_without_a_gpu_runs_on_cpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    path = _save(tmp_path, _Wrong(), "fallback")
    inst = TorchInstance(path, "cuda:0", 1, {"INPUT__0": "FP32"}, {})
    assert inst.device == "cpu"
