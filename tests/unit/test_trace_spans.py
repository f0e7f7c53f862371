"""W3C traceparent handling, the collector address and the worker's compute
phases (stageserve/trace_spans.py, services/worker/compute_spans.py)."""

from __future__ import annotations

import pytest

from services.worker.compute_spans import phases
from stageserve.generated import stageserve_pb2 as pb
from stageserve.trace_spans import Parent, collector_endpoint, parse_traceparent


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
    ("url", "endpoint"),
    [
        ("collector:4317", "collector:4317"),
        ("http://collector:4318/v1/traces", "collector:4318"),
        ("localhost:4317/v1/traces", "localhost:4317"),
    ],
)
def test_collector_endpoint(url: str, endpoint: str) -> None:
    assert collector_endpoint(url) == endpoint


def test_compute_phases_end_to_end() -> None:
    resp = pb.ExecuteResponse(compute_input_ns=10, compute_infer_ns=100, compute_output_ns=5)
    assert phases(resp, 1000) == [
        ("compute_input", 885, 895),
        ("compute_infer", 895, 995),
        ("compute_output", 995, 1000),
    ]
