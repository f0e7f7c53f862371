"""services.worker.onnx_options: Triton's onnxruntime-backend options -> ORT
options, every parameter and its errors; and an instance built with them on
the CPU execution provider still loads and answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from services.worker.numeric_policy import FP32_TOLERANCE, InvalidParameter
from services.worker.onnx_options import (
    DEFAULT_CUDNN_CONV_ALGO_SEARCH,
    OrtOptionError,
    OrtOptions,
    gpu_providers,
    ort_options,
    parse_bool,
    parse_int,
    parse_uint,
    tensorrt_options,
)
from services.worker.tensor_sessions import create_backend
from stageserve.config import ExecutionAccelerator, parse_config_text, to_spec
from stageserve_tools import examples


def gpu(parameters: dict[str, str] | None = None, *accelerators: ExecutionAccelerator, **kw):
    return ort_options(parameters or {}, gpu=True, gpu_accelerators=accelerators, **kw)


def cuda(parameters: dict[str, str] | None = None, *accelerators: ExecutionAccelerator):
    options = gpu(parameters, *accelerators)
    assert options.cuda is not None
    return options.cuda


# --------------------------------------------------------------------------
# Triton's value parsers


def test_parse_int_reads_like_stoi() -> None:
    assert parse_int("3") == 3
    assert parse_int(" -2") == -2
    assert parse_int("+7") == 7
    assert parse_int("12abc") == 12  # std::stoi stops at the first non-digit
    for bad in ("", "abc", "-", " x1"):
        with pytest.raises(OrtOptionError, match=f"failed to convert '{bad}' to integral number"):
            parse_int(bad)


def test_parse_uint_refuses_negatives_and_words() -> None:
    assert parse_uint("4294967296") == 4294967296
    for bad in ("-1", "lots"):
        with pytest.raises(OrtOptionError, match="to unsigned long long integral number"):
            parse_uint(bad)


def test_parse_bool_takes_triton_spellings() -> None:
    for yes in ("true", "TRUE", "on", "1"):
        assert parse_bool(yes) is True
    for no in ("false", "Off", "0"):
        assert parse_bool(no) is False
    with pytest.raises(InvalidParameter, match="failed to convert 'yes' to boolean"):
        parse_bool("yes")


# --------------------------------------------------------------------------
# session options (every instance)


def test_defaults_on_cpu_use_no_gpu_provider() -> None:
    options = ort_options({}, gpu=False)
    assert options == OrtOptions()
    assert options.cuda is None and options.tensorrt is None


def test_execution_mode() -> None:
    assert not ort_options({"execution_mode": "0"}, gpu=False).parallel_execution
    assert ort_options({"execution_mode": "1"}, gpu=False).parallel_execution
    with pytest.raises(
        OrtOptionError,
        match="Expected values for  execution_mode are 0 or 1 but got 2 .",
    ):
        ort_options({"execution_mode": "2"}, gpu=False)
    with pytest.raises(InvalidParameter, match="failed to convert 'fast'"):
        ort_options({"execution_mode": "fast"}, gpu=False)


def test_thread_counts() -> None:
    options = ort_options({"intra_op_thread_count": "3", "inter_op_thread_count": "2"}, gpu=False)
    assert (options.intra_op_threads, options.inter_op_threads) == (3, 2)
    assert ort_options({"inter_op_thread_count": "-4"}, gpu=False).inter_op_threads == 0
    with pytest.raises(InvalidParameter, match="failed to convert 'many' to integral number"):
        ort_options({"intra_op_thread_count": "many"}, gpu=False)


def test_memory_switches_and_config_entries() -> None:
    options = ort_options(
        {
            "enable_mem_arena": "0",
            "enable_mem_pattern": "true",
            "session.use_device_allocator_for_initializers": "1",
            "memory.enable_memory_arena_shrinkage": "cpu:0",
        },
        gpu=False,
    )
    assert options.cpu_mem_arena is False
    assert options.mem_pattern is True
    assert options.session_entries == {"session.use_device_allocator_for_initializers": "1"}
    assert options.run_entries == {"memory.enable_memory_arena_shrinkage": "cpu:0"}
    with pytest.raises(InvalidParameter, match="failed to convert 'maybe' to boolean"):
        ort_options({"enable_mem_arena": "maybe"}, gpu=False)
    with pytest.raises(InvalidParameter, match="failed to convert 'x' to boolean"):
        ort_options({"enable_mem_pattern": "x"}, gpu=False)


@pytest.mark.parametrize(
    ("level", "name"),
    [
        (0, "ORT_ENABLE_ALL"),
        (-1, "ORT_ENABLE_BASIC"),
        (1, "ORT_ENABLE_EXTENDED"),
        (2, "ORT_DISABLE_ALL"),
        (7, "ORT_ENABLE_ALL"),
    ],
)
def test_graph_levels(level: int, name: str) -> None:
    assert ort_options({}, gpu=False, graph_level=level).graph_level == name


def test_cpu_accelerators_are_refused_as_by_triton_without_openvino() -> None:
    with pytest.raises(
        OrtOptionError, match="unknown Execution Accelerator 'openvino' is requested"
    ):
        ort_options({}, gpu=False, cpu_accelerators=[ExecutionAccelerator("openvino")])


# --------------------------------------------------------------------------
# CUDA execution provider (GPU instances)


def test_gpu_defaults_tf32_and_the_search_the_shapes_call_for() -> None:
    assert DEFAULT_CUDNN_CONV_ALGO_SEARCH == "HEURISTIC"
    options = ort_options({}, gpu=True, device_id=3)
    assert options.cuda == {
        "cudnn_conv_algo_search": DEFAULT_CUDNN_CONV_ALGO_SEARCH,
        "use_tf32": "1",
        "device_id": "3",
    }
    assert options.tensorrt is None
    # padded to one size, it sees one shape: Triton's EXHAUSTIVE search
    one = ort_options({}, gpu=True, device_id=3, one_shape=True)
    assert one.cuda is not None and one.cuda["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    assert cuda({"cudnn_conv_algo_search": "2"})["cudnn_conv_algo_search"] == "DEFAULT"
    fp32 = ort_options({"allow_tf32": "false"}, gpu=True, device_id=0, one_shape=True)
    assert fp32.cuda is not None and fp32.cuda["use_tf32"] == "0"


@pytest.mark.parametrize(
    ("value", "expected"), [("0", "EXHAUSTIVE"), ("1", "HEURISTIC"), ("2", "DEFAULT")]
)
def test_cudnn_conv_algo_search(value: str, expected: str) -> None:
    assert cuda({"cudnn_conv_algo_search": value})["cudnn_conv_algo_search"] == expected


def test_bad_cudnn_conv_algo_search() -> None:
    with pytest.raises(
        OrtOptionError, match="unsupported cudnn_conv_algo_search value '3' is requested"
    ):
        gpu({"cudnn_conv_algo_search": "3"})
    with pytest.raises(InvalidParameter, match="failed to convert 'EXHAUSTIVE' to integral"):
        gpu({"cudnn_conv_algo_search": "EXHAUSTIVE"})


def test_gpu_mem_limit() -> None:
    assert cuda({"gpu_mem_limit": "4294967200"})["gpu_mem_limit"] == "4294967200"
    assert "gpu_mem_limit" not in cuda()  # ORT's default: SIZE_MAX
    # ORT parses the whole value: a size with a unit must not become 4 bytes
    for bad in ("4GB", "-1", "lots"):
        with pytest.raises(OrtOptionError, match=f"'{bad}' to unsigned long long"):
            gpu({"gpu_mem_limit": bad})


@pytest.mark.parametrize(
    ("value", "expected"), [("0", "kNextPowerOfTwo"), ("1", "kSameAsRequested")]
)
def test_arena_extend_strategy(value: str, expected: str) -> None:
    assert cuda({"arena_extend_strategy": value})["arena_extend_strategy"] == expected


def test_bad_arena_extend_strategy() -> None:
    with pytest.raises(
        OrtOptionError, match="unsupported arena_extend_strategy value '2' is requested"
    ):
        gpu({"arena_extend_strategy": "2"})


def test_do_copy_in_default_stream() -> None:
    assert cuda({"do_copy_in_default_stream": "false"})["do_copy_in_default_stream"] == "0"
    assert cuda({"do_copy_in_default_stream": "1"})["do_copy_in_default_stream"] == "1"
    with pytest.raises(InvalidParameter, match="failed to convert 'sometimes' to boolean"):
        gpu({"do_copy_in_default_stream": "sometimes"})


def test_cuda_accelerator_parameters_pass_to_the_provider() -> None:
    acc = ExecutionAccelerator(
        "cuda",
        {
            "cudnn_conv_use_max_workspace": "0",
            "use_ep_level_unified_stream": "1",
            "enable_cuda_graph": "1",
            "cudnn_conv_algo_search": "DEFAULT",
        },
    )
    options = cuda({}, acc)
    assert options["cudnn_conv_use_max_workspace"] == "0"
    assert options["use_ep_level_unified_stream"] == "1"
    assert options["enable_cuda_graph"] == "1"
    # the accelerator's explicit value wins over StageServe's default ...
    assert options["cudnn_conv_algo_search"] == "DEFAULT"
    # ... and the model parameter of the same option wins over the accelerator's
    assert cuda({"cudnn_conv_algo_search": "0"}, acc)["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    with pytest.raises(InvalidParameter, match="failed to convert 'yes' to boolean"):
        gpu({}, ExecutionAccelerator("cuda", {"use_ep_level_unified_stream": "yes"}))


def test_unknown_gpu_accelerator() -> None:
    with pytest.raises(OrtOptionError, match="unknown Execution Accelerator 'rocm' is requested"):
        gpu({}, ExecutionAccelerator("rocm"))


def test_tf32_switch() -> None:
    assert cuda({"allow_tf32": "true"})["use_tf32"] == "1"
    assert cuda({"allow_tf32": "0"})["use_tf32"] == "0"
    # the CUDA EP's own option, named on the cuda accelerator, wins
    acc = ExecutionAccelerator("cuda", {"use_tf32": "1"})
    assert cuda({"allow_tf32": "false"}, acc)["use_tf32"] == "1"
    with pytest.raises(InvalidParameter, match="failed to convert 'fast' to boolean"):
        gpu({"allow_tf32": "fast"})


def test_cpu_instances_ignore_gpu_options_as_triton_does() -> None:
    # Triton's backend reads the CUDA options for GPU instances only
    options = ort_options(
        {"cudnn_conv_algo_search": "9", "gpu_mem_limit": "lots"},
        gpu=False,
        gpu_accelerators=[ExecutionAccelerator("rocm")],
    )
    assert options.cuda is None


# --------------------------------------------------------------------------
# TensorRT execution provider


def test_tensorrt_parameters_map_to_trt_options() -> None:
    options = gpu(
        {},
        ExecutionAccelerator(
            "tensorrt",
            {
                "precision_mode": "FP16",
                "max_workspace_size_bytes": "1073741824",
                "trt_engine_cache_enable": "1",
                "trt_engine_cache_path": "/tmp/trt",
                "trt_builder_optimization_level": "3",
                "int8_use_native_calibration_table": "false",
            },
        ),
        device_id=1,
    )
    assert options.tensorrt == {
        "trt_fp16_enable": "1",
        "trt_max_workspace_size": "1073741824",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": "/tmp/trt",
        "trt_builder_optimization_level": "3",
        "trt_int8_use_native_calibration_table": "false",
        "device_id": "1",
    }
    assert options.cuda is not None and options.cuda["device_id"] == "1"  # CUDA EP falls back


def test_tensorrt_precision_modes() -> None:
    assert tensorrt_options({"precision_mode": "FP32"}, 0) == {"device_id": "0"}
    assert tensorrt_options({"precision_mode": "BF16"}, 0)["trt_bf16_enable"] == "1"
    assert tensorrt_options({"precision_mode": "INT8"}, 0)["trt_int8_enable"] == "1"
    with pytest.raises(OrtOptionError, match="unsupported precision mode 'FP8' is requested"):
        tensorrt_options({"precision_mode": "FP8"}, 0)


def test_tensorrt_bad_values() -> None:
    with pytest.raises(
        OrtOptionError,
        match="unknown parameter 'turbo' is provided for TensorRT Execution Accelerator",
    ):
        tensorrt_options({"turbo": "1"}, 0)
    with pytest.raises(InvalidParameter, match="failed to convert 'x' to boolean"):
        tensorrt_options({"trt_engine_cache_enable": "x"}, 0)
    with pytest.raises(InvalidParameter, match="failed to convert 'big' to unsigned long long"):
        tensorrt_options({"max_workspace_size_bytes": "big"}, 0)
    with pytest.raises(InvalidParameter, match="failed to convert 'one' to integral number"):
        tensorrt_options({"trt_dla_core": "one"}, 0)


GPU_BUILD = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT_BUILD = ["TensorrtExecutionProvider", *GPU_BUILD]


def test_gpu_providers_put_tensorrt_first_when_asked() -> None:
    plain = gpu({}, device_id=2)
    assert gpu_providers(plain, GPU_BUILD, 2) == [
        ("CUDAExecutionProvider", plain.cuda),
        "CPUExecutionProvider",
    ]
    trt = gpu({}, ExecutionAccelerator("tensorrt", {"precision_mode": "FP16"}), device_id=2)
    assert gpu_providers(trt, TRT_BUILD, 2) == [
        ("TensorrtExecutionProvider", {"trt_fp16_enable": "1", "device_id": "2"}),
        ("CUDAExecutionProvider", trt.cuda),
        "CPUExecutionProvider",
    ]


def test_tensorrt_on_an_onnxruntime_without_it_fails_as_triton_without_tensorrt() -> None:
    trt = gpu({}, ExecutionAccelerator("tensorrt"))
    with pytest.raises(
        OrtOptionError,
        match="unknown Execution Accelerator 'tensorrt' is requested: this onnxruntime has no "
        "TensorrtExecutionProvider",
    ):
        gpu_providers(trt, GPU_BUILD, 0)


# --------------------------------------------------------------------------
# from config.pbtxt to a running session


MLP_OPTIONS = """
parameters { key: "execution_mode" value { string_value: "1" } }
parameters { key: "inter_op_thread_count" value { string_value: "2" } }
parameters { key: "enable_mem_arena" value { string_value: "1" } }
parameters { key: "enable_mem_pattern" value { string_value: "0" } }
parameters { key: "memory.enable_memory_arena_shrinkage" value { string_value: "cpu:0" } }
parameters { key: "session.use_device_allocator_for_initializers" value { string_value: "1" } }
parameters { key: "cudnn_conv_algo_search" value { string_value: "1" } }
parameters { key: "gpu_mem_limit" value { string_value: "1073741824" } }
parameters { key: "allow_tf32" value { string_value: "false" } }
optimization {
  graph { level: 1 }
  execution_accelerators {
    gpu_execution_accelerator [
      { name: "cuda" parameters { key: "cudnn_conv_use_max_workspace" value: "0" } }
    ]
  }
}
"""

SIZES = (16, 32, 4)


def _mlp(tmp_path: Path, extra: str) -> tuple:
    model_dir = examples.write_mlp(tmp_path, "mlp", sizes=SIZES, max_batch_size=8)
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text() + extra)
    spec = to_spec(parse_config_text(config.read_text()))
    return spec, model_dir / "1" / "model.onnx"


def test_config_reaches_the_spec(tmp_path: Path) -> None:
    spec, _ = _mlp(tmp_path, MLP_OPTIONS)
    assert spec.graph_level == 1
    assert spec.gpu_accelerators == (
        ExecutionAccelerator("cuda", {"cudnn_conv_use_max_workspace": "0"}),
    )
    assert spec.cpu_accelerators == ()


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_session_with_every_option_loads_and_answers(tmp_path: Path, device: str) -> None:
    # cuda:0 with fallback: the CUDA options are built, then unused on this
    # CPU-only onnxruntime, and the session runs on the CPU as before
    spec, path = _mlp(tmp_path, MLP_OPTIONS)
    session = create_backend(spec, path, device, threads=1)
    x = np.random.default_rng(1).standard_normal((5, SIZES[0]), dtype=np.float32)
    got = session.run({"INPUT0": x})["OUTPUT0"]
    want = examples.mlp_reference(x, examples.mlp_weights(SIZES))
    np.testing.assert_allclose(got, want, rtol=0, atol=FP32_TOLERANCE)
    options = session.options  # type: ignore[attr-defined]
    assert (options.cuda is not None) == (device != "cpu")
    # what the session was built with, read back from ONNX Runtime
    built = session._session.get_session_options()  # type: ignore[attr-defined]
    assert built.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert built.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert built.inter_op_num_threads == 2
    assert built.enable_mem_pattern is False
    assert built.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"


def test_a_bad_value_fails_the_load(tmp_path: Path) -> None:
    spec, path = _mlp(
        tmp_path, 'parameters { key: "cudnn_conv_algo_search" value { string_value: "5" } }\n'
    )
    with pytest.raises(OrtOptionError, match="unsupported cudnn_conv_algo_search value '5'"):
        create_backend(spec, path, "cuda:0", threads=1)
    create_backend(spec, path, "cpu", threads=1)  # a CPU instance never reads it (Triton)


def test_a_bad_run_entry_fails_the_run_not_the_server(tmp_path: Path) -> None:
    # ORT checks the arena-shrinkage device when it runs: gpu:0 on a CPU session
    shrink = '"memory.enable_memory_arena_shrinkage" value { string_value: "gpu:0" }'
    spec, path = _mlp(tmp_path, f"parameters {{ key: {shrink} }}\n")
    session = create_backend(spec, path, "cpu", threads=1)
    with pytest.raises(Exception, match="onnxruntime run failed"):
        session.run({"INPUT0": np.zeros((1, SIZES[0]), np.float32)})
