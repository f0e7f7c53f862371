"""Trace level TENSORS (services/gateway/trace_tensors.py, trace_file.py,
request_trace.py): tensor data in Triton's C++ stream notation for every
datatype (FP32 as recorded from Triton 2.51 in
tests/integration/test_tracing_tensors.py; the other types as its
tracer.cc prints them), where the records go in a trace, and the span
events of opentelemetry mode."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.request_trace import RequestTrace
from services.gateway.trace_file import trace_records
from services.gateway.trace_tensors import BACKEND_OUTPUT, QUEUE_INPUT, tensor_data, tensor_records
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, serialize_bytes_elements
from stageserve.trace_spans import SpanEmitter
from stageserve.tracing import MODE_OPENTELEMETRY, TraceConfig


def _tensor(arr: np.ndarray, dtype: str, name: str = "T") -> pb.Tensor:
    return pb.Tensor(name=name, datatype=dtype, shape=list(arr.shape), raw=numpy_to_raw(arr))


@pytest.mark.parametrize(
    ("arr", "dtype", "data"),
    [
        (
            np.array([0.5, 1e-7, 123456789.0, -0.0, np.inf, np.nan, 1 / 3, 1e-40], np.float32),
            "FP32",
            "0.5,1e-07,1.23457e+08,-0,inf,nan,0.333333,9.99995e-41",
        ),
        (np.array([-np.nan, 2.0**70, -1e-300], np.float64), "FP64", "-nan,1.18059e+21,-1e-300"),
        (np.array([True, False, True]), "BOOL", "1,0,1"),
        (np.array([65, 48, 32], np.uint8), "UINT8", "A,0, "),  # a char each, as << prints
        (np.array([-128, 97], np.int8), "INT8", "\ufffd,a"),
        (np.array([-(2**63), 2**63 - 1], np.int64), "INT64", f"{-(2**63)},{2**63 - 1}"),
        (np.array([2**32 - 1], np.uint32), "UINT32", "4294967295"),
        (np.array([1.5], np.float16), "FP16", ""),  # Triton leaves half floats out
    ],
)
def test_tensor_data_as_tritons_stream(arr: np.ndarray, dtype: str, data: str) -> None:
    assert tensor_data(_tensor(arr, dtype)) == data


def test_bytes_elements_are_quoted() -> None:
    raw = serialize_bytes_elements([b"caf\xc3\xa9", b"", b"\xff"])
    t = pb.Tensor(name="S", datatype="BYTES", shape=[3], raw=raw)
    assert tensor_data(t) == '"caf\u00e9","","\ufffd"'


def test_undecodable_tensor_has_no_data() -> None:
    assert tensor_data(pb.Tensor(name="X", datatype="FP32", shape=[2], raw=b"\x00")) == ""


def _records() -> list[dict]:
    t = _tensor(np.array([[1, 2]], np.int32), "INT32", "I")
    return tensor_records(7, QUEUE_INPUT, [t]) + tensor_records(7, BACKEND_OUTPUT, [t])


def test_tensor_records_go_after_queue_start() -> None:
    timing = pb.Timing(
        queue_ns=10, compute_input_ns=1, compute_infer_ns=2, compute_output_ns=3,
        enqueue_ns=100, execute_end_ns=200,
    )  # fmt: skip
    entries = trace_records(7, "m", 1, "r", 50, 250, timing, _records())
    kinds = [e.get("activity") or e.get("timestamps", [{}])[0].get("name") for e in entries[1:]]
    assert kinds[:4] == ["REQUEST_START", "QUEUE_START", QUEUE_INPUT, BACKEND_OUTPUT]
    assert entries[3]["tensor"] == {"name": "I", "data": "1,2", "shape": "1,2", "dtype": "INT32"}


def test_tensors_alone_have_no_head_nor_timestamps() -> None:
    assert trace_records(7, "m", 1, "r", 50, 250, None, _records(), timestamps=False) == _records()


def test_opentelemetry_mode_records_tensors_as_span_events() -> None:
    exporter = InMemorySpanExporter()
    emitter = SpanEmitter("gateway", TraceConfig(mode=MODE_OPENTELEMETRY), exporter=exporter)
    t = _tensor(np.array([[1, 2]], np.int32), "INT32", "I")
    for level, events in ((("TIMESTAMPS",), 0), (("TIMESTAMPS", "TENSORS"), 2)):
        trace = RequestTrace(emitter, "m", 1, "", 10, level)
        trace.inputs([t])
        trace.answered(pb.ScheduleResponse(outputs=[t]))
        trace.end(20)
        emitter.provider.force_flush()
        (span,) = exporter.get_finished_spans()
        exporter.clear()
        assert len(span.events) == events
    assert [e.name for e in span.events] == [QUEUE_INPUT, BACKEND_OUTPUT]
    assert dict(span.events[0].attributes or {}) == {
        "triton.tensor.name": "I",
        "triton.tensor.data": "1,2",
        "triton.tensor.shape": "1,2",
        "triton.tensor.dtype": "INT32",
    }
    emitter.close()
