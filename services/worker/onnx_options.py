"""ONNX Runtime session and execution-provider options from a model's configuration.

A pure translation, following Triton's onnxruntime backend for names, values
and error messages:

* model ``parameters``: ``execution_mode`` (0 sequential, 1 parallel),
  ``intra_op_thread_count``, ``inter_op_thread_count``, ``enable_mem_arena``,
  ``enable_mem_pattern``, ``session.use_device_allocator_for_initializers``
  (a session config entry), ``memory.enable_memory_arena_shrinkage`` (a run
  config entry), and for GPU instances the CUDA EP parameters
  ``cudnn_conv_algo_search`` (0 EXHAUSTIVE, 1 HEURISTIC, 2 DEFAULT),
  ``gpu_mem_limit``, ``arena_extend_strategy`` (0 kNextPowerOfTwo,
  1 kSameAsRequested) and ``do_copy_in_default_stream``;
* ``optimization { graph { level } }``: -1 basic, 1 extended, 2 none,
  anything else all optimizations;
* ``optimization { execution_accelerators { gpu_execution_accelerator } }``:
  ``cuda`` (its parameters go to the CUDA EP as written) and ``tensorrt``
  (Triton's TensorRT parameters, mapped to the TensorRT EP's ``trt_*`` options);
  ``cpu_execution_accelerator``: none is supported (Triton's answer for
  ``openvino`` on a build without OpenVINO).

GPU options are read for GPU instances only: Triton's backend never looks at
them for a KIND_CPU instance, so a model with a bad CUDA value still loads there.

Beyond Triton, chosen for the GPU (docs/gpu.md):

* ``cudnn_conv_algo_search`` defaults to EXHAUSTIVE (Triton's and ORT's
  default) only for an instance that sees one batch shape (it pads every
  batch to one size), else to HEURISTIC: EXHAUSTIVE benchmarks every
  convolution again whenever the input shape changes, and a dynamic batcher
  forms up to max_batch_size shapes.
* TF32 follows numeric_policy.py (on by default, as the CUDA EP's own
  ``use_tf32`` default); the model parameter ``allow_tf32`` (shared with the
  PyTorch backend) or the ``cuda`` accelerator's own ``use_tf32`` sets it.

An explicit value always wins over a default: a deprecated model parameter
over the ``cuda`` accelerator's value of the same option, and either over
StageServe's default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.worker.numeric_policy import InvalidParameter, parse_bool, tf32_requested
from stageserve.config import ExecutionAccelerator

#: cuDNN convolution algorithm search when the model names none. The CUDA EP
#: redoes a convolution's set-up whenever the input shape differs from the
#: previous run's, searching again. Measured on an H100 with the bench.gpu
#: CNN (docs/benchmarks.md), ms per run of batch 32 at a fixed shape /
#: alternating 32 and 25: EXHAUSTIVE 1.78 / 155, HEURISTIC 2.21 / 25,
#: DEFAULT 3.13 / 11.5. So an instance that sees one shape (it pads every
#: batch to max_batch_size, pad_policy.py's default for ONNX Runtime on a
#: GPU) searches EXHAUSTIVEly, as Triton does by default; one whose batches
#: vary takes HEURISTIC.
ONE_SHAPE_CUDNN_CONV_ALGO_SEARCH = "EXHAUSTIVE"
DEFAULT_CUDNN_CONV_ALGO_SEARCH = "HEURISTIC"

TENSORRT = "tensorrt"
CUDA = "cuda"
CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
TENSORRT_EP = "TensorrtExecutionProvider"

_CONV_ALGO_SEARCH = {0: "EXHAUSTIVE", 1: "HEURISTIC", 2: "DEFAULT"}
_ARENA_EXTEND = {0: "kNextPowerOfTwo", 1: "kSameAsRequested"}
# optimization { graph { level } } -> ORT GraphOptimizationLevel names
_GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}
_GRAPH_DEFAULT = "ORT_ENABLE_ALL"

# Triton's TensorRT accelerator parameters: name -> (TensorRT EP option, kind).
# kind: "int", "uint", "bool" are checked as Triton checks them; "str" passes.
_TRT_PARAMETERS: dict[str, tuple[str, str]] = {
    "max_workspace_size_bytes": ("trt_max_workspace_size", "uint"),
    "trt_max_partition_iterations": ("trt_max_partition_iterations", "int"),
    "trt_min_subgraph_size": ("trt_min_subgraph_size", "int"),
    "int8_calibration_table_name": ("trt_int8_calibration_table_name", "str"),
    "int8_use_native_calibration_table": ("trt_int8_use_native_calibration_table", "bool"),
    "trt_dla_enable": ("trt_dla_enable", "bool"),
    "trt_dla_core": ("trt_dla_core", "int"),
    "trt_engine_cache_enable": ("trt_engine_cache_enable", "bool"),
    "trt_engine_cache_path": ("trt_engine_cache_path", "str"),
    "trt_engine_cache_prefix": ("trt_engine_cache_prefix", "str"),
    "trt_dump_subgraphs": ("trt_dump_subgraphs", "bool"),
    "trt_force_sequential_engine_build": ("trt_force_sequential_engine_build", "bool"),
    "trt_context_memory_sharing_enable": ("trt_context_memory_sharing_enable", "bool"),
    "trt_layer_norm_fp32_fallback": ("trt_layer_norm_fp32_fallback", "bool"),
    "trt_timing_cache_enable": ("trt_timing_cache_enable", "bool"),
    "trt_timing_cache_path": ("trt_timing_cache_path", "str"),
    "trt_force_timing_cache": ("trt_force_timing_cache", "bool"),
    "trt_detailed_build_log": ("trt_detailed_build_log", "bool"),
    "trt_build_heuristics_enable": ("trt_build_heuristics_enable", "bool"),
    "trt_sparsity_enable": ("trt_sparsity_enable", "bool"),
    "trt_builder_optimization_level": ("trt_builder_optimization_level", "int"),
    "trt_auxiliary_streams": ("trt_auxiliary_streams", "int"),
    "trt_tactic_sources": ("trt_tactic_sources", "str"),
    "trt_extra_plugin_lib_paths": ("trt_extra_plugin_lib_paths", "str"),
    "trt_profile_min_shapes": ("trt_profile_min_shapes", "str"),
    "trt_profile_max_shapes": ("trt_profile_max_shapes", "str"),
    "trt_profile_opt_shapes": ("trt_profile_opt_shapes", "str"),
    "trt_cuda_graph_enable": ("trt_cuda_graph_enable", "bool"),
    "trt_dump_ep_context_model": ("trt_dump_ep_context_model", "bool"),
    "trt_ep_context_file_path": ("trt_ep_context_file_path", "str"),
    "trt_ep_context_embed_mode": ("trt_ep_context_embed_mode", "int"),
}
_TRT_PRECISION = {"FP16": "trt_fp16_enable", "BF16": "trt_bf16_enable", "INT8": "trt_int8_enable"}
# cuda accelerator parameters Triton checks as booleans before passing them on
_CUDA_BOOLS = ("do_copy_in_default_stream", "use_ep_level_unified_stream")


class OrtOptionError(InvalidParameter):
    """A configuration value ONNX Runtime options cannot take (Triton: INVALID_ARG)."""


@dataclass(frozen=True)
class OrtOptions:
    """What one ONNX Runtime session of a model instance is built with.

    ``cuda`` / ``tensorrt`` are the provider options for a GPU instance (None:
    that provider is not used); ``session_entries`` / ``run_entries`` are ORT
    config entries for the session and for every run."""

    graph_level: str = _GRAPH_DEFAULT
    parallel_execution: bool = False
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    cpu_mem_arena: bool | None = None
    mem_pattern: bool | None = None
    session_entries: dict[str, str] = field(default_factory=dict)
    run_entries: dict[str, str] = field(default_factory=dict)
    cuda: dict[str, str] | None = None
    tensorrt: dict[str, str] | None = None


# --------------------------------------------------------------------------
# Triton's value parsers (backend_common.cc), with its messages


def parse_int(value: str) -> int:
    """std::stoi as Triton uses it: leading spaces, a sign and digits; what
    follows the digits is ignored."""
    text = value.lstrip()
    end = 1 if text[:1] in "+-" else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    digits = text[:end]
    if not digits.lstrip("+-"):
        raise OrtOptionError(f"failed to convert '{value}' to integral number")
    return int(digits)


def parse_uint(value: str, *, whole: bool = False) -> int:
    """std::stoull as Triton uses it; a negative number is refused here
    (stoull would wrap it to a huge size). `whole`: nothing may follow the
    digits (ORT's own parse of a size, e.g. gpu_mem_limit)."""
    error = OrtOptionError(f"failed to convert '{value}' to unsigned long long integral number")
    if whole and not value.strip().isdigit():
        raise error
    try:
        number = parse_int(value)
    except OrtOptionError:
        raise error from None
    if number < 0:
        raise error
    return number


def _flag(value: bool) -> str:
    return "1" if value else "0"


# --------------------------------------------------------------------------


def ort_options(
    parameters: Mapping[str, str],
    *,
    gpu: bool,
    device_id: int = 0,
    gpu_accelerators: Sequence[ExecutionAccelerator] = (),
    cpu_accelerators: Sequence[ExecutionAccelerator] = (),
    graph_level: int = 0,
    one_shape: bool = False,
) -> OrtOptions:
    """The options of one instance's session; `gpu`: a GPU instance on
    `device_id`; `one_shape`: its batches are padded to one size, so it sees
    one input shape. Raises OrtOptionError with Triton's message for a bad
    value."""
    execution_mode = parse_int(parameters.get("execution_mode", "0"))
    if execution_mode not in (0, 1):
        raise OrtOptionError(
            "Invalid configuration value provided. Expected values for  execution_mode "
            f"are 0 or 1 but got {execution_mode} ."
        )
    session_entries = {}
    key = "session.use_device_allocator_for_initializers"
    if key in parameters:
        session_entries[key] = parameters[key]
    run_entries = {}
    key = "memory.enable_memory_arena_shrinkage"
    if key in parameters:
        run_entries[key] = parameters[key]
    for accelerator in cpu_accelerators:
        raise OrtOptionError(f"unknown Execution Accelerator '{accelerator.name}' is requested")

    cuda: dict[str, str] | None = None
    tensorrt: dict[str, str] | None = None
    if gpu:
        cuda, tensorrt = _gpu_providers(parameters, device_id, gpu_accelerators)
        search = ONE_SHAPE_CUDNN_CONV_ALGO_SEARCH if one_shape else DEFAULT_CUDNN_CONV_ALGO_SEARCH
        cuda.setdefault("cudnn_conv_algo_search", search)

    return OrtOptions(
        graph_level=_GRAPH_LEVELS.get(graph_level, _GRAPH_DEFAULT),
        parallel_execution=execution_mode == 1,
        intra_op_threads=max(0, parse_int(parameters.get("intra_op_thread_count", "0"))),
        inter_op_threads=max(0, parse_int(parameters.get("inter_op_thread_count", "0"))),
        cpu_mem_arena=_optional_bool(parameters, "enable_mem_arena"),
        mem_pattern=_optional_bool(parameters, "enable_mem_pattern"),
        session_entries=session_entries,
        run_entries=run_entries,
        cuda=cuda,
        tensorrt=tensorrt,
    )


def _optional_bool(parameters: Mapping[str, str], name: str) -> bool | None:
    return parse_bool(parameters[name]) if name in parameters else None


def _gpu_providers(
    parameters: Mapping[str, str], device_id: int, accelerators: Sequence[ExecutionAccelerator]
) -> tuple[dict[str, str], dict[str, str] | None]:
    cuda: dict[str, str] = {}
    tensorrt: dict[str, str] | None = None
    for accelerator in accelerators:
        if accelerator.name == TENSORRT:
            tensorrt = tensorrt_options(accelerator.parameters, device_id)
        elif accelerator.name == CUDA:
            for key, value in accelerator.parameters.items():
                if key in _CUDA_BOOLS:
                    parse_bool(value)
                if key and value:
                    cuda[key] = value
        else:
            raise OrtOptionError(f"unknown Execution Accelerator '{accelerator.name}' is requested")

    for name, values in (
        ("cudnn_conv_algo_search", _CONV_ALGO_SEARCH),
        ("arena_extend_strategy", _ARENA_EXTEND),
    ):
        if name in parameters:
            number = parse_int(parameters[name])
            if number not in values:
                raise OrtOptionError(f"unsupported {name} value '{number}' is requested")
            cuda[name] = values[number]

    if "gpu_mem_limit" in parameters:
        cuda["gpu_mem_limit"] = str(parse_uint(parameters["gpu_mem_limit"], whole=True))

    if "do_copy_in_default_stream" in parameters:
        cuda["do_copy_in_default_stream"] = _flag(
            parse_bool(parameters["do_copy_in_default_stream"])
        )

    if "use_tf32" not in cuda:
        cuda["use_tf32"] = _flag(tf32_requested(parameters))
    cuda["device_id"] = str(device_id)
    return cuda, tensorrt


def tensorrt_options(parameters: Mapping[str, str], device_id: int) -> dict[str, str]:
    """Triton's TensorRT accelerator parameters -> the TensorRT EP's options."""
    out: dict[str, str] = {}
    for name, value in parameters.items():
        if name == "precision_mode":
            if value in _TRT_PRECISION:
                out[_TRT_PRECISION[value]] = "1"
            elif value != "FP32":
                raise OrtOptionError(f"unsupported precision mode '{value}' is requested")
            continue
        if name not in _TRT_PARAMETERS:
            raise OrtOptionError(
                f"unknown parameter '{name}' is provided for TensorRT Execution Accelerator"
            )
        option, kind = _TRT_PARAMETERS[name]
        if kind == "int":
            parse_int(value)
        elif kind == "uint":
            parse_uint(value)
        elif kind == "bool":
            parse_bool(value)
        if value:
            out[option] = value
    out["device_id"] = str(device_id)
    return out


def gpu_providers(
    options: OrtOptions, available: Sequence[str], device_id: int
) -> list[str | tuple[str, dict[str, str]]]:
    """The providers of a GPU instance's session, in ORT's order of preference:
    TensorRT (when asked), CUDA, then the CPU for what neither runs.
    `available`: onnxruntime.get_available_providers(). A TensorRT accelerator
    on an onnxruntime without its provider is refused as by Triton's backend
    built without TensorRT."""
    providers: list[str | tuple[str, dict[str, str]]] = [
        (CUDA_EP, options.cuda or {"device_id": str(device_id)}),
        CPU_EP,
    ]
    if options.tensorrt is not None:
        if TENSORRT_EP not in available:
            raise OrtOptionError(
                "unknown Execution Accelerator 'tensorrt' is requested: this onnxruntime "
                f"has no {TENSORRT_EP} (has {', '.join(available)})"
            )
        providers.insert(0, (TENSORRT_EP, options.tensorrt))
    return providers
