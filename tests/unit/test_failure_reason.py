"""Triton's nv_inference_request_failure reasons come from the typed reason
each stage passes on (stageserve.proto's `failure` fields), never from a
status code or a message: a full queue is REJECTED because the scheduler
says so, and a model's failure is BACKEND where a stage's own INTERNAL
error is OTHER."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from services.gateway.dataplane import DataPlane
from services.gateway.model_table import ModelTable
from services.scheduler.batch_run import BatchRun, RunState
from services.scheduler.batch_strategy import Queued
from services.scheduler.clients import Granted, WorkerCallError
from services.scheduler.execute_request import error_response
from services.worker.service import _worker_error
from stageserve.config import parse_config_text, to_spec
from stageserve.errors import StageError, queue_full, stage_fault, triton_reason, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.recorder import RequestRecorder
from stageserve.statistics import StatsBook
from stageserve.telemetry import TritonMetrics, model_labels


def _wire(message):
    """The message as the next stage reads it off the stream."""
    return type(message).FromString(message.SerializeToString())


def test_the_label_follows_the_reason_not_the_code() -> None:
    assert triton_reason(pb.QUEUE_REJECTED) == "REJECTED"
    assert triton_reason(pb.STAGE_UNAVAILABLE) == "OTHER"  # the same UNAVAILABLE code
    assert triton_reason(pb.BACKEND_FAILED) == "BACKEND"
    assert triton_reason(pb.STAGE_FAULT) == "OTHER"  # the same INTERNAL code
    assert triton_reason(pb.CANCELLED) == "CANCELED"
    assert triton_reason(pb.RESOURCE_EXHAUSTED) == "REJECTED"


def test_a_full_queue_travels_as_a_typed_rejection() -> None:
    err = queue_full("Exceeds maximum queue size: the queue of model 'm' is full")
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.rejected
    resp = _wire(error_response(7, err))
    assert resp.failure == pb.QUEUE_REJECTED
    assert StageError.of(resp.failure, resp.message).code == grpc.StatusCode.UNAVAILABLE
    # another UNAVAILABLE mentioning a full queue is not a rejection
    other = _wire(error_response(8, unavailable("the queue of model 'm' is full of surprises")))
    assert other.failure == pb.STAGE_UNAVAILABLE
    assert not StageError(grpc.StatusCode.UNAVAILABLE, "x").rejected


def test_the_recorder_labels_each_reason() -> None:
    metrics = TritonMetrics()
    recorder = RequestRecorder(StatsBook(), metrics)
    for reason in (pb.QUEUE_REJECTED, pb.STAGE_UNAVAILABLE, pb.BACKEND_FAILED, pb.STAGE_FAULT):
        recorder.failure("m", 1, 1_000, reason)
    labels = model_labels("m", 1)
    count = metrics.get
    assert count("nv_inference_request_failure", (*labels, ("reason", "REJECTED"))) == 1
    assert count("nv_inference_request_failure", (*labels, ("reason", "BACKEND"))) == 1
    assert count("nv_inference_request_failure", (*labels, ("reason", "OTHER"))) == 2


_SPEC = to_spec(
    parse_config_text(
        """name: "m" platform: "onnxruntime_onnx" max_batch_size: 8
        input [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "O" data_type: TYPE_FP32 dims: [ 2 ] } ]"""
    )
)


class _Histogram:
    def observe(self, _value: float) -> None:
        pass


class _Worker:
    """The scheduler's WorkerClients end: the worker's answer, read off the
    wire, fails the call as WorkerStream.execute fails it."""

    def __init__(self, answer: pb.ExecuteResponse) -> None:
        self.answer = answer

    async def execute(self, _address, request, _on_part=None):
        resp = _wire(self.answer)
        resp.id = request.id
        raise WorkerCallError.answered(resp)


def _scheduled(worker_answer: pb.ExecuteResponse) -> pb.ScheduleResponse:
    """The ScheduleResponse the scheduler sends the gateway for a one-request batch."""
    answers: list[pb.ScheduleResponse] = []
    msg = pb.ScheduleRequest(
        id=1, batch_size=1,
        inputs=[pb.Tensor(name="I", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip
    run = BatchRun(
        "m",
        _Worker(worker_answer),  # type: ignore[arg-type]
        None,
        lambda _q, r: answers.append(r),
        lambda _b: False,
        _Histogram(),
    )
    grant = Granted(grant_id="g", instance_id="w/m/1/0", worker_address="w:1")
    batch = [Queued(msg, answers.append, 0)]
    asyncio.run(run.run(_SPEC, batch, grant, RunState(), lambda: None))
    return _wire(answers[0])


def test_a_workers_backend_error_reaches_the_gateway_as_backend() -> None:
    """A worker's batch failure (INTERNAL, BACKEND_FAILED) crosses the scheduler
    with its reason; the gateway answers INTERNAL and counts it BACKEND."""
    failed = _worker_error(pb.ExecuteRequest(id=3), RuntimeError("boom"))
    resp = _scheduled(failed)
    assert (resp.failure, resp.message) == (pb.BACKEND_FAILED, "worker error: RuntimeError")
    err = StageError.of(resp.failure, resp.message)
    assert err.code == grpc.StatusCode.INTERNAL

    metrics = TritonMetrics()
    dataplane = DataPlane(ModelTable(), lifecycle=None, scheduler=None)  # type: ignore[arg-type]
    dataplane.recorder = RequestRecorder(StatsBook(), metrics)
    fault = stage_fault("scheduler error: KeyError")
    ensemble = pb.ScheduleResponse(
        steps=[
            pb.StepStat(model="a", version=1, failure=resp.failure, message=resp.message),
            pb.StepStat(model="b", version=1, failure=fault.reason, message=fault.message),
        ]
    )
    dataplane._record_steps(_wire(ensemble))
    for model, reason in (("a", "BACKEND"), ("b", "OTHER")):  # both answered INTERNAL
        labels = (*model_labels(model, 1), ("reason", reason))
        assert metrics.get("nv_inference_request_failure", labels) == 1


def test_a_python_models_unknown_error_keeps_its_code_across_stages() -> None:
    """TritonError.UNKNOWN has a reason of its own, so the client still gets UNKNOWN."""
    answer = pb.ExecuteResponse()
    answer.results.add(failure=pb.UNKNOWN_FAILURE, message="model said so")
    answers: list[pb.ScheduleResponse] = []

    class Answers:
        async def execute(self, _address, request, _on_part=None):
            return _wire(answer)

    msg = pb.ScheduleRequest(id=1, batch_size=1)
    workers: Any = Answers()
    run = BatchRun(
        "m", workers, None, lambda _q, r: answers.append(r), lambda _b: False, _Histogram()
    )
    grant = Granted(grant_id="g", instance_id="w/m/1/0", worker_address="w:1")
    asyncio.run(run.run(_SPEC, [Queued(msg, answers.append, 0)], grant, RunState(), lambda: None))
    resp = _wire(answers[0])
    assert StageError.of(resp.failure, resp.message).code == grpc.StatusCode.UNKNOWN
