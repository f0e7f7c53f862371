"""KServe v2 / Triton HTTP bodies <-> the `inference.*` messages the dataplane takes.

Pure: no I/O. An infer body is a JSON header, optionally followed by binary
tensor data (Triton's binary tensor extension: the header's length comes in
`Inference-Header-Content-Length`, each binary input says its size in
`parameters.binary_data_size`, in input order). JSON `data` is turned into
raw little-endian bytes here, once, so the dataplane sees what the gRPC front
sends it as raw_input_contents; binary input bytes are views of the body
(no copy, no JSON or base64 round trip) and travel beside the message, not
through it, which saves protobuf a copy in and a copy out. Errors are StageErrors with
INVALID_ARGUMENT (400), except where Triton's HTTP front answers 500:
a body that is not a JSON object and `data` that does not parse as the
tensor's shape and datatype (INTERNAL, measured against Triton 2.51).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from stageserve.config import ModelSpec
from stageserve.datatypes import BY_TRITON
from stageserve.errors import internal, invalid
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.tensors import element_count, serialize_bytes_elements, split_bytes_elements

# Parameters that steer the HTTP encoding only; they never reach the dataplane.
_HTTP_ONLY = frozenset({"binary_data", "binary_data_size", "binary_data_output"})

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


# ------------------------------------------------------------------ parameters


def to_parameter(key: str, value: Any) -> gs.InferParameter:
    if isinstance(value, bool):
        return gs.InferParameter(bool_param=value)
    if isinstance(value, int):
        if value < -(2**63) or value >= 2**64:
            raise invalid(f"parameter '{key}' is out of the 64-bit range")
        if value >= 2**63:
            return gs.InferParameter(uint64_param=value)
        return gs.InferParameter(int64_param=value)
    if isinstance(value, float):
        return gs.InferParameter(double_param=value)
    if isinstance(value, str):
        return gs.InferParameter(string_param=value)
    raise invalid(f"parameter '{key}' must be a bool, number or string")


def _fill_parameters(target, params: Any, what: str) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise invalid(f"'parameters' of {what} must be a JSON object")
    for key, value in params.items():
        if key not in _HTTP_ONLY:
            target[key].CopyFrom(to_parameter(key, value))


def from_parameter(p: gs.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


# ----------------------------------------------------------------- infer request


def _json_object(header: bytes | memoryview) -> dict:
    try:
        body = json.loads(bytes(header))
    except (UnicodeDecodeError, ValueError) as exc:
        raise internal(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(body, dict):
        raise internal("the request JSON must be an object")
    return body


@dataclass
class ParsedInfer:
    request: gs.ModelInferRequest
    binary_default: bool  # binary_data_output: outputs without their own binary_data
    binary: dict[str, bool] = field(default_factory=dict)  # output -> its binary_data
    # Raw bytes of the inputs not in shared memory, in order: what gRPC sends
    # as raw_input_contents, kept out of the message (one protobuf copy less).
    raw: list[bytes | memoryview] = field(default_factory=list)

    def wants_binary(self, output: str) -> bool:
        return self.binary.get(output, self.binary_default)


def parse_infer(body: bytes, header_length: int | None, model: str, version: str) -> ParsedInfer:
    view = memoryview(body)
    if header_length is None:
        header_length = len(body)
    if header_length < 0 or header_length > len(body):
        raise invalid(
            f"Inference-Header-Content-Length {header_length} is outside the body "
            f"of {len(body)} bytes"
        )
    doc = _json_object(view[:header_length])
    request = gs.ModelInferRequest(model_name=model, model_version=version)
    if "id" in doc:
        if not isinstance(doc["id"], str):
            raise invalid("'id' must be a string")
        request.id = doc["id"]
    params = doc.get("parameters") or {}
    _fill_parameters(request.parameters, params, f"the request to model '{model}'")
    parsed = ParsedInfer(request, bool(params.get("binary_data_output", False)))

    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise invalid(f"the request to model '{model}' must have an 'inputs' array")
    offset = header_length
    for item in inputs:
        offset = _parse_input(parsed, item, view, offset, model)
    if offset != len(body):
        raise invalid(
            f"the request to model '{model}' carries {len(body) - offset} bytes of binary "
            f"data that no input claims (binary_data_size)"
        )
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid(f"'outputs' of the request to model '{model}' must be an array")
        for item in outputs:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise invalid(f"every output of the request to model '{model}' needs a 'name'")
            out = request.outputs.add(name=item["name"])
            out_params = item.get("parameters")
            _fill_parameters(out.parameters, out_params, f"output '{out.name}'")
            if isinstance(out_params, dict) and "binary_data" in out_params:
                parsed.binary[out.name] = bool(out_params["binary_data"])
    return parsed


def _parse_input(parsed: ParsedInfer, item: Any, view: memoryview, offset: int, model: str) -> int:
    if not isinstance(item, dict):
        raise invalid(f"every input of the request to model '{model}' must be an object")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise invalid(f"every input of the request to model '{model}' needs 'name' and 'datatype'")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise invalid(f"input '{name}' of model '{model}' needs an integer 'shape' array")
    tensor = parsed.request.inputs.add(name=name, datatype=datatype, shape=shape)
    params = item.get("parameters") or {}
    _fill_parameters(tensor.parameters, params, f"input '{name}'")
    if "shared_memory_region" in params:
        if "data" in item:
            raise invalid(
                f"unexpected 'data' provided when using shared memory for input tensor "
                f"'{name}' for model '{model}'"
            )
        return offset
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in item:
            raise invalid(f"input '{name}' of model '{model}' has both 'data' and binary data")
        if not isinstance(size, int) or size < 0 or offset + size > len(view):
            raise invalid(
                f"binary_data_size {size} of input '{name}' of model '{model}' goes past the "
                f"{len(view)} bytes of the request body"
            )
        # a view of the body (bytes): validation copies it once, into the
        # tensor region or a tensor's raw
        parsed.raw.append(view[offset : offset + size])
        return offset + size
    if "data" not in item:
        raise invalid(f"input '{name}' of model '{model}' has no 'data' and no binary data")
    parsed.raw.append(json_to_raw(item["data"], name, datatype, shape, model))
    return offset


def json_to_raw(data: Any, name: str, datatype: str, shape: list[int], model: str) -> bytes:
    """JSON tensor data (flat or nested, row-major) -> raw little-endian bytes."""
    what = f"Unable to parse 'data' of input '{name}' of model '{model}'"
    flat = list(_flatten(data))
    count = element_count(shape) if all(d >= 0 for d in shape) else -1
    if count != len(flat):
        raise internal(f"{what}: shape {shape} needs {count} elements, 'data' has {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise internal(f"{what}: BYTES elements must be JSON strings")
        return serialize_bytes_elements([v.encode() for v in flat])
    dtype = BY_TRITON.get(datatype)
    if dtype is None or datatype in ("FP16", "BF16"):
        # Half-precision tensors only travel as binary data.
        raise internal(f"{what}: {datatype} is not supported in JSON, send it as binary data")
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise internal(f"{what}: BOOL elements must be true or false")
    elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise internal(f"{what}: {datatype} elements must be JSON numbers")
    elif datatype not in ("FP32", "FP64") and not all(isinstance(v, int) for v in flat):
        raise internal(f"{what}: {datatype} elements must be integers")
    try:
        array = np.array(flat, dtype=dtype.numpy)
    except (OverflowError, ValueError) as exc:
        raise internal(f"{what}: {exc}") from None
    return array.tobytes()


def _flatten(data: Any):
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


# ---------------------------------------------------------------- infer response


def encode_infer(
    response: gs.ModelInferResponse, parsed: ParsedInfer, raws: Sequence[bytes] | None = None
) -> tuple[bytes, int | None]:
    """(body, JSON header length or None when the body is JSON only). `raws`:
    the outputs' bytes when they are not in the response (InferAnswer: each
    read of a protobuf bytes field copies it)."""
    if raws is None:
        raws = response.raw_output_contents
    wanted = {o.name: o for o in parsed.request.outputs}
    doc: dict[str, Any] = {"model_name": response.model_name}
    doc["model_version"] = response.model_version
    if response.id:
        doc["id"] = response.id
    outputs = []
    blobs: list[bytes] = []
    for tensor, raw in zip(response.outputs, raws, strict=True):
        out: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        asked = wanted.get(tensor.name)
        params = asked.parameters if asked is not None else {}
        if "shared_memory_region" in params:
            out["parameters"] = {k: from_parameter(v) for k, v in params.items()}
        elif parsed.wants_binary(tensor.name):
            out["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            out["data"] = raw_to_json(raw, tensor.datatype)
        outputs.append(out)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def raw_to_json(raw: bytes, datatype: str) -> list:
    if datatype == "BYTES":
        return [e.decode("utf-8", errors="replace") for e in split_bytes_elements(raw)]
    if datatype == "BF16":  # the upper half of an FP32
        words = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return words.view(np.float32).tolist()
    return np.frombuffer(raw, dtype=BY_TRITON[datatype].numpy).tolist()


# --------------------------------------------------------------------- generate


def parse_generate(body: bytes, spec: ModelSpec, version: str) -> gs.ModelInferRequest:
    """Triton's generate extension for a non-decoupled model: top-level keys
    named like inputs are their values (a scalar or a flat list filling the
    input's dims, batch 1), `parameters` the request's; other keys are ignored
    (as Triton 2.51 does)."""
    doc = _json_object(body)
    request = gs.ModelInferRequest(model_name=spec.name, model_version=version)
    _fill_parameters(request.parameters, doc.get("parameters"), f"the request to '{spec.name}'")
    for t in spec.inputs:
        if t.name not in doc:
            continue  # validation names the missing required inputs
        value = doc[t.name]
        flat = value if isinstance(value, list) else [value]
        dims = _generate_dims(list(t.dims), flat)
        if dims is None or any(isinstance(v, list | dict) for v in flat):
            raise invalid(
                f"The schema can not convert input '{t.name}' to tensor with proper shape"
            )
        shape = ([1] if spec.batching else []) + dims
        tensor = request.inputs.add(name=t.name, datatype=t.datatype.triton, shape=shape)
        request.raw_input_contents.append(
            json_to_raw(flat, tensor.name, tensor.datatype, shape, spec.name)
        )
    return request


def _generate_dims(dims: list[int], flat: list) -> list[int] | None:
    """The input's dims with a variable one (at most one) taken from the count."""
    known = element_count([d for d in dims if d != -1])
    if -1 not in dims:
        return dims if known == len(flat) else None
    if dims.count(-1) > 1 or len(flat) % max(known, 1):
        return None
    return [len(flat) // max(known, 1) if d == -1 else d for d in dims]


def encode_generate(response: gs.ModelInferResponse) -> dict[str, Any]:
    """Every output by name; a one-element output as a scalar."""
    doc: dict[str, Any] = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        values = raw_to_json(raw, tensor.datatype)
        doc[tensor.name] = values[0] if len(values) == 1 else values
    doc["model_name"] = response.model_name
    doc["model_version"] = response.model_version
    return doc


# ----------------------------------------------------------------- other bodies


def proto_json(message: Message) -> Any:
    """A message as Triton's HTTP front prints it: proto field names, every
    field, and 64-bit integers as JSON numbers (protobuf's printer quotes them)."""
    doc = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return _unquote_int64(message.DESCRIPTOR, doc)


def _unquote_int64(descriptor: Descriptor, doc: dict) -> dict:
    for fd in descriptor.fields:
        if fd.name not in doc:
            continue
        value = doc[fd.name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_field = fd.message_type.fields_by_name["value"]
            doc[fd.name] = {k: _convert(value_field, v) for k, v in value.items()}
        elif fd.is_repeated:
            doc[fd.name] = [_convert(fd, v) for v in value]
        else:
            doc[fd.name] = _convert(fd, value)
    return doc


def _convert(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return _unquote_int64(field.message_type, value) if isinstance(value, dict) else value
    if field.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    return value


def load_request(model: str, body: bytes) -> gs.RepositoryModelLoadRequest:
    """POST /v2/repository/models/{m}/load: `config` (JSON text) and
    `file:<path>` (base64) parameters, as Triton's HTTP front takes them."""
    request = gs.RepositoryModelLoadRequest(model_name=model)
    params = _json_object(body).get("parameters") if body else None
    if params is None:
        return request
    if not isinstance(params, dict):
        raise invalid("'parameters' of a load request must be a JSON object")
    for key, value in params.items():
        if key.startswith("file:"):
            if not isinstance(value, str):
                raise invalid(f"load parameter '{key}' must be base64 text")
            try:
                content = base64.b64decode(value, validate=True)
            except ValueError:
                raise invalid(f"load parameter '{key}' is not valid base64") from None
            request.parameters[key].CopyFrom(gs.ModelRepositoryParameter(bytes_param=content))
        elif isinstance(value, bool):
            request.parameters[key].CopyFrom(gs.ModelRepositoryParameter(bool_param=value))
        elif isinstance(value, int):
            request.parameters[key].CopyFrom(gs.ModelRepositoryParameter(int64_param=value))
        elif isinstance(value, str):
            request.parameters[key].CopyFrom(gs.ModelRepositoryParameter(string_param=value))
        else:
            raise invalid(f"load parameter '{key}' must be a bool, integer or string")
    return request


def unload_request(model: str, body: bytes) -> gs.RepositoryModelUnloadRequest:
    request = gs.RepositoryModelUnloadRequest(model_name=model)
    params = _json_object(body).get("parameters") if body else None
    if isinstance(params, dict) and isinstance(params.get("unload_dependents"), bool):
        request.parameters["unload_dependents"].CopyFrom(
            gs.ModelRepositoryParameter(bool_param=params["unload_dependents"])
        )
    return request


def json_body(body: bytes) -> dict:
    return _json_object(body) if body else {}
