"""Trace level TENSORS: a traced request's input and output tensors, as
Triton 2.51's trace file records them (server src/tracer.cc,
TraceTensorActivity), checked against the real Triton in
tests/integration/test_tracing_triton_file.py:

    {"id":1,"activity":"TENSOR_QUEUE_INPUT",
     "tensor":{"name":"INPUT0","data":"0.5,1,-3","shape":"1,3","dtype":"FP32"}}

TENSOR_QUEUE_INPUT for each input as the request is queued,
TENSOR_BACKEND_OUTPUT for each output the model produced. The data is every
element in C++ stream notation: numbers as `<<` prints them (floats as %g
with 6 digits, bools as 1/0, INT8/UINT8 as the character of their byte),
BYTES elements each in double quotes, FP16/BF16 empty (Triton leaves them
out too). Triton copies bytes into the file as they are; here the file stays
valid UTF-8 JSON: a byte or string that is not UTF-8 becomes U+FFFD. The
gateway holds both (the request's inputs, the scheduler's answer), so no
other stage does any work for it.

In opentelemetry mode (Triton 2.51 logs "Tensor level tracing is not
supported" there) the same records are events of the request's span, named
by activity, with the tensor's fields as attributes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import raw_to_numpy

QUEUE_INPUT = "TENSOR_QUEUE_INPUT"
BACKEND_OUTPUT = "TENSOR_BACKEND_OUTPUT"


def _float(value: float) -> str:
    if math.isnan(value):  # glibc prints the sign of a NaN
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    return format(value, "g")


def tensor_data(tensor: pb.Tensor) -> str:
    """The tensor's elements as Triton's trace file writes them."""
    dtype = tensor.datatype
    if dtype in ("FP16", "BF16"):
        return ""
    try:
        arr = raw_to_numpy(tensor.raw, dtype, tensor.shape).reshape(-1)
    except Exception:  # a tensor the gateway could not decode: no data, as Triton stops
        return ""
    if dtype == "BYTES":
        return ",".join('"' + b.decode("utf-8", "replace") + '"' for b in arr)
    if dtype == "BOOL":
        return ",".join("1" if v else "0" for v in arr)
    if dtype in ("INT8", "UINT8"):
        return ",".join(chr(b) if b < 0x80 else "\ufffd" for b in arr.view(np.uint8))
    if dtype in ("FP32", "FP64"):
        return ",".join(_float(float(v)) for v in arr)
    return ",".join(str(int(v)) for v in arr)


def tensor_fields(tensor: pb.Tensor) -> dict[str, str]:
    return {
        "name": tensor.name,
        "data": tensor_data(tensor),
        "shape": ",".join(str(d) for d in tensor.shape),
        "dtype": tensor.datatype,
    }


def tensor_records(trace_id: int, activity: str, tensors: Iterable[pb.Tensor]) -> list[dict]:
    """Triton's trace file entries of `tensors` under `activity`."""
    return [{"id": trace_id, "activity": activity, "tensor": tensor_fields(t)} for t in tensors]


def tensor_events(activity: str, tensors: Iterable[pb.Tensor]) -> list[tuple[str, dict[str, Any]]]:
    """The span events of `tensors`: (activity, attributes) each."""
    return [
        (activity, {f"triton.tensor.{k}": v for k, v in tensor_fields(t).items()}) for t in tensors
    ]
