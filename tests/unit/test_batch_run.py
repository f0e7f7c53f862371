"""services/scheduler/batch_run.py: one formed batch on its instance, and what
its queue learns afterwards (RunState). The worker's side is a stand-in that
answers or fails as a real worker stream does (WorkerCallError with its
reason, or a broken stream's code); the integration tests run the same paths
through real workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from services.scheduler.batch_run import BatchRun, RunState, _shown
from services.scheduler.batch_strategy import Queued
from services.scheduler.clients import Granted, WorkerCallError
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb

GRANT = Granted(grant_id="g1", instance_id="m_0", worker_address="10.0.0.7:5000")


def _spec(extra: str = "", backend: str = 'platform: "onnxruntime_onnx"') -> ModelSpec:
    return to_spec(
        parse_config_text(
            f"""name: "m" {backend} max_batch_size: 8
            input [ {{ name: "I" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "O" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            {extra}"""
        )
    )


def _q(n: int) -> Queued:
    msg = pb.ScheduleRequest(
        id=n, batch_size=1,
        inputs=[pb.Tensor(name="I", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip
    return Queued(msg, lambda _r: None, 0)


class Histogram:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, value: float) -> None:
        self.seen.append(value)


class Worker:
    """Answers every Execute with `answer(request, on_part)`: a response, or raises."""

    def __init__(self, answer: Callable) -> None:
        self.answer = answer
        self.requests: list[pb.ExecuteRequest] = []

    async def execute(self, address, request, on_part=None):
        assert address == GRANT.worker_address
        self.requests.append(request)
        return self.answer(request, on_part)


def _failing(code: grpc.StatusCode, details: str) -> Callable:
    """A broken stream's failure: its status code."""

    def answer(_request, _on_part):
        raise WorkerCallError(code, details)

    return answer


def _answering(reason: pb.FailureReason, message: str) -> Callable:
    """The worker's failed answer: its reason, as the wire carries it."""

    def answer(_request, _on_part):
        raise WorkerCallError.answered(pb.ExecuteResponse(failure=reason, message=message))

    return answer


def _run(
    answer: Callable,
    spec: ModelSpec | None = None,
    requeue: Callable[[list[Queued]], bool] = lambda _b: False,
    batch_size: int = 2,
) -> tuple[RunState, dict[int, list[pb.ScheduleResponse]], Histogram, list[str]]:
    answers: dict[int, list[pb.ScheduleResponse]] = {}
    events: list[str] = []
    hist = Histogram()

    def deliver(q: Queued, response: pb.ScheduleResponse) -> None:
        answers.setdefault(q.msg.id, []).append(response)

    def respond_to(q: Queued) -> Callable[[pb.ScheduleResponse], None]:
        return lambda r: answers.setdefault(q.msg.id, []).append(r)

    batch = [_q(i + 1) for i in range(batch_size)]
    for q in batch:  # a decoupled model's earlier responses go straight to the request
        q.respond = respond_to(q)
    run = BatchRun("m", Worker(answer), None, deliver, requeue, hist)  # type: ignore[arg-type]
    state = RunState()

    def give_back() -> None:
        events.append(f"given back, {len(answers)} answered")

    asyncio.run(run.run(spec or _spec(), batch, GRANT, state, give_back))
    return state, answers, hist, events


def test_a_batch_answers_each_request_with_its_own_outputs_and_timing() -> None:
    def answer(request: pb.ExecuteRequest, _on_part) -> pb.ExecuteResponse:
        assert list(request.request_batch_sizes) == [1, 1]
        assert request.inputs[0].shape == [2, 2]  # the batch's rows, concatenated
        resp = pb.ExecuteResponse(compute_infer_ns=7)
        for i in range(2):
            resp.results.add(outputs=[pb.Tensor(name="O", datatype="FP32", raw=bytes([i]))])
        return resp

    state, answers, hist, events = _run(answer)
    # the instance went back before the answers (the next batch may start)
    assert state == RunState(failed_instance=False, grant_returned=True)
    assert events == ["given back, 0 answered"]
    assert [a[0].outputs[0].raw for a in (answers[1], answers[2])] == [b"\x00", b"\x01"]
    assert [a[0].timing.batch_leader for a in (answers[1], answers[2])] == [True, False]
    assert answers[1][0].timing.batch_size == 2 and answers[2][0].timing.compute_infer_ns == 7
    assert hist.seen == [2]


def test_a_per_request_error_reaches_only_its_request() -> None:
    def answer(_request, _on_part) -> pb.ExecuteResponse:
        resp = pb.ExecuteResponse()
        resp.results.add(failure=pb.INVALID_INPUT, message="bad row")
        resp.results.add(outputs=[pb.Tensor(name="O", datatype="FP32", raw=b"ok")])
        return resp

    state, answers, _, _ = _run(answer)
    assert answers[1][0].failure == pb.INVALID_INPUT
    assert answers[1][0].message == "bad row"
    assert answers[2][0].failure == pb.FAILURE_NONE and answers[2][0].outputs[0].raw == b"ok"
    assert state.failed_instance is False


@pytest.mark.parametrize("reason", [pb.BACKEND_FAILED, pb.INVALID_INPUT])
def test_a_model_error_fails_the_batch_but_not_the_instance(reason: pb.FailureReason) -> None:
    state, answers, hist, _ = _run(_answering(reason, "model 'm' execution failed: boom"))
    for rid in (1, 2):
        assert [(a.failure, a.message) for a in answers[rid]] == [
            (reason, "model 'm' execution failed: boom")
        ]
    assert state.failed_instance is False and hist.seen == []


def test_a_broken_worker_fails_the_batch_and_the_instance() -> None:
    state, answers, _, _ = _run(_failing(grpc.StatusCode.UNAVAILABLE, "stream closed"))
    assert state.failed_instance is True
    message = answers[1][0].message
    assert answers[1][0].failure == pb.STAGE_UNAVAILABLE
    assert "worker 10.0.0.7:5000 failed while executing model 'm' (instance m_0)" in message
    assert "UNAVAILABLE: stream closed" in message


def test_an_instance_unloaded_meanwhile_puts_the_batch_back_unanswered() -> None:
    requeued: list[list[Queued]] = []

    def requeue(batch: list[Queued]) -> bool:
        requeued.append(batch)
        return True

    state, answers, _, _ = _run(
        _answering(pb.MODEL_NOT_FOUND, "instance m_0 is not hosted here"), requeue=requeue
    )
    assert answers == {} and [q.msg.id for q in requeued[0]] == [1, 2]
    assert state.failed_instance is None  # released without blaming the worker


def test_an_unloaded_instance_whose_batch_cannot_go_back_answers_unavailable() -> None:
    state, answers, _, _ = _run(_answering(pb.MODEL_NOT_FOUND, "gone"))
    assert answers[1][0].failure == pb.STAGE_UNAVAILABLE
    assert answers[1][0].message == "model 'm' instance went away: gone"
    assert state.failed_instance is None


DECOUPLED = "model_transaction_policy { decoupled: true }"


def _part(index: int, final: bool, raw: bytes | None = None) -> pb.ExecuteResponse:
    resp = pb.ExecuteResponse(more=True)
    part = resp.parts.add(request_index=index, final=final, has_response=raw is not None)
    if raw is not None:
        part.response.outputs.add(name="O", datatype="FP32", raw=raw)
    return resp


def test_a_decoupled_batch_gives_its_grant_back_once_execute_returned() -> None:
    def answer(_request, on_part) -> pb.ExecuteResponse:
        on_part(_part(0, final=False, raw=b"a"))
        on_part(pb.ExecuteResponse(more=True, execute_returned=True))
        on_part(_part(0, final=True))
        return pb.ExecuteResponse()  # the batch's end: request 2 never answered

    spec = _spec(DECOUPLED, backend='backend: "python"')
    state, answers, _, events = _run(answer, spec=spec)
    assert events == ["given back, 1 answered"] and state.grant_returned is True
    assert [(a.more, bool(a.outputs)) for a in answers[1]] == [(True, True), (False, False)]
    assert [(a.more, a.no_response) for a in answers[2]] == [(False, True)]  # empty final


def test_a_decoupled_batch_that_fails_before_returning_keeps_its_grant_for_the_queue() -> None:
    spec = _spec(DECOUPLED, backend='backend: "python"')
    state, answers, _, events = _run(
        _failing(grpc.StatusCode.UNAVAILABLE, "stream closed"), spec=spec
    )
    assert events == [] and state.grant_returned is False and state.failed_instance is True
    assert all(a[0].failure == pb.STAGE_UNAVAILABLE for a in answers.values())


def _outputs(*names: str) -> list[pb.Tensor]:
    return [pb.Tensor(name=n, datatype="INT32", shape=[1, 1], raw=bytes(4)) for n in names]


@pytest.mark.parametrize(
    "names",
    [
        ("OUT", "START_OUT", "ACC", "ACC2"),  # the state outputs last, as asked for
        ("ACC", "OUT", "ACC2", "START_OUT"),  # another order: still only the client's
        ("OUT", "ACC2", "START_OUT", "ACC"),  # one hidden at the end, one before
    ],
)
def test_a_sequence_answer_leaves_out_its_state_outputs_in_any_order(names) -> None:
    hidden = frozenset({"ACC", "ACC2"})
    result = pb.RequestOutputs(outputs=_outputs(*names))
    answer = pb.ScheduleResponse(id=1, outputs=_shown(result.outputs, hidden))
    assert [t.name for t in answer.outputs] == [n for n in names if n not in hidden]


def test_a_sequence_answer_without_its_state_outputs_keeps_every_output() -> None:
    result = pb.RequestOutputs(outputs=_outputs("OUT", "START_OUT"))
    shown = _shown(result.outputs, frozenset({"ACC"}))
    assert [t.name for t in shown] == ["OUT", "START_OUT"]
