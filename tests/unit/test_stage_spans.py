"""The spans the scheduler and the rate limiter emit for traced requests
(services/scheduler/batch_spans.py, ensemble_spans.py, model_queue.py's
grant bookkeeping, services/ratelimiter/service.py's grant spans), recorded
by the real OpenTelemetry SDK into its in-memory exporter. The worker and
rate limiter on the other side of the scheduler are stand-ins here, as in
test_batch_run.py; tests/integration/test_tracing_otel.py runs the same
paths through real stages and a real OTLP receiver."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.ratelimiter.service import record_grant_spans
from services.scheduler.batch_run import BatchRun, RunState
from services.scheduler.batch_strategy import Queued, QueueStrategy
from services.scheduler.clients import Granted, WorkerCallError
from services.scheduler.ensemble import run_ensemble
from services.scheduler.model_queue import ModelQueue
from stageserve import trace_spans
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import SchedulerSettings
from stageserve.tracing import MODE_OPENTELEMETRY, TraceConfig

GRANT = Granted(grant_id="g1", instance_id="m_0", worker_address="10.0.0.7:5000")
TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736


def _traceparent(span_id: int, trace_id: int = TRACE) -> str:
    return trace_spans.Parent(trace_id, span_id).traceparent()


@pytest.fixture
def spans() -> Iterator[tuple[trace_spans.SpanEmitter, InMemorySpanExporter]]:
    """This process's stage spans, exported to memory."""
    exporter = InMemorySpanExporter()
    config = TraceConfig(mode=MODE_OPENTELEMETRY)
    emitter = trace_spans.SpanEmitter("scheduler", config, exporter=exporter)
    stage = trace_spans.StageSpans("scheduler", None)
    stage._emitter = emitter
    trace_spans.STAGE = stage
    try:
        yield emitter, exporter
    finally:
        trace_spans.STAGE = None
        emitter.close()


def _finished(
    got: tuple[trace_spans.SpanEmitter, InMemorySpanExporter],
) -> list[ReadableSpan]:
    emitter, exporter = got
    emitter.provider.force_flush()
    return list(exporter.get_finished_spans())


def _parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None
    return span.parent.span_id


def _spec(extra: str = "") -> ModelSpec:
    return to_spec(
        parse_config_text(
            f"""name: "m" platform: "onnxruntime_onnx" max_batch_size: 8
            input [ {{ name: "I" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "O" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            {extra}"""
        )
    )


DYNAMIC = "dynamic_batching { }"


def _msg(n: int, traceparent: str = "") -> pb.ScheduleRequest:
    return pb.ScheduleRequest(
        id=n, model="m", batch_size=1, traceparent=traceparent,
        inputs=[pb.Tensor(name="I", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip


def _ok(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
    resp = pb.ExecuteResponse(compute_infer_ns=5)
    for _ in request.request_batch_sizes:
        resp.results.add(outputs=[pb.Tensor(name="O", datatype="FP32", raw=bytes(8))])
    return resp


class Worker:
    """Answers each Execute with the next of `answers` (a response, or
    raises), then with outputs."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.requests: list[pb.ExecuteRequest] = []

    def is_broken(self, _address: str) -> bool:
        return False

    async def execute(self, _address, request, _on_part=None):
        self.requests.append(request)
        answer = self.answers.pop(0) if self.answers else _ok
        if isinstance(answer, Exception):
            raise answer
        return answer(request)


# ------------------------------------------------------------ batch / requeue


def test_requeued_batch_exports_both_execute_attempts_and_its_batch_spans(spans) -> None:
    strategy = QueueStrategy(_spec(DYNAMIC))
    traced = Queued(_msg(1, _traceparent(0xA1)), lambda _r: None, 1_000)
    plain = Queued(_msg(2), lambda _r: None, 1_000)
    strategy.add(traced)
    strategy.add(plain)
    gone = WorkerCallError.answered(
        pb.ExecuteResponse(failure=pb.MODEL_NOT_FOUND, message="instance m_0 is not hosted here")
    )
    worker = Worker(gone, _ok)
    answers: list[pb.ScheduleResponse] = []

    def deliver(_q: Queued, response: pb.ScheduleResponse) -> None:
        answers.append(response)

    run = BatchRun("m", worker, None, deliver, strategy.requeue, Histogram())  # type: ignore[arg-type]

    async def both_attempts() -> None:
        for _ in range(2):
            formed_ns = trace_spans.time.monotonic_ns()
            batch = strategy.next_batch(formed_ns).batch
            assert batch is not None
            await run.run(_spec(DYNAMIC), batch, GRANT, RunState(), lambda: None, formed_ns)

    asyncio.run(both_attempts())
    assert len(answers) == 2 and not any(a.failure for a in answers)  # answered once, by run 2
    got = _finished(spans)
    by_name: dict[str, list[ReadableSpan]] = {}
    for s in got:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == ["batch", "execute", "queue"]  # the untraced request has none
    assert all(_parent_id(s) == 0xA1 for s in got)  # all under the gateway's span
    first, second = sorted(by_name["execute"], key=lambda s: s.start_time or 0)
    assert first.attributes is not None and second.attributes is not None
    assert (first.attributes["stageserve.attempt"], second.attributes["stageserve.attempt"]) == (
        1,
        2,
    )
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "instance m_0 is not hosted here"
    assert second.status.status_code is StatusCode.UNSET
    # each attempt: queue -> batch -> execute, end to end
    for attempt, execute in enumerate((first, second)):
        queue, batch = by_name["queue"][attempt], by_name["batch"][attempt]
        assert queue.end_time == batch.start_time
        assert batch.end_time == execute.start_time
        assert batch.attributes is not None and batch.attributes["stageserve.batch_size"] == 2
    # the worker learns each attempt's execute span as its traced row's parent
    assert [r.traceparents[1] for r in worker.requests] == ["", ""]
    assert [trace_spans.parse_traceparent(r.traceparents[0]) for r in worker.requests] == [
        trace_spans.Parent(TRACE, first.context.span_id),
        trace_spans.Parent(TRACE, second.context.span_id),
    ]


class Histogram:
    def observe(self, _value: float) -> None:
        pass


def test_a_worker_lost_mid_batch_ends_the_execute_span_with_the_error(spans) -> None:
    q = Queued(_msg(1, _traceparent(0xA2)), lambda _r: None, 1_000)
    lost = WorkerCallError(grpc.StatusCode.UNAVAILABLE, "stream closed")
    answers: list[pb.ScheduleResponse] = []
    workers: Any = Worker(lost)
    run = BatchRun(
        "m", workers, None, lambda _q, r: answers.append(r), lambda _b: False, Histogram()
    )
    asyncio.run(run.run(_spec(), [q], GRANT, RunState(), lambda: None, 1_000))
    assert answers[0].failure == pb.STAGE_UNAVAILABLE  # no other instance re-runs it
    (execute,) = [s for s in _finished(spans) if s.name == "execute"]
    assert execute.status.status_code is StatusCode.ERROR
    assert execute.status.description == "stream closed"


# ------------------------------------------------------------ grants


def test_one_grant_span_per_traced_request_of_an_acquire(spans) -> None:
    request = pb.AcquireRequest(
        model="m", version=1, traceparents=[_traceparent(0xB1), "junk", _traceparent(0xB2)]
    )
    granted = pb.AcquireResponse(granted=True, instance=pb.InstanceInfo(instance_id="m_0"))
    refused = pb.AcquireResponse(granted=False, reason="every instance is busy")
    asyncio.run(record_grant_spans(request, granted, 10, 20))
    asyncio.run(record_grant_spans(request, refused, 30, 40))
    got = _finished(spans)
    assert [(s.name, _parent_id(s)) for s in got] == [
        ("grant", 0xB1), ("grant", 0xB2), ("grant", 0xB1), ("grant", 0xB2)
    ]  # fmt: skip
    assert [s.status.status_code for s in got] == [StatusCode.UNSET] * 2 + [StatusCode.ERROR] * 2
    assert got[0].attributes is not None and got[0].attributes["stageserve.instance"] == "m_0"


class RateLimiter:
    """Grants on demand: each acquire waits until the test lets it through."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.go = asyncio.Event()
        self.lost: set[str] = set()

    async def acquire(self, _model: str, _version: int, traceparents=(), *_filter) -> Granted:
        self.asked.append(list(traceparents))
        await self.go.wait()
        self.go.clear()
        return GRANT

    async def release(self, _grant_id: str, failed: bool = False) -> None:
        pass


def test_an_acquire_names_every_traced_request_waiting_and_no_other() -> None:
    async def body() -> tuple[list[list[str]], int]:
        limiter, answered = RateLimiter(), asyncio.Event()
        count = 0

        def respond(_r: pb.ScheduleResponse) -> None:
            nonlocal count
            count += 1
            if count in (3, 4):
                answered.set()

        client: Any = limiter
        workers: Any = Worker()
        queue = ModelQueue("m", 1, _spec(DYNAMIC), client, workers, SchedulerSettings())
        try:
            for n, tp in enumerate((_traceparent(0xC1), "", _traceparent(0xC2))):
                queue.submit(_msg(n, tp), respond, wake=False)
            queue.wake()
            while not limiter.asked:
                await asyncio.sleep(0)
            limiter.go.set()  # one grant: the three requests run as one batch
            await answered.wait()
            answered.clear()
            # the next traced request runs on the held grant: it asks for none,
            # and no later acquire names it
            queue.submit(_msg(9, _traceparent(0xC3)), respond)
            await answered.wait()
            return limiter.asked, count
        finally:
            queue.close()

    asked, count = asyncio.run(body())
    assert count == 4
    assert asked == [[_traceparent(0xC1), _traceparent(0xC2)]]


# ------------------------------------------------------------ ensembles

ENSEMBLE = """name: "ens" platform: "ensemble" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "m" model_version: -1
    input_map { key: "I" value: "IN" } output_map { key: "O" value: "MID" } },
  { model_name: "m" model_version: -1
    input_map { key: "I" value: "MID" } output_map { key: "O" value: "OUT" } }
] }"""


def test_each_composing_request_is_a_span_under_the_ensembles(spans) -> None:
    steps: list[pb.ScheduleRequest] = []

    async def submit(request: pb.ScheduleRequest, stat: pb.StepStat) -> pb.ScheduleResponse:
        steps.append(request)
        return pb.ScheduleResponse(
            outputs=[pb.Tensor(name="O", datatype="FP32", shape=[1, 2], raw=bytes(8))]
        )

    msg = pb.ScheduleRequest(
        id=1, model="ens", batch_size=1, traceparent=_traceparent(0xD1),
        inputs=[pb.Tensor(name="IN", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip
    resp = asyncio.run(run_ensemble(msg, to_spec(parse_config_text(ENSEMBLE)), submit))
    assert not resp.failure
    got = _finished(spans)
    assert [(s.name, _parent_id(s)) for s in got] == [("InferRequest", 0xD1)] * 2
    assert [s.attributes["triton.model_name"] for s in got if s.attributes] == ["m", "m"]
    # each step's request carries its own span: its stages' spans go under it
    assert [trace_spans.parse_traceparent(r.traceparent) for r in steps] == [
        trace_spans.Parent(TRACE, s.context.span_id) for s in got
    ]
    assert got[0].end_time is not None and got[1].start_time is not None
    assert got[0].end_time <= got[1].start_time  # the second step needs the first's output


def test_an_untraced_ensemble_costs_no_span(spans) -> None:
    async def submit(request: pb.ScheduleRequest, stat: pb.StepStat) -> pb.ScheduleResponse:
        assert not request.traceparent
        return pb.ScheduleResponse(
            outputs=[pb.Tensor(name="O", datatype="FP32", shape=[1, 2], raw=bytes(8))]
        )

    msg = pb.ScheduleRequest(
        id=1, model="ens", batch_size=1,
        inputs=[pb.Tensor(name="IN", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip
    asyncio.run(run_ensemble(msg, to_spec(parse_config_text(ENSEMBLE)), submit))
    assert _finished(spans) == []
