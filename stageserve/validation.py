"""ModelInferRequest -> validated internal request, or Triton's error.

Pure: no I/O of its own (an input in shared memory is read through the
`read_shared` callback the caller passes). Every check answers
INVALID_ARGUMENT with a message naming the model, the tensor and what was
expected, as Triton does; nothing invalid ever reaches the scheduler. Typed
`contents` are turned into raw bytes here, once. As in Triton, the
raw_input_contents entries belong, in order, to the inputs that are not in
shared memory.
Inputs with allow_ragged_batch are checked like any other (their dims, -1 as a
wildcard); batch inputs are computed by the worker and never accepted from a
request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stageserve.config import ModelSpec, TensorSpec
from stageserve.errors import invalid
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import (
    TensorError,
    count_bytes_elements,
    element_count,
    serialize_bytes_elements,
)

# Which InferTensorContents field carries each datatype (FP16/BF16: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# The element type each InferTensorContents field carries on the wire.
_FIELD_NUMPY = {
    "bool_contents": np.bool_,
    "int_contents": np.int32,
    "int64_contents": np.int64,
    "uint_contents": np.uint32,
    "uint64_contents": np.uint64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}

_INT_PARAMS = ("int64_param", "uint64_param")


@dataclass
class ValidatedRequest:
    inputs: list[pb.Tensor]
    outputs: list[str]  # requested output names in request order; [] = all
    batch_size: int  # 0 for models without batching
    priority: int
    timeout_us: int
    sequence_id: int = 0
    sequence_id_str: str = ""
    sequence_start: bool = False
    sequence_end: bool = False
    shared_outputs: dict[str, SharedRef] = field(default_factory=dict)  # output -> region


@dataclass(frozen=True)
class SharedRef:
    """Where a tensor lives in a registered system shared-memory region."""

    region: str
    offset: int
    byte_size: int


ReadShared = Callable[[SharedRef], bytes]
#: (an input's shared-memory reference, its datatype) -> a reference the
#: worker reads itself (a CUDA region's extent), or None: read its bytes
InPlace = Callable[[SharedRef, str], pb.TensorPart | None]
#: (an input's checked bytes, its datatype) -> the extent of the gateway's
#: tensor region they were copied into, or None: they stay inline
PlaceRaw = Callable[[bytes | memoryview, str], pb.TensorPart | None]


def shared_ref(params, kind: str, name: str, model: str) -> SharedRef | None:
    """Triton's shared_memory_region / _byte_size / _offset parameters of
    `kind` ("input" / "output") `name`. The error text is built only for a
    tensor that has them (it was built for every tensor of every request)."""
    if "shared_memory_region" not in params:
        return None
    what = f"{kind} '{name}' of model '{model}'"
    region = params["shared_memory_region"]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise invalid(f"invalid value type for 'shared_memory_region' of {what}: expected string")
    numbers = {}
    for key in ("shared_memory_byte_size", "shared_memory_offset"):
        if key not in params:
            continue
        which = params[key].WhichOneof("parameter_choice")
        if which not in _INT_PARAMS:
            raise invalid(f"invalid value type for '{key}' of {what}: expected an integer")
        numbers[key] = int(getattr(params[key], which))
    if "shared_memory_byte_size" not in numbers:
        raise invalid(
            f"'shared_memory_byte_size' must be given with 'shared_memory_region' of {what}"
        )
    offset = numbers.get("shared_memory_offset", 0)
    if offset < 0 or numbers["shared_memory_byte_size"] < 0:
        raise invalid(f"shared memory offset and byte size of {what} must not be negative")
    return SharedRef(region.string_param, offset, numbers["shared_memory_byte_size"])


def shared_inputs(
    inputs: Iterable[gs.ModelInferRequest.InferInputTensor], model: str
) -> dict[str, SharedRef]:
    """Each input in shared memory -> its reference; Triton's INVALID_ARGUMENT
    for malformed parameters (validate_infer's first check)."""
    return {
        t.name: ref
        for t in inputs
        if (ref := shared_ref(t.parameters, "input", t.name, model)) is not None
    }


def _no_shared_memory(ref: SharedRef) -> bytes:
    raise invalid(f"shared memory region '{ref.region}' cannot be read here")


def _shape_text(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _int_param(request: gs.ModelInferRequest, name: str) -> int:
    if name not in request.parameters:
        return 0
    param = request.parameters[name]
    which = param.WhichOneof("parameter_choice")
    if which not in _INT_PARAMS:
        raise invalid(
            f"invalid value type for '{name}' parameter of model '{request.model_name}': "
            f"expected an integer (int64_param or uint64_param), got {which}"
        )
    value = getattr(param, which)
    if value < 0:
        raise invalid(
            f"'{name}' parameter of model '{request.model_name}' must not be negative, got {value}"
        )
    return int(value)


def _check_sequence_params(request: gs.ModelInferRequest) -> None:
    params = request.parameters
    if "sequence_id" in params:
        which = params["sequence_id"].WhichOneof("parameter_choice")
        if which not in (*_INT_PARAMS, "string_param"):
            raise invalid(
                f"invalid value type for 'sequence_id' parameter of model "
                f"'{request.model_name}': expected int64, uint64 or string, got {which}"
            )
    for flag in ("sequence_start", "sequence_end"):
        if flag in params and params[flag].WhichOneof("parameter_choice") != "bool_param":
            which = params[flag].WhichOneof("parameter_choice")
            raise invalid(
                f"invalid value type for '{flag}' parameter of model '{request.model_name}': "
                f"expected bool, got {which}"
            )


def _sequence_fields(
    request: gs.ModelInferRequest, spec: ModelSpec, batch_size: int
) -> tuple[int, str, bool, bool]:
    """(sequence_id, sequence_id_str, start, end) for a sequence model, else zeros."""
    if spec.sequence is None:
        return 0, "", False, False
    params = request.parameters
    sid, sid_str = 0, ""
    if "sequence_id" in params:
        p = params["sequence_id"]
        which = p.WhichOneof("parameter_choice")
        if which == "string_param":
            sid_str = p.string_param
        else:
            sid = int(getattr(p, which))
            if sid < 0:
                raise invalid(f"sequence_id of the request to model '{spec.name}' is negative")
    if not sid and not sid_str:
        raise invalid(
            f"inference request to model '{spec.name}' must specify a non-zero or non-empty "
            f"correlation ID"
        )
    if spec.batching and batch_size != 1:
        raise invalid(
            f"inference request to model '{spec.name}' must specify batch-size 1 due to "
            f"requirements of sequence batcher, got {batch_size}"
        )
    start = "sequence_start" in params and params["sequence_start"].bool_param
    end = "sequence_end" in params and params["sequence_end"].bool_param
    return sid, sid_str, bool(start), bool(end)


def _expected_shape(spec: ModelSpec, t: TensorSpec) -> list[int]:
    return ([-1] if spec.batching else []) + list(t.dims)


def _raw_from_contents(
    tensor: gs.ModelInferRequest.InferInputTensor, model: str, count: int
) -> bytes:
    datatype = tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise invalid(
            f"input '{tensor.name}' of model '{model}': {datatype} data must be sent in "
            f"raw_input_contents (typed contents cannot carry {datatype})"
        )
    values = getattr(tensor.contents, field)
    other = [
        f for f in set(CONTENTS_FIELD.values()) if f != field and len(getattr(tensor.contents, f))
    ]
    if other:
        raise invalid(
            f"input '{tensor.name}' of model '{model}' is {datatype} but carries {other[0]}"
        )
    if len(values) != count:
        raise invalid(
            f"unexpected number of elements for input '{tensor.name}' of model '{model}': "
            f"shape {_shape_text(tensor.shape)} needs {count}, {field} has {len(values)}"
        )
    if datatype == "BYTES":
        return serialize_bytes_elements(list(values))
    from stageserve.datatypes import from_triton

    np_dtype = from_triton(datatype).numpy
    try:
        # Read the values at the proto field's own type first: letting numpy
        # guess from Python ints turns e.g. [2**64 - 1, 1] into float64.
        typed: np.ndarray = np.fromiter(values, dtype=_FIELD_NUMPY[field], count=len(values))
        return typed.astype(np_dtype, casting="unsafe").tobytes()
    except (ValueError, OverflowError) as exc:
        raise invalid(f"input '{tensor.name}' of model '{model}': {exc}") from exc


def _reshaped(spec: ModelSpec, t: TensorSpec, shape: list[int]) -> list[int]:
    """The shape the model sees: config `reshape` replaces the non-batch dims."""
    if t.reshape is None:
        return shape
    batch = shape[:1] if spec.batching else []
    inner = shape[1:] if spec.batching else shape
    target = list(t.reshape)
    if -1 in target:
        known = element_count([d for d in target if d != -1])
        target[target.index(-1)] = element_count(inner) // max(known, 1)
    return batch + target


def validate_infer(
    request: gs.ModelInferRequest,
    spec: ModelSpec,
    read_shared: ReadShared = _no_shared_memory,
    raw_contents: Sequence[bytes | memoryview] | None = None,
    in_place: InPlace | None = None,
    shared: Mapping[str, SharedRef] | None = None,
    place_raw: PlaceRaw | None = None,
) -> ValidatedRequest:
    """`raw_contents`, when given, stands for request.raw_input_contents (the
    HTTP front's binary tensors, sliced from the body, and the gRPC front's
    views of the received message, skip a protobuf copy).

    Runs once per request on the gateway's event loop, so protobuf fields are
    read once into locals: 14.3 -> 12.5 us for tritonclient's `simple`
    request (two INT32 [1,16] inputs, two outputs; timeit).

    `in_place`, when given, may turn a shared-memory input into a reference
    the worker reads (the tensor then carries that part, not bytes); its byte
    size is checked as the bytes' would be.

    `shared`, when given, is shared_inputs(request.inputs, spec.name), which
    the caller parsed already (the gateway reads large inputs ahead from it):
    1.5 us for the two inputs of `simple`, not paid twice.

    `place_raw`, when given, may put an input's checked bytes in the
    gateway's tensor region (the tensor then carries that part): the bytes
    go there from the request, not through a Tensor's `raw` first (two
    copies less: `python -m bench.gateway_work`, docs/benchmarks.md)."""
    model = spec.name
    batching = spec.batching
    raw_input = request.raw_input_contents if raw_contents is None else raw_contents
    use_raw = len(raw_input) > 0
    inputs = request.inputs
    if shared is None:
        shared = shared_inputs(inputs, model)
    if use_raw:
        _check_no_contents_with_raw(inputs, shared, model)
    wanted_raw = len(inputs) - len(shared)
    if use_raw and len(raw_input) != wanted_raw:
        raise invalid(
            f"expected {wanted_raw} raw input contents (one per input not in shared memory) "
            f"for model '{model}', got {len(raw_input)}"
        )
    raw_index = 0
    seen: set[str] = set()
    batch_size: int | None = None
    tensors: list[pb.Tensor] = []
    for tensor in inputs:
        name = tensor.name
        t = spec.input(name)
        if t is None:
            raise invalid(f"unexpected inference input '{name}' for model '{model}'")
        if name in seen:
            raise invalid(f"input '{name}' appears more than once in the request for '{model}'")
        seen.add(name)
        datatype = tensor.datatype
        if datatype != t.datatype.triton:
            raise invalid(
                f"inference input '{name}' data-type is '{datatype}', but model "
                f"'{model}' expects '{t.datatype.triton}'"
            )
        shape = list(tensor.shape)  # int64s: Python ints already
        if shape and min(shape) < 0:
            raise invalid(f"input '{name}' of model '{model}' has a negative dimension {shape}")
        if batching:
            if not shape:
                raise invalid(
                    f"input '{name}' of model '{model}' has no batch dimension; expected shape "
                    f"{_shape_text(_expected_shape(spec, t))}"
                )
            if batch_size is None:
                batch_size = shape[0]
            elif shape[0] != batch_size:
                raise invalid(
                    f"input '{name}' of model '{model}' has batch size {shape[0]}, but other "
                    f"inputs have batch size {batch_size}"
                )
            if shape[0] < 1 or shape[0] > spec.max_batch_size:
                raise invalid(
                    f"inference request batch-size must be <= {spec.max_batch_size} for "
                    f"'{model}' (and >= 1), got {shape[0]}"
                )
            inner = tuple(shape[1:])
        else:
            inner = tuple(shape)
        if not t.matches(inner):
            raise invalid(
                f"unexpected shape for input '{name}' for model '{model}'. Expected "
                f"{_shape_text(_expected_shape(spec, t))}, got {_shape_text(shape)}"
            )
        count = element_count(shape)
        if name in shared:
            if _has_contents(tensor):
                raise invalid(
                    f"unexpected 'content' provided when using shared memory for input tensor "
                    f"'{name}' for model '{model}'"
                )
            part = in_place(shared[name], datatype) if in_place is not None else None
            if part is not None:
                _check_byte_size(part.length, t, name, model, count)
                reshaped = _reshaped(spec, t, shape)
                tensors.append(
                    pb.Tensor(name=name, datatype=datatype, shape=reshaped, parts=[part])
                )
                continue
            raw: bytes | memoryview = read_shared(shared[name])
            _check_raw(raw, t, name, model, count)
        elif use_raw:
            raw = raw_input[raw_index]
            raw_index += 1
            _check_raw(raw, t, name, model, count)
        else:
            raw = _raw_from_contents(tensor, model, count)
        reshaped = _reshaped(spec, t, shape)
        placed = place_raw(raw, datatype) if place_raw is not None else None
        if placed is not None:
            tensors.append(pb.Tensor(name=name, datatype=datatype, shape=reshaped, parts=[placed]))
        else:
            if not isinstance(raw, bytes):  # a view of the request: protobuf takes bytes
                raw = bytes(raw)
            tensors.append(pb.Tensor(name=name, datatype=datatype, shape=reshaped, raw=raw))

    missing = [t.name for t in spec.inputs if t.name not in seen and not t.optional]
    if missing:
        required = [t.name for t in spec.inputs if not t.optional]
        raise invalid(
            f"expected {len(required)} inputs but got {len(inputs)} inputs for model "
            f"'{model}'. Got input(s) {sorted(seen)}, but missing required input(s) {missing}. "
            f"Please provide all required input(s)."
        )

    outputs: list[str] = []
    shared_outputs: dict[str, SharedRef] = {}
    for out in request.outputs:
        out_name = out.name
        if spec.output(out_name) is None:
            raise invalid(f"unexpected inference output '{out_name}' for model '{model}'")
        if out_name in outputs:
            raise invalid(f"output '{out_name}' is requested twice for model '{model}'")
        outputs.append(out_name)
        ref = shared_ref(out.parameters, "output", out_name, model)
        if ref is not None:
            shared_outputs[out_name] = ref

    _check_sequence_params(request)
    sid, sid_str, start, end = _sequence_fields(request, spec, batch_size or 0)
    return ValidatedRequest(
        sequence_id=sid,
        sequence_id_str=sid_str,
        sequence_start=start,
        sequence_end=end,
        inputs=tensors,
        outputs=outputs,
        batch_size=batch_size or 0,
        priority=_int_param(request, "priority"),
        timeout_us=_int_param(request, "timeout"),
        shared_outputs=shared_outputs,
    )


def _has_contents(tensor: gs.ModelInferRequest.InferInputTensor) -> bool:
    return tensor.HasField("contents") and tensor.contents.ByteSize() > 0


def _check_no_contents_with_raw(
    inputs: Sequence[gs.ModelInferRequest.InferInputTensor],
    shared: Mapping[str, SharedRef],
    model: str,
) -> None:
    """Triton's first check of a request using raw_input_contents, before the
    raw count and before an input's name is looked up: no input outside shared
    memory carries typed contents too (its words, checked against 2.51)."""
    for tensor in inputs:
        if tensor.name not in shared and _has_contents(tensor):
            raise invalid(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{tensor.name}' for model '{model}'"
            )


def _check_raw(raw: bytes | memoryview, t: TensorSpec, name: str, model: str, count: int) -> None:
    if t.datatype.triton == "BYTES":
        try:
            found = count_bytes_elements(raw)
        except TensorError as exc:
            raise invalid(
                f"malformed BYTES data for input '{name}' of model '{model}': {exc}"
            ) from exc
        if found != count:
            raise invalid(
                f"input '{name}' of model '{model}' holds {found} BYTES elements, its shape "
                f"needs {count}"
            )
        return
    _check_byte_size(len(raw), t, name, model, count)


def _check_byte_size(nbytes: int, t: TensorSpec, name: str, model: str, count: int) -> None:
    """A fixed-size input's bytes are its element count times the item size."""
    expected = count * t.datatype.item_size
    if nbytes != expected:
        raise invalid(
            f"input byte size mismatch for input '{name}' for model '{model}'. Expected "
            f"{expected}, got {nbytes}"
        )
