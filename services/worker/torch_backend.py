"""The worker's PyTorch backend: one ``TorchInstance`` per TorchScript model instance.

Triton's PyTorch (libtorch) backend conventions:

* the model is ``<version>/model.pt`` (or ``default_model_filename``), a
  TorchScript module saved by ``torch.jit.script`` / ``torch.jit.trace``;
* inputs map to ``forward()``'s arguments by name when every input name is
  an argument name, otherwise by the ``<name>__<index>`` convention
  (``INPUT__0`` is the first argument); outputs named ``<name>__<index>``
  are that element of the returned tuple, other names take their position
  in the configuration's output list; a single returned tensor is output 0;
* execution runs under ``torch.inference_mode()`` (parameter
  ``INFERENCE_MODE``, default true; false: ``torch.no_grad()``);
* Triton's model parameters are accepted where this backend honours them
  and refused with a load error where it cannot (``PARAMETERS`` below).

TorchScript carries no tensor types, so data types are checked when the
model runs: an output of another dtype than its configuration fails the
request with both names (Triton's backend does the same). BYTES, UINT16,
UINT32 and UINT64 tensors are refused at load: Triton's PyTorch backend has
no such tensors either (its strings are ``List[str]``, which TorchScript
cannot make from arbitrary bytes).

Intra-op threads: torch's CPU kernels use OpenMP, whose thread count is a
per-thread setting; each instance sets its share on the thread that runs
it, so instances split the cores as ONNX Runtime sessions do.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from services.worker.backends import BackendError, parse_device
from services.worker.numeric_policy import TORCH_TF32, tf32_requested
from stageserve.datatypes import DataType, from_triton

log = logging.getLogger(__name__)

# Idle OpenMP threads spin-wait by default (as ORT's do, which onnx_backend
# turns off): on cores shared with the other stages that burns their CPU.
# Read once, when torch's OpenMP starts, so it is set before torch loads.
# Measured on this 2-core VM under load, the bench CNN at batch 8, 32x32:
# 0.2-0.9 s per batch and 3.3 s CPU with spinning, 0.04-0.07 s and 2.1 s without.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# torch 2.13 marks torch.jit deprecated; TorchScript is what Triton's
# pytorch_libtorch platform serves, so loading it is this module's job.
warnings.filterwarnings(
    "ignore", message="`torch.jit.load` is deprecated", category=DeprecationWarning
)

_INDEXED = re.compile(r"^.+__(\d+)$")

#: Triton datatypes this backend carries -> torch dtype names.
TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BF16": "bfloat16",
}


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise BackendError(f"parameter {name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class TorchOptions:
    inference_mode: bool = True
    optimized_execution: bool = True
    cache_cleaning: bool = False
    intra_op_threads: int = 0  # 0: the worker's split of the cores
    inter_op_threads: int = 0


#: Triton's PyTorch backend parameters, what each does here. Unknown
#: parameters are left alone (Triton passes them to the backend, which
#: ignores the ones it does not know); those listed are checked.
PARAMETERS = {
    "INFERENCE_MODE": "torch.inference_mode() (true, default) or torch.no_grad() (false)",
    "DISABLE_OPTIMIZED_EXECUTION": "torch.jit.optimized_execution(False) around forward()",
    "ENABLE_CACHE_CLEANING": "torch.cuda.empty_cache() after each execution on a GPU",
    "INTRA_OP_THREAD_COUNT": "OpenMP threads of each instance",
    "INTER_OP_THREAD_COUNT": "torch's inter-op pool (process-wide, first load sets it)",
    "ENABLE_NVFUSER": "false only: NVFuser is gone from TorchScript (torch 2.13 no-op)",
    "ENABLE_WEIGHT_SHARING": "false only: each instance loads its own weights",
    "ENABLE_JIT_EXECUTOR": "true only (torch's default): the setting is process-wide",
    "ENABLE_JIT_PROFILING": "true only (torch's default): the setting is process-wide",
    "ENABLE_TENSOR_FUSER": "true only (torch's default): the setting is process-wide",
    "DISABLE_CUDNN": "false only (torch's default): the setting is process-wide",
    "ALLOW_TF32": "TF32 on CUDA (StageServe's, default true; process-wide, numeric_policy.py)",
}

# The flags below are accepted at one value only; a model that asks otherwise
# would silently run differently (or change its neighbours), so it fails to
# load instead, naming the parameter.
_PROCESS_WIDE = (
    "torch keeps it per process, so one model's value would change every other "
    "TorchScript model in the worker"
)
_ONLY = {
    # torch 2.13: torch._C._jit_set_nvfuser_enabled is "deprecated and a no-op"
    "ENABLE_NVFUSER": (False, "NVFuser is no longer part of TorchScript"),
    "ENABLE_WEIGHT_SHARING": (False, "StageServe loads weights per instance"),
    "ENABLE_JIT_EXECUTOR": (True, _PROCESS_WIDE),
    "ENABLE_JIT_PROFILING": (True, _PROCESS_WIDE),
    "ENABLE_TENSOR_FUSER": (True, _PROCESS_WIDE),
    "DISABLE_CUDNN": (False, _PROCESS_WIDE),
}


def torch_options(parameters: Mapping[str, str]) -> TorchOptions:
    """Triton's PyTorch parameters -> options; a value this backend cannot
    honour raises BackendError naming it."""
    p = {k.upper(): v for k, v in parameters.items()}
    for name, (allowed, why) in _ONLY.items():
        if name in p and _bool(name, p[name]) != allowed:
            raise BackendError(
                f"parameter {name}={p[name]} is not supported by StageServe's PyTorch backend: "
                f"{why} (only {str(allowed).lower()} is accepted)"
            )

    def count(name: str) -> int:
        try:
            value = int(p.get(name, "0") or 0)
        except ValueError:
            raise BackendError(f"parameter {name} must be an integer, got {p[name]!r}") from None
        if value < 0:
            raise BackendError(f"parameter {name} must be >= 0, got {value}")
        return value

    return TorchOptions(
        inference_mode=_bool("INFERENCE_MODE", p.get("INFERENCE_MODE", "true")),
        optimized_execution=not _bool(
            "DISABLE_OPTIMIZED_EXECUTION", p.get("DISABLE_OPTIMIZED_EXECUTION", "false")
        ),
        cache_cleaning=_bool("ENABLE_CACHE_CLEANING", p.get("ENABLE_CACHE_CLEANING", "false")),
        intra_op_threads=count("INTRA_OP_THREAD_COUNT"),
        inter_op_threads=count("INTER_OP_THREAD_COUNT"),
    )


def argument_positions(input_names: Sequence[str], forward_args: Sequence[str]) -> dict[str, int]:
    """Which forward() argument each input is (Triton's mapping rules)."""
    if all(n in forward_args for n in input_names):
        return {n: forward_args.index(n) for n in input_names}
    positions = {}
    for n in input_names:
        m = _INDEXED.match(n)
        if m is None:
            raise BackendError(
                f"input '{n}' is neither an argument of forward() ({list(forward_args)}) nor "
                f"named by the <name>__<index> convention"
            )
        positions[n] = int(m.group(1))
    taken = sorted(positions.values())
    if len(set(taken)) != len(taken) or (taken and taken[-1] >= len(forward_args)):
        raise BackendError(
            f"inputs {sorted(positions)} name argument indexes {taken}, but forward() takes "
            f"{len(forward_args)} argument(s) {list(forward_args)}"
        )
    return positions


def output_positions(output_names: Sequence[str]) -> dict[str, int]:
    """Index of each output in forward()'s result: <name>__<index>, else config order."""
    positions = {}
    for i, n in enumerate(output_names):
        m = _INDEXED.match(n)
        positions[n] = int(m.group(1)) if m else i
    return positions


class TorchInstance:
    """One TorchScript module serving one model instance (same interface as
    OnnxInstance: ``run(feeds, output_names)`` on StageServe's numpy tensors)."""

    #: Runs on its instance's thread only, never inline on the worker's event
    #: loop (HostedInstance): its OpenMP thread count and optimized_execution
    #: are per-thread settings, and the loop thread carries every other
    #: model's. (tests/integration/test_torch.py checks the server's answers
    #: against float64 math, and says why not against an in-process forward().)
    thread_bound = True

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str = "cpu",
        intra_op_threads: int = 0,
        input_types: Mapping[str, str] | None = None,
        output_types: Mapping[str, str] | None = None,
        *,
        parameters: Mapping[str, str] | None = None,
        output_order: Sequence[str] = (),
        cpu_fallback: bool = True,
    ) -> None:
        import torch  # only workers that host a PyTorch model pay for the import

        self._torch = torch
        self.model_path = os.fspath(model_path)
        self.options = torch_options(parameters or {})
        self.threads = self.options.intra_op_threads or intra_op_threads
        kind, device_id = parse_device(device)
        self.device = f"cuda:{device_id}" if kind == "cuda" else "cpu"
        if kind == "cuda" and not (torch.cuda.is_available() and device_id < _cuda_count(torch)):
            if not cpu_fallback:
                raise BackendError(
                    f"{self.model_path}: GPU instances not supported: torch "
                    f"{torch.__version__} sees no CUDA "
                    f"device {device_id}; install a CUDA build of torch, or give the model "
                    "a KIND_CPU instance_group"
                )
            log.warning(
                "%s: device %s requested but torch sees no such CUDA device; running on CPU",
                self.model_path,
                self.device,
                extra={"model_path": self.model_path, "device": self.device},
            )
            self.device = "cpu"
        if self.options.inter_op_threads:
            _set_inter_op_threads(torch, self.options.inter_op_threads)
        if not os.path.isfile(self.model_path):
            raise BackendError(f"model file not found: {self.model_path}")
        allow_tf32 = tf32_requested(parameters or {})
        self._tf32_held = self.device != "cpu"
        if self._tf32_held:
            TORCH_TF32.acquire(id(self), allow_tf32, self.model_path)
        try:
            self._load(torch, input_types, output_types, output_order)
        except BaseException:
            self.close()
            raise

    def _load(
        self,
        torch,
        input_types: Mapping[str, str] | None,
        output_types: Mapping[str, str] | None,
        output_order: Sequence[str],
    ) -> None:
        try:
            module = torch.jit.load(self.model_path, map_location=self.device)
        except Exception as exc:  # torch raises RuntimeError / its own C++ error types
            raise BackendError(
                f"failed to load TorchScript model {self.model_path}: {_summary(exc)}"
            ) from exc
        self._module = module.eval()
        self.input_types = _datatypes("input", input_types or {})
        self.output_types = _datatypes("output", output_types or {})
        forward_args = [a.name for a in self._module.forward.schema.arguments[1:]]
        self._inputs = argument_positions(list(self.input_types), forward_args)
        self._arity = len(forward_args)
        order = list(output_order) or list(self.output_types)
        self._outputs = output_positions(order)
        self._configured = threading.local()

    # ------------------------------------------------------------------

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        names, outputs = self._forward(feeds, output_names)
        out = {n: self._from_torch(n, outputs, self._outputs[n]) for n in names}
        self._clean_cache()
        return out

    def run_device(self, feeds: Mapping, output_names: Sequence[str] | None = None) -> dict:
        """`run` on torch tensors already on this instance's device (the CUDA
        in-place path: services/worker/device_batches.py); the outputs stay
        there, as torch tensors of the configured dtypes."""
        names, outputs = self._forward(feeds, output_names)
        out = {n: self._checked(n, outputs, self._outputs[n]).detach() for n in names}
        self._clean_cache()
        return out

    def _forward(self, feeds: Mapping, output_names: Sequence[str] | None) -> tuple[list, Sequence]:
        """forward() on the feeds: the output names asked for and its results."""
        torch = self._torch
        names = list(output_names) if output_names is not None else list(self.output_types)
        unknown = [n for n in names if n not in self.output_types]
        if unknown:
            raise BackendError(
                f"unknown output(s) {unknown}; outputs are {sorted(self.output_types)}"
            )
        missing = [n for n in self.input_types if n not in feeds]
        if missing:
            raise BackendError(f"missing input(s) {missing}")
        self._use_threads()
        args: list = [None] * self._arity
        for name, arr in feeds.items():
            if name not in self._inputs:
                raise BackendError(f"unknown input '{name}'; inputs are {sorted(self._inputs)}")
            args[self._inputs[name]] = self._to_torch(name, arr)
        args = _trim_defaults(args)
        try:
            # optimized_execution is a per-thread switch (checked: another thread
            # keeps its own), so one model's setting never leaks into another's.
            with self._mode(), torch.jit.optimized_execution(self.options.optimized_execution):
                result = self._module(*args)
        except Exception as exc:
            raise BackendError(f"forward() failed: {_summary(exc)}") from exc
        return names, result if isinstance(result, (tuple, list)) else (result,)

    def _clean_cache(self) -> None:
        if self.options.cache_cleaning and self.device != "cpu":
            self._torch.cuda.empty_cache()

    def _mode(self) -> AbstractContextManager:
        torch = self._torch
        return torch.inference_mode() if self.options.inference_mode else torch.no_grad()

    def _use_threads(self) -> None:
        """This instance's share of the cores, on the thread running it."""
        if self.threads and getattr(self._configured, "threads", None) != self.threads:
            self._torch.set_num_threads(self.threads)
            self._configured.threads = self.threads

    def _to_torch(self, name: str, arr):
        torch = self._torch
        dt = self.input_types[name]
        if isinstance(arr, torch.Tensor):  # built on the device (run_device)
            want = getattr(torch, TORCH_DTYPES[dt.triton])
            if arr.dtype != want or str(arr.device) != self.device:
                raise BackendError(
                    f"input '{name}' is {dt.triton} on {self.device}, the tensor is "
                    f"{arr.dtype} on {arr.device}"
                )
            return arr
        arr = np.asarray(arr)
        if dt.triton == "BF16":  # uint16 words -> bfloat16, bit for bit
            t = torch.from_numpy(np.array(arr, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
        else:
            assert dt.numpy is not None
            if arr.dtype != dt.numpy:
                raise BackendError(f"input '{name}' is {dt.triton} but the array is {arr.dtype}")
            # Request tensors are read-only views of the received bytes; torch
            # wants writable memory, so copy (once, the size of the input).
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        return t.to(self.device) if self.device != "cpu" else t

    def _from_torch(self, name: str, outputs: Sequence, index: int) -> np.ndarray:
        torch = self._torch
        dt = self.output_types[name]
        t = self._checked(name, outputs, index).detach().cpu().contiguous()
        if dt.triton == "BF16":
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def _checked(self, name: str, outputs: Sequence, index: int):
        """forward()'s result `index` as output `name`: a tensor of its configured dtype."""
        torch = self._torch
        if index >= len(outputs):
            raise BackendError(
                f"output '{name}' is result {index} of forward(), which returned {len(outputs)}"
            )
        t = outputs[index]
        if not isinstance(t, torch.Tensor):
            raise BackendError(
                f"output '{name}': forward() result {index} is a {type(t).__name__}, not a tensor"
            )
        dt = self.output_types[name]
        want = getattr(torch, TORCH_DTYPES[dt.triton])
        if t.dtype != want:
            raise BackendError(
                f"output '{name}' is {dt.config_enum} in the configuration but the model "
                f"returned {t.dtype}"
            )
        return t

    def close(self) -> None:
        self._module = None
        if self._tf32_held:
            TORCH_TF32.release(id(self))
            self._tf32_held = False


def _datatypes(kind: str, types: Mapping[str, str]) -> dict[str, DataType]:
    out = {}
    for name, triton in types.items():
        if triton not in TORCH_DTYPES:
            raise BackendError(
                f"{kind} '{name}' is {triton}, which the PyTorch backend does not support "
                f"(it carries {', '.join(TORCH_DTYPES)})"
            )
        out[name] = from_triton(triton)
    return out


def _trim_defaults(args: list) -> list:
    """Arguments after the last given one keep forward()'s defaults."""
    while args and args[-1] is None:
        args.pop()
    if any(a is None for a in args):
        missing = [i for i, a in enumerate(args) if a is None]
        raise BackendError(f"forward() arguments {missing} have no input")
    return args


def _cuda_count(torch) -> int:
    return int(torch.cuda.device_count())


_inter_op_lock = threading.Lock()


def _set_inter_op_threads(torch, threads: int) -> None:
    # torch allows this once per process, before any inter-op work; a second
    # model asking again keeps the first setting (logged, not an error).
    with _inter_op_lock:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            log.warning(
                "inter-op threads already set for this process; keeping %d",
                torch.get_num_interop_threads(),
                extra={"wanted": threads},
            )


def _summary(exc: BaseException) -> str:
    """The reason, without TorchScript's interpreter traceback: its last line
    ("RuntimeError: mat1 and mat2 shapes cannot be multiplied ...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:2000] if lines else type(exc).__name__
