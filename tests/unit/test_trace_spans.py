"""W3C traceparent handling, the collector address and the worker's compute
phases (stageserve/trace_spans.py, services/worker/compute_spans.py)."""

from __future__ import annotations

import pytest

from services.worker.compute_spans import phases
from stageserve.generated import stageserve_pb2 as pb
from stageserve.trace_spans import OTLP_GRPC, OTLP_HTTP, Parent, otlp_target, parse_traceparent


def test_traceparent_round_trip() -> None:
    text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    parent = parse_traceparent(text)
    assert parent == Parent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
    assert parent.traceparent() == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "00-xyz-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-short-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ],
)
def test_bad_traceparent_is_ignored(text: str) -> None:
    assert parse_traceparent(text) is None


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("collector:4317", (OTLP_GRPC, "collector:4317")),
        ("grpc://collector:4317", (OTLP_GRPC, "collector:4317")),
        ("http://collector:4318/v1/traces", (OTLP_HTTP, "http://collector:4318/v1/traces")),
        ("HTTPS://otel.example/v1/traces", (OTLP_HTTP, "HTTPS://otel.example/v1/traces")),
        # Triton's default url: OTLP/HTTP, no scheme
        ("localhost:4318/v1/traces", (OTLP_HTTP, "http://localhost:4318/v1/traces")),
        ("collector:4317/", (OTLP_GRPC, "collector:4317")),
    ],
)
def test_otlp_target(url: str, target: tuple[str, str]) -> None:
    assert otlp_target(url) == target


def test_otlp_target_refuses_other_schemes() -> None:
    with pytest.raises(ValueError, match="http, https or grpc"):
        otlp_target("ftp://collector:4318")


def test_compute_phases_end_to_end() -> None:
    resp = pb.ExecuteResponse(compute_input_ns=10, compute_infer_ns=100, compute_output_ns=5)
    assert phases(resp, 1000) == [
        ("compute_input", 885, 895),
        ("compute_infer", 895, 995),
        ("compute_output", 995, 1000),
    ]


def test_triton_trace_records() -> None:
    from services.gateway.trace_file import trace_records

    timing = pb.Timing(
        queue_ns=10,
        compute_input_ns=5,
        compute_infer_ns=50,
        compute_output_ns=5,
        enqueue_ns=110,
        execute_end_ns=200,
    )
    records = trace_records(3, "m", 1, "rid", 100, 210, timing)
    assert records[0] == {"id": 3, "model_name": "m", "model_version": 1, "request_id": "rid"}
    stamps = [(r["timestamps"][0]["name"], r["timestamps"][0]["ns"]) for r in records[1:]]
    assert stamps == [
        ("REQUEST_START", 100),
        ("QUEUE_START", 110),
        ("COMPUTE_START", 120),
        ("COMPUTE_INPUT_END", 145),
        ("COMPUTE_OUTPUT_START", 195),
        ("COMPUTE_END", 200),
        ("REQUEST_END", 210),
    ]
    # a request refused before the scheduler: only its start and end
    assert [r.get("timestamps") for r in trace_records(4, "m", 1, "", 1, 2, None)][1:] == [
        [{"name": "REQUEST_START", "ns": 1}],
        [{"name": "REQUEST_END", "ns": 2}],
    ]


def test_trace_file_log_frequency_writes_index_files(tmp_path) -> None:
    import json

    from services.gateway.trace_file import TraceFile

    f = TraceFile(str(tmp_path / "t.json"), log_frequency=2)
    for i in range(3):
        f.add([{"id": i}])
    assert json.loads((tmp_path / "t.json.0").read_text()) == [{"id": 0}, {"id": 1}]
    f.close()
    assert json.loads((tmp_path / "t.json.1").read_text()) == [{"id": 2}]
