"""Triton's nv_inference_request_failure reasons come from typed errors, not
from matching messages: a full queue is REJECTED because the scheduler says
so (ScheduleResponse.rejected), whatever its message."""

from __future__ import annotations

import grpc

from services.scheduler.execute_request import error_response
from stageserve.errors import StageError, queue_full, unavailable
from stageserve.recorder import RequestRecorder, failure_reason
from stageserve.statistics import StatsBook
from stageserve.telemetry import TritonMetrics, model_labels


def test_reasons_follow_the_code_and_the_rejected_flag() -> None:
    assert failure_reason(grpc.StatusCode.UNAVAILABLE, rejected=True) == "REJECTED"
    assert failure_reason(grpc.StatusCode.UNAVAILABLE) == "OTHER"
    assert failure_reason(grpc.StatusCode.INTERNAL) == "BACKEND"
    assert failure_reason(grpc.StatusCode.CANCELLED) == "CANCELED"
    assert failure_reason(grpc.StatusCode.RESOURCE_EXHAUSTED) == "REJECTED"


def test_a_full_queue_travels_as_a_typed_rejection() -> None:
    err = queue_full("Exceeds maximum queue size: the queue of model 'm' is full")
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.rejected
    resp = error_response(7, err)
    assert resp.rejected and resp.code == grpc.StatusCode.UNAVAILABLE.value[0]
    # another UNAVAILABLE mentioning a full queue is not a rejection
    other = error_response(8, unavailable("the queue of model 'm' is full of surprises"))
    assert not other.rejected
    assert not StageError(grpc.StatusCode.UNAVAILABLE, "x").rejected


def test_the_recorder_counts_a_rejection_under_rejected() -> None:
    metrics = TritonMetrics()
    recorder = RequestRecorder(StatsBook(), metrics)
    recorder.failure("m", 1, 1_000, grpc.StatusCode.UNAVAILABLE, rejected=True)
    recorder.failure("m", 1, 1_000, grpc.StatusCode.UNAVAILABLE)
    labels = model_labels("m", 1)
    count = metrics.get
    assert count("nv_inference_request_failure", (*labels, ("reason", "REJECTED"))) == 1
    assert count("nv_inference_request_failure", (*labels, ("reason", "OTHER"))) == 1
