"""The worker's ONNX Runtime backend: one ``OnnxInstance`` per model instance.

Tensors cross this boundary in StageServe's shared numpy representation
(``stageserve.tensors``): fixed-size types as their numpy dtype, BF16 as
uint16 arrays holding the raw bfloat16 words, BYTES as object arrays of
``bytes``. This module converts to and from what ONNX Runtime's Python API
needs:

* BF16 inputs are wrapped, without copying, in an ``OrtValue`` of ONNX type
  bfloat16. BF16 outputs cannot become numpy arrays inside ORT, so when one
  is requested the run goes through IO binding and the output's raw words
  are copied out as uint16.
* BYTES travel as object arrays of ``str``, the only form ORT's Python
  binding carries exactly (measurements in onnx_strings.py). When the graph
  only moves strings (``bytes_transparent``), each byte becomes one Latin-1
  code point and back: any bytes (NUL, invalid UTF-8) pass unchanged, as in
  Triton. Otherwise the model reads the text, so it gets UTF-8 text, and
  bytes that are not valid UTF-8 raise ``InvalidInputError`` before the run
  (the client gets INVALID_ARGUMENT naming the limitation).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from services.worker.backends import BackendError, InvalidInputError, parse_device
from services.worker.onnx_options import (
    CPU_EP,
    OrtOptionError,
    OrtOptions,
    gpu_providers,
    ort_options,
)
from services.worker.onnx_strings import bytes_transparent
from stageserve.datatypes import DataType, from_triton

log = logging.getLogger(__name__)

_BF16_ONNX = 16  # onnx.TensorProto.BFLOAT16

# ORT type strings ("tensor(float)") -> Triton datatype names.
_ORT_TYPE_TO_TRITON: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}


@dataclass(frozen=True)
class TensorInfo:
    """One model input/output as the ONNX file declares it.

    ``datatype`` is the Triton name ("FP32"), or None for a type Triton cannot
    express (sequences, maps, float8...); ``ort_type`` is ORT's own spelling.
    ``shape`` uses -1 for symbolic or unknown dimensions; ``dim_names`` keeps
    the symbolic names (None where the dimension is fixed).
    """

    name: str
    datatype: str | None
    ort_type: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...]


@dataclass(frozen=True)
class ModelDescription:
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    providers: tuple[str, ...]

    def input(self, name: str) -> TensorInfo:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def output(self, name: str) -> TensorInfo:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)


def _tensor_info(arg: ort.NodeArg) -> TensorInfo:
    shape: list[int] = []
    names: list[str | None] = []
    for d in arg.shape or ():
        if isinstance(d, int) and d >= 0:
            shape.append(d)
            names.append(None)
        else:
            shape.append(-1)
            names.append(d if isinstance(d, str) else None)
    return TensorInfo(
        name=arg.name,
        datatype=_ORT_TYPE_TO_TRITON.get(arg.type),
        ort_type=arg.type,
        shape=tuple(shape),
        dim_names=tuple(names),
    )


#: what a GPU instance on an onnxruntime that cannot use the GPU should do instead
NO_CUDA_EP_FIX = (
    "install onnxruntime-gpu with its CUDA libraries in place of onnxruntime, "
    "or give the model a KIND_CPU instance_group"
)


class OnnxInstance:
    """One ONNX Runtime session serving one model instance.

    ``input_types`` / ``output_types`` map tensor names to Triton datatypes as
    the model configuration declares them; they are checked against the ONNX
    file at load time. ``output_types`` may name a subset of the model's
    outputs. Passing None takes the types from the model file.

    ``device`` "cuda:N" without a usable CUDA execution provider: with
    ``cpu_fallback`` the session runs on the CPU with a warning, else the
    load fails with BackendError ("GPU instances not supported", Triton's
    answer on a build without GPU support).

    ``options`` are the session's ONNX Runtime options from the model
    configuration (onnx_options.py); None: the defaults of a model that sets
    nothing. A TensorRT accelerator on an onnxruntime without the TensorRT
    execution provider fails the load as Triton's backend built without
    TensorRT does ("unknown Execution Accelerator 'tensorrt' is requested").

    ``run`` may be called from several threads at once (ORT sessions are
    thread-safe for Run), so a fast model may run inline on the event loop.
    """

    thread_bound = False

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str = "cpu",
        intra_op_threads: int = 0,
        input_types: Mapping[str, str] | None = None,
        output_types: Mapping[str, str] | None = None,
        *,
        inter_op_threads: int = 0,
        log_severity: int = 3,
        cpu_fallback: bool = True,
        options: OrtOptions | None = None,
    ) -> None:
        self.model_path = os.fspath(model_path)
        kind, device_id = parse_device(device)
        self.device = f"cuda:{device_id}" if kind == "cuda" else "cpu"
        if options is None:
            options = ort_options({}, gpu=kind == "cuda", device_id=device_id)
        self.options = options

        if not os.path.isfile(self.model_path):
            raise BackendError(f"model file not found: {self.model_path}")

        available = ort.get_available_providers()
        use_trt = False
        providers: list[str | tuple[str, dict[str, str]]]
        if kind == "cuda" and "CUDAExecutionProvider" in available:
            try:
                providers = gpu_providers(options, available, device_id)
            except OrtOptionError as exc:
                raise OrtOptionError(f"{self.model_path}: {exc}") from None
            use_trt = options.tensorrt is not None
        else:
            if kind == "cuda" and not cpu_fallback:
                raise BackendError(
                    f"{self.model_path}: GPU instances not supported: this onnxruntime "
                    f"has no CUDAExecutionProvider (has {', '.join(available)}); "
                    f"{NO_CUDA_EP_FIX}"
                )
            if kind == "cuda":
                log.warning(
                    "%s: device %s requested but this onnxruntime has no "
                    "CUDAExecutionProvider (has %s); running on CPU",
                    self.model_path,
                    self.device,
                    ", ".join(available),
                )
                self.device = "cpu"
            providers = [CPU_EP]

        opts = ort.SessionOptions()
        if intra_op_threads and intra_op_threads > 0:
            opts.intra_op_num_threads = int(intra_op_threads)
        inter_op_threads = inter_op_threads or options.inter_op_threads
        if inter_op_threads and inter_op_threads > 0:
            opts.inter_op_num_threads = int(inter_op_threads)
        opts.log_severity_level = log_severity
        _apply_session_options(opts, options)
        # Idle ORT threads spin-wait by default; on a machine whose cores are
        # shared with the other stages that burns the CPU they need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")

        try:
            self._session = ort.InferenceSession(
                self.model_path, sess_options=opts, providers=providers
            )
        except Exception as exc:  # ORT raises its own pybind exception types
            raise BackendError(
                f"failed to load ONNX model {self.model_path}: {_short(exc)}"
            ) from exc

        if use_trt and "TensorrtExecutionProvider" not in self._session.get_providers():
            # asked for by name: a silent fall back to the CUDA EP would hide it
            raise BackendError(
                f"{self.model_path}: the TensorRT execution accelerator was requested but "
                "onnxruntime's TensorrtExecutionProvider could not be used (its TensorRT "
                "libraries did not load)"
            )
        if self.device != "cpu" and "CUDAExecutionProvider" not in self._session.get_providers():
            # ORT drops a provider whose libraries fail to load and carries on on CPU
            if not cpu_fallback:
                raise BackendError(
                    f"{self.model_path}: GPU instances not supported: onnxruntime's "
                    f"CUDAExecutionProvider could not be used for {self.device} (its CUDA "
                    f"libraries did not load); {NO_CUDA_EP_FIX}"
                )
            log.warning(
                "%s: CUDAExecutionProvider could not be used for %s; running on CPU",
                self.model_path,
                self.device,
            )
            self.device = "cpu"

        self._run_options: ort.RunOptions | None = None
        if options.run_entries:
            self._run_options = ort.RunOptions()
            for key, value in options.run_entries.items():
                self._run_options.add_run_config_entry(key, value)

        self._desc = ModelDescription(
            inputs=tuple(_tensor_info(a) for a in self._session.get_inputs()),
            outputs=tuple(_tensor_info(a) for a in self._session.get_outputs()),
            providers=tuple(self._session.get_providers()),
        )
        model_in = {t.name: t for t in self._desc.inputs}
        model_out = {t.name: t for t in self._desc.outputs}

        if input_types is None:
            input_types = {n: t.datatype for n, t in model_in.items() if t.datatype}
        if output_types is None:
            output_types = {n: t.datatype for n, t in model_out.items() if t.datatype}

        self.input_types: dict[str, DataType] = {
            n: self._check_tensor("input", n, dt, model_in) for n, dt in input_types.items()
        }
        self.output_types: dict[str, DataType] = {
            n: self._check_tensor("output", n, dt, model_out) for n, dt in output_types.items()
        }
        missing = [n for n in model_in if n not in self.input_types]
        if missing:
            raise BackendError(
                f"{self.model_path}: model input(s) {missing} are not in the configuration "
                f"(configuration has {sorted(self.input_types)})"
            )
        # How BYTES cross the Python API: Latin-1 (exact for any bytes) when the
        # graph only moves strings, else UTF-8 text (see onnx_strings.py).
        self.string_encoding, self.string_note = "utf-8", ""
        if any(
            d.triton == "BYTES" for d in (*self.input_types.values(), *self.output_types.values())
        ):
            exact, why = bytes_transparent(onnx.load(self.model_path, load_external_data=False))
            self.string_encoding = "latin-1" if exact else "utf-8"
            self.string_note = why

    # ------------------------------------------------------------------

    def _check_tensor(
        self, kind: str, name: str, datatype: str, model: Mapping[str, TensorInfo]
    ) -> DataType:
        try:
            dt = from_triton(str(datatype).upper())
        except KeyError:
            raise BackendError(
                f"{self.model_path}: {kind} '{name}' has unknown datatype {datatype!r}"
            ) from None
        info = model.get(name)
        if info is None:
            raise BackendError(
                f"{self.model_path}: configuration {kind} '{name}' is not a model {kind}; "
                f"the model's {kind}s are {sorted(model)}"
            )
        if info.datatype != dt.triton:
            model_dt = from_triton(info.datatype).config_enum if info.datatype else info.ort_type
            raise BackendError(
                f"{self.model_path}: unexpected datatype {dt.config_enum} for {kind} "
                f"'{name}', model provides {model_dt}"
            )
        return dt

    @property
    def providers(self) -> list[str]:
        return list(self._desc.providers)

    def close(self) -> None:
        """Nothing to release early: ORT frees the session with the object."""

    def describe(self) -> ModelDescription:
        """Names, Triton datatypes and shapes of the ONNX file's inputs/outputs."""
        return self._desc

    def in_place_device(self) -> int | None:
        """The CUDA device whose memory this session's IO binding reads its
        inputs from and writes its outputs to (`run_on_device`, the CUDA
        in-place path: services/worker/device_batches.py); None where it has
        no such path: a CPU session (or one ORT moved to the CPU), and a
        TensorRT one (the TensorRT EP takes device memory too, but the path
        is only checked with the CUDA EP first)."""
        if not self.device.startswith("cuda") or self.options.tensorrt is not None:
            return None
        if self._desc.providers[:1] != ("CUDAExecutionProvider",):
            return None
        return int(self.device.partition(":")[2] or 0)

    # ------------------------------------------------------------------

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run once; feeds and results use the shared numpy representation."""
        output_names = self._checked_names(feeds, output_names)
        if any(self.output_types[n].triton == "BF16" for n in output_names):
            return self._run_bound(feeds, output_names)

        ort_feeds = {n: self._to_ort(n, a) for n, a in feeds.items()}
        try:
            results = self._session.run(output_names, ort_feeds, self._run_options)
        except Exception as exc:
            raise BackendError(f"onnxruntime run failed: {_short(exc)}") from exc
        return {n: self._from_numpy(n, r) for n, r in zip(output_names, results, strict=True)}

    def run_on_device(
        self,
        feeds: Mapping[str, ort.OrtValue],
        output_names: Sequence[str],
        device_type: str,
        device_id: int,
    ) -> dict[str, ort.OrtValue]:
        """Run once on OrtValues already in the device's memory (the in-place
        path); the outputs are OrtValues ORT allocates on `device_type`
        `device_id`, left there.

        Ordering: run_with_iobinding does not wait for work the caller put on
        other streams, so the caller finishes its input copies first;
        `synchronize_inputs` / `synchronize_outputs` wait for the providers'
        own work on the bound tensors, and ORT synchronizes its execution
        providers at the end of every run (the run option
        disable_synchronize_execution_providers, which would skip that, is not
        set), so the outputs are complete when this returns."""
        names = self._checked_names(feeds, output_names)
        binding = self._session.io_binding()
        try:
            for n, v in feeds.items():
                binding.bind_ortvalue_input(n, v)
            for n in names:
                binding.bind_output(n, device_type, device_id)
            binding.synchronize_inputs()
            self._session.run_with_iobinding(binding, self._run_options)
            binding.synchronize_outputs()
            values = binding.get_outputs()
        except Exception as exc:
            raise BackendError(f"onnxruntime run failed: {_short(exc)}") from exc
        return dict(zip(names, values, strict=True))

    def _checked_names(self, feeds: Mapping, output_names: Sequence[str] | None) -> list[str]:
        """The outputs to compute (all when None), the feeds checked against the inputs."""
        if output_names is None:
            output_names = list(self.output_types)
        output_names = list(output_names)
        for n in output_names:
            if n not in self.output_types:
                raise BackendError(f"unknown output '{n}'; outputs are {sorted(self.output_types)}")
        missing = [n for n in self.input_types if n not in feeds]
        if missing:
            raise BackendError(f"missing input(s) {missing}")
        extra = [n for n in feeds if n not in self.input_types]
        if extra:
            raise BackendError(f"unknown input(s) {extra}; inputs are {sorted(self.input_types)}")
        return output_names

    def _run_bound(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        """IO-binding path, needed to read bfloat16 outputs."""
        binding = self._session.io_binding()
        keep = []  # keep input buffers alive until the run is done
        for n, a in feeds.items():
            dt = self.input_types[n]
            if dt.triton == "BYTES":
                raise BackendError(
                    f"input '{n}' is BYTES and a requested output is BF16: onnxruntime's "
                    "Python API cannot bind string inputs, which reading BF16 outputs needs"
                )
            v = self._to_ort(n, a)
            if not isinstance(v, ort.OrtValue):
                v = ort.OrtValue.ortvalue_from_numpy(v)
            keep.append(v)
            binding.bind_ortvalue_input(n, v)
        for n in output_names:
            binding.bind_output(n, "cpu")
        try:
            self._session.run_with_iobinding(binding, self._run_options)
            values = binding.get_outputs()
        except Exception as exc:
            raise BackendError(f"onnxruntime run failed: {_short(exc)}") from exc
        out: dict[str, np.ndarray] = {}
        for n, v in zip(output_names, values, strict=True):
            if self.output_types[n].triton == "BF16":
                out[n] = _bf16_ortvalue_to_uint16(v)
            else:
                out[n] = self._from_numpy(n, v.numpy())
        return out

    # ------------------------------------------------------------------

    def _to_ort(self, name: str, arr: np.ndarray) -> np.ndarray | ort.OrtValue:
        dt = self.input_types[name]
        arr = np.asarray(arr)
        if dt.triton == "BYTES":
            return _bytes_to_str_array(name, arr, self.string_encoding, self.string_note)
        if dt.triton == "BF16":
            if arr.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
                arr = arr.view(np.uint16)
            elif arr.dtype != np.uint16:
                raise BackendError(
                    f"input '{name}' is BF16 and must be a uint16 array of bfloat16 words, "
                    f"got {arr.dtype}"
                )
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(arr), _BF16_ONNX
            )
        assert dt.numpy is not None
        if arr.dtype != dt.numpy:
            raise BackendError(f"input '{name}' is {dt.triton} but the array is {arr.dtype}")
        return np.ascontiguousarray(arr)

    def _from_numpy(self, name: str, arr: np.ndarray) -> np.ndarray:
        dt = self.output_types[name]
        if dt.triton == "BYTES":
            return _str_to_bytes_array(arr, self.string_encoding)
        assert dt.numpy is not None
        if arr.dtype != dt.numpy:
            arr = arr.astype(dt.numpy)
        return arr


def _apply_session_options(opts: ort.SessionOptions, options: OrtOptions) -> None:
    """The configuration's session-wide options (onnx_options.py)."""
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, options.graph_level)
    if options.parallel_execution:
        opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    if options.cpu_mem_arena is not None:
        opts.enable_cpu_mem_arena = options.cpu_mem_arena
    if options.mem_pattern is not None:
        opts.enable_mem_pattern = options.mem_pattern
    for key, value in options.session_entries.items():
        opts.add_session_config_entry(key, value)


# --------------------------------------------------------------------------
# conversions


def _bytes_to_str_array(name: str, arr: np.ndarray, encoding: str, note: str) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat_in = arr.reshape(-1)
    flat_out = out.reshape(-1)
    for i, x in enumerate(flat_in):
        try:
            # a str element (direct callers) is its UTF-8 bytes
            flat_out[i] = (x.encode("utf-8") if isinstance(x, str) else bytes(x)).decode(encoding)
        except (UnicodeDecodeError, TypeError) as exc:
            reason = exc.reason if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise InvalidInputError(
                f"BYTES input '{name}' element {i} is not valid UTF-8 ({reason}); this "
                f"model reads string content ({note}) and ONNX Runtime's Python API passes "
                "strings to it as UTF-8 text, so StageServe cannot give it arbitrary bytes"
            ) from None
    return out


def _str_to_bytes_array(arr: np.ndarray, encoding: str) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat_out = out.reshape(-1)
    for i, x in enumerate(arr.reshape(-1)):
        try:
            flat_out[i] = x.encode(encoding) if isinstance(x, str) else bytes(x)
        except UnicodeEncodeError as exc:  # bytes_transparent graphs only move input bytes
            raise BackendError(
                f"string output element {i} is not bytes-transparent: {exc}"
            ) from None
    return out


def _bf16_ortvalue_to_uint16(v: ort.OrtValue) -> np.ndarray:
    """Copy a CPU bfloat16 OrtValue's words into a uint16 numpy array."""
    shape = tuple(v.shape())
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count == 0:
        return np.empty(shape, dtype=np.uint16)
    if v.device_name().lower() != "cpu":
        raise BackendError(f"bfloat16 output is on {v.device_name()}, expected cpu")
    buf = (ctypes.c_uint16 * count).from_address(v.data_ptr())
    return np.ctypeslib.as_array(buf).copy().reshape(shape)


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if len(text) <= 2000 else text[:2000] + "..."
