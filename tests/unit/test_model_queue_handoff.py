"""services/scheduler/model_queue.py: when a batch's result comes back, the
model's one instance takes its next batch before that result's answers go out.

ModelQueue runs on a real asyncio loop here; the rate limiter and the worker
are small fakes of the two clients it calls (one instance, results released
by the test), so the order of hand-offs is what the queue itself does."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.clients import Granted
from services.scheduler.model_queue import ModelQueue
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import SchedulerSettings

GRANT = Granted(grant_id="g1", instance_id="m_0", worker_address="10.0.0.7:5000")


def _spec(extra: str):
    return to_spec(
        parse_config_text(
            f"""name: "m" platform: "onnxruntime_onnx" max_batch_size: 2
            input [ {{ name: "I" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "O" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            {extra}"""
        )
    )


@dataclass
class OneInstance:
    """The rate limiter's side: one instance, granted once and kept by the
    queue's grant pool (rate limiting off)."""

    lost: set[str] = field(default_factory=set)
    granted: int = 0

    async def acquire(
        self, _model: str, _version: int, _traced: list[str], *_filter
    ) -> Granted | None:
        if self.granted:
            await asyncio.Event().wait()  # the one instance is held: no second grant
        self.granted += 1
        return GRANT

    async def release(self, _grant_id: str, failed: bool = False) -> None:
        self.granted -= 1


@dataclass
class Worker:
    """Executes nothing until the test releases a batch's result."""

    batches: list[list[int]] = field(default_factory=list)
    results: list[asyncio.Future] = field(default_factory=list)

    def is_broken(self, _address: str) -> bool:
        return False

    async def execute(
        self, _address: str, request: pb.ExecuteRequest, _on_part
    ) -> pb.ExecuteResponse:
        self.batches.append(list(request.request_batch_sizes))
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.results.append(done)
        return await done


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "not within 5 s"
        await asyncio.sleep(0.001)


def _result(size: int) -> pb.ExecuteResponse:
    resp = pb.ExecuteResponse()
    for _ in range(size):
        resp.results.add(outputs=[pb.Tensor(name="O", datatype="FP32", raw=bytes(8))])
    return resp


def _request(n: int) -> pb.ScheduleRequest:
    return pb.ScheduleRequest(
        id=n, batch_size=1,
        inputs=[pb.Tensor(name="I", datatype="FP32", shape=[1, 2], raw=bytes(8))],
    )  # fmt: skip


async def _answers_meet_the_next_batch(
    extra: str, failing_formations: int = 0
) -> list[tuple[int, int, int]]:
    """Four requests, batches of two on one instance: for each answer, its
    request id, the requests still queued and the batches executing then.
    `failing_formations`: how many batch formations after the first raise."""
    worker = Worker()
    fakes: tuple[Any, Any] = (OneInstance(), worker)  # the two clients' fakes
    queue = ModelQueue("m", 1, _spec(extra), *fakes, SchedulerSettings())
    seen: list[tuple[int, int, int]] = []
    failures: list[str] = []
    answered = asyncio.Event()
    form = queue.strategy.next_batch
    calls = 0

    def next_batch(now_ns: int, instance: str | None = None):
        nonlocal calls
        calls += 1
        if 1 < calls <= 1 + failing_formations:
            raise RuntimeError("a bug in batch formation")
        return form(now_ns, instance)

    queue.strategy.next_batch = next_batch  # type: ignore[method-assign]

    def respond_to(n: int):
        def respond(response: pb.ScheduleResponse) -> None:
            if response.failure:
                failures.append(response.message)
            seen.append((n, queue.pending, queue.executing))
            if len(seen) == 4:
                answered.set()

        return respond

    try:
        for n in range(1, 5):
            queue.submit(_request(n), respond_to(n))
        await _until(lambda: len(worker.results) == 1)  # the first batch reached the worker
        assert queue.pending == 2 and worker.batches == [[1, 1]]
        worker.results[0].set_result(_result(2))
        await _until(lambda: len(worker.results) == 2)
        worker.results[1].set_result(_result(2))
        await asyncio.wait_for(answered.wait(), 5)
        assert worker.batches == [[1, 1], [1, 1]]
        assert failures == []
        return seen
    finally:
        queue.close()


def test_the_next_batch_is_formed_before_the_finished_batchs_answers_go_out() -> None:
    seen = asyncio.run(_answers_meet_the_next_batch("dynamic_batching { }"))
    # requests 1 and 2 are answered with 3 and 4 already out of the queue and
    # executing: their batch started when 1 and 2's result came back
    assert seen[:2] == [(1, 0, 2), (2, 0, 2)]
    assert [n for n, _, _ in seen] == [1, 2, 3, 4]


def test_preserve_ordering_keeps_the_answers_in_order_with_the_early_start() -> None:
    extra = "dynamic_batching { preserve_ordering: true }"
    seen = asyncio.run(_answers_meet_the_next_batch(extra))
    assert [n for n, _, _ in seen] == [1, 2, 3, 4]
    assert seen[0][1:] == (0, 2)


def test_a_failing_next_batch_neither_fails_the_finished_one_nor_loses_the_grant() -> None:
    # the hand-off's formation raises: requests 1 and 2 are still answered,
    # and the dispatch loop runs 3 and 4 on the grant put back
    seen = asyncio.run(_answers_meet_the_next_batch("dynamic_batching { }", 1))
    assert [n for n, _, _ in seen] == [1, 2, 3, 4]
