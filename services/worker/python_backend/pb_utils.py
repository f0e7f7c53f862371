"""StageServe's `triton_python_backend_utils`: what a Triton `model.py` imports.

A model written for Triton's Python backend does
`import triton_python_backend_utils as pb_utils`; the worker registers this
module under that name (services/worker/python_backend/loader.py) before it
imports a model.py, so the file runs unchanged. Written from Triton's
python_backend README; behaviours checked against Triton 2.51.

Requests, responses and tensors are plain Python objects here: the model runs
in the worker process, so nothing is copied to a stub process (Triton's
backend pays that IPC per batch). The worker side (building requests from a
batch, collecting responses, BLS, response senders) hooks in through the
`_`-prefixed attributes, which a model.py never touches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# model_config.proto DataType enum values, which triton_to_numpy_type takes.
_ENUM_TO_NUMPY: dict[int, Any] = {
    1: np.bool_,
    2: np.uint8,
    3: np.uint16,
    4: np.uint32,
    5: np.uint64,
    6: np.int8,
    7: np.int16,
    8: np.int32,
    9: np.int64,
    10: np.float16,
    11: np.float32,
    12: np.float64,
    13: np.object_,
}

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_LEN = struct.Struct("<I")


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _ENUM_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type in (np.object_, np.bytes_):
        return 13
    for enum, np_type in _ENUM_TO_NUMPY.items():
        if np_type is not np.object_ and np.dtype(data_type) == np.dtype(np_type):
            return enum
    return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """BYTES elements, each as a 4-byte little-endian length and its bytes, in
    C order; returned as a 1-D uint8 array (None for an empty tensor)."""
    if input_tensor.size == 0:
        return None
    parts = []
    for item in np.asarray(input_tensor).reshape(-1, order="C"):
        b = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    items = []
    view = memoryview(encoded_tensor)
    pos = 0
    while pos < len(view):
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4
        items.append(bytes(view[pos : pos + length]))
        pos += length
    return np.array(items, dtype=np.object_)


# ------------------------------------------------------------------ errors


class TritonError(Exception):
    """An error a model puts in a response (or that a BLS response carries).

    The code becomes the request's gRPC status, as in Triton."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        super().__init__(msg)
        self._msg = str(msg)
        self._code = int(code)

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by pb_utils calls a model makes that fail (and by models themselves)."""

    def message(self) -> str:
        return str(self)


# ----------------------------------------------------------------- tensors


class Tensor:
    """A named tensor; BYTES tensors are numpy object arrays of `bytes`."""

    def __init__(self, name: str, tensor: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException("a Tensor's name must be a string")
        arr = np.asarray(tensor)
        if arr.dtype.kind in ("S", "U"):
            arr = arr.astype(np.object_)
        self._name = name
        self._array = arr

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype.type)

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (numpy's own export; not for BYTES)."""
        if self._array.dtype == np.object_:
            raise TritonModelException("DLPack does not support BYTES tensors")
        return np.ascontiguousarray(self._array).__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """From any DLPack producer (a torch tensor or its capsule, a numpy array)."""
        if hasattr(capsule, "__dlpack__"):
            if hasattr(capsule, "cpu"):  # torch: the worker's tensors live in host memory
                capsule = capsule.cpu()
            return Tensor(name, np.from_dlpack(capsule))
        return Tensor(name, np.from_dlpack(_Capsule(capsule)))

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


class _Capsule:
    """Wraps a bare DLPack capsule so np.from_dlpack (which wants __dlpack__) takes it."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


# -------------------------------------------------------- requests/responses


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException("InferenceResponse error must be a pb_utils.TritonError")
        self._error = error
        self._parameters = parameters or {}

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        p = self._parameters
        return p if isinstance(p, str) else json.dumps(p)


class InferenceResponseSender:
    """How a decoupled model answers: any number of responses, then the final flag.

    `_emit(response_or_None, final)` is the worker's; it may be called from
    any thread, during or after execute, as in Triton."""

    def __init__(self, emit: Callable[[InferenceResponse | None, bool], None]) -> None:
        self._emit = emit
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object is needed when the response flag is not final"
            )
        self._closed = final
        self._emit(response, final)

    def is_cancelled(self) -> bool:
        return False


class InferenceRequest:
    """A request a model executes, or (BLS) one it sends to another model.

    As a BLS request it is built with keyword arguments, and `exec()` /
    `async_exec()` run it through the scheduler of the stack (set up by the
    worker in `_bls`)."""

    _bls: Any = None  # the worker's BLS client (services/worker/python_backend/bls.py)

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: Sequence[str] = (),
        inputs: Sequence[Tensor] = (),
        model_version: int = -1,
        correlation_id: int | str = 0,
        request_id: str = "",
        flags: int = 0,
        timeout: int = 0,
        parameters: dict | str | None = None,
        preferred_memory: Any = None,
        trace: Any = None,
    ) -> None:
        self._model_name = model_name
        self._requested = list(requested_output_names)
        self._inputs = list(inputs)
        self._model_version = int(model_version)
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._flags = int(flags)
        self._timeout = int(timeout)
        if isinstance(parameters, str):
            parameters = cast(dict, json.loads(parameters))
        self._parameters: dict = dict(parameters or {})
        self._sender: InferenceResponseSender | None = None

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> set[str]:
        """A set, as Triton's (a BLS request keeps the list it was given)."""
        return set(self._requested)

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def request_id(self) -> str:
        return self._request_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters as a JSON object string (as Triton's)."""
        return json.dumps(self._parameters, separators=(",", ":"))

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "Unable to get the response sender: the model is not decoupled"
            )
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model and wait: an InferenceResponse
        (errors in it, not raised), or an iterator of them when decoupled."""
        if self._bls is None:
            raise TritonModelException("BLS requests can only be executed inside a model")
        return self._bls.execute(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future:
        """Send this request now and return an asyncio Future (a Task) of the
        running loop, as Triton 2.51's `run_in_executor` future: the request
        is on its way before the caller awaits, so several calls made before
        awaiting any run at once, and `asyncio.wait` / `gather` take them.
        Awaited: what `exec(decoupled)` returns. Without a running loop (a
        plain `def execute`), RuntimeError, as in Triton."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "no running event loop: async_exec() must be called from a coroutine "
                "(an `async def execute`); use exec() otherwise"
            ) from None
        if self._bls is None:
            raise TritonModelException("BLS requests can only be executed inside a model")
        try:
            answer = self._bls.execute_async(self, decoupled)  # sends it: no await needed
        except Exception as exc:  # raised when awaited, as the call's own errors are
            failed = loop.create_future()
            failed.set_exception(exc)
            return failed
        return loop.create_task(answer)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# ------------------------------------------------------------------ logging


class Logger:
    """Triton's model logger; here the worker's structured log."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3

    _log = logging.getLogger("stageserve.model")
    _levels = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    @classmethod
    def log(cls, message: str, level: int = INFO) -> None:
        cls._log.log(cls._levels.get(level, logging.INFO), str(message))

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, cls.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, cls.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, cls.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, cls.VERBOSE)


class LogLevel:
    INFO = Logger.INFO
    WARNING = Logger.WARNING
    ERROR = Logger.ERROR
    VERBOSE = Logger.VERBOSE


# ----------------------------------------------------- auto-complete config


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives: the
    model's configuration as Triton's JSON, which the model may complete."""

    def __init__(self, model_config: str | dict) -> None:
        self._model_config = (
            json.loads(model_config) if isinstance(model_config, str) else model_config
        )
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict:
        return self._model_config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    f"scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def _add(self, kind: str, tensor: dict, allowed: tuple[str, ...]) -> None:
        extra = [k for k in tensor if k not in allowed]
        if extra:
            raise ValueError(
                f"{kind} '{tensor.get('name')}' in auto-complete-config function for model "
                f"'{self._name}' contains property other than {', '.join(allowed)}."
            )
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(
                    f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for "
                    f"model '{self._name}' is missing '{key}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            declared = current.get("data_type", "TYPE_INVALID")
            if declared != "TYPE_INVALID" and declared != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects datatype "
                    f"{declared} for {kind} '{tensor['name']}', model provides "
                    f"{tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims "
                    f"{list(current['dims'])}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def add_input(self, input: dict) -> None:  # noqa: A002 - Triton's parameter name
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        extra = [k for k in transaction_policy_dict if k != "decoupled"]
        if extra:
            raise ValueError(
                f"model transaction property in auto-complete-config function for model "
                f"'{self._name}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
