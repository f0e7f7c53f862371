"""services/scheduler/decoupled.py: a decoupled batch's responses per request;
finals through the queue's `deliver` (preserve_ordering), earlier ones direct."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from services.scheduler.decoupled import DecoupledBatch
from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb


@dataclass
class _Q:
    id: int
    enqueue_ns: int = 0
    got: list[pb.ScheduleResponse] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.msg = pb.ScheduleRequest(id=self.id)

    def respond(self, response: pb.ScheduleResponse) -> None:
        self.got.append(response)


def _part(index: int, final: bool, value: bytes = b"", has_response: bool = True):
    part = pb.DecoupledPart(request_index=index, final=final, has_response=has_response)
    if has_response:
        part.response.outputs.add(name="OUT", raw=value)
    return part


def test_finals_go_through_deliver_and_earlier_responses_straight() -> None:
    batch = [_Q(1), _Q(2)]
    delivered: list[tuple[int, pb.ScheduleResponse]] = []
    db = DecoupledBatch(batch, 10, 2, lambda q, r: delivered.append((q.msg.id, r)))
    db.on_part(pb.ExecuteResponse(more=True, parts=[_part(0, False, b"a"), _part(1, False, b"b")]))
    assert [r.more for r in batch[0].got] == [True] and [r.more for r in batch[1].got] == [True]
    db.on_part(pb.ExecuteResponse(more=True, parts=[_part(1, True, b"c")]))
    assert [(i, r.more, r.outputs[0].raw) for i, r in delivered] == [(2, False, b"c")]
    db.finish(None)  # request 1 had no final: an empty one, through deliver
    assert [(i, r.no_response) for i, r in delivered] == [(2, False), (1, True)]
    assert len(batch[0].got) == 1 and len(batch[1].got) == 1
    assert db.sent_any


def test_finish_with_an_error_answers_the_open_requests_only() -> None:
    batch = [_Q(1), _Q(2)]
    db = DecoupledBatch(batch, 0, 2)  # default: straight to the request
    db.on_part(pb.ExecuteResponse(more=True, parts=[_part(0, True, has_response=False)]))
    db.finish(StageError(grpc.StatusCode.UNAVAILABLE, "worker gone"))
    assert [(r.failure, r.no_response) for r in batch[0].got] == [(pb.FAILURE_NONE, True)]
    assert [(r.failure, r.message) for r in batch[1].got] == [(pb.STAGE_UNAVAILABLE, "worker gone")]


def test_execute_returned_runs_on_returned_once_and_parts_go_on() -> None:
    """The worker's execute_returned message frees the grant (on_returned) once;
    the batch keeps forwarding the parts that come after it."""
    batch = [_Q(1)]
    returned: list[bool] = []
    db = DecoupledBatch(batch, 0, 1, on_returned=lambda: returned.append(True))
    db.on_part(pb.ExecuteResponse(more=True, execute_returned=True))
    assert returned == [True] and db.returned and not db.sent_any and batch[0].got == []
    db.on_part(pb.ExecuteResponse(more=True, parts=[_part(0, False, b"a")]))
    db.on_part(pb.ExecuteResponse(more=True, execute_returned=True, parts=[_part(0, True, b"b")]))
    assert returned == [True]
    assert [(r.more, r.outputs[0].raw) for r in batch[0].got] == [(True, b"a"), (False, b"b")]
    db.finish(None)  # every request had its final: nothing more
    assert len(batch[0].got) == 2


def test_padding_rows_are_skipped_and_the_first_real_row_leads() -> None:
    """A sequence batch's rows may be None (the direct strategy's padding):
    what the model sends for them goes nowhere, finish skips them."""
    real = _Q(7)
    delivered: list[pb.ScheduleResponse] = []
    db = DecoupledBatch([None, real], 0, 2, lambda q, r: delivered.append(r))
    db.on_part(pb.ExecuteResponse(more=True, parts=[_part(0, True, b"pad"), _part(1, False, b"x")]))
    assert [r.outputs[0].raw for r in real.got] == [b"x"] and delivered == []
    db.finish(None)
    assert len(delivered) == 1 and delivered[0].id == 7 and delivered[0].no_response
    assert delivered[0].timing.batch_leader
