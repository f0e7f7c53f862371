"""The gateway's nv_inference_pending_request_count from the schedulers'
QueueStats (services/gateway/queue_metrics.py, its pure part)."""

from __future__ import annotations

from services.gateway.queue_metrics import pending_counts
from stageserve.generated import stageserve_pb2 as pb


def _report(*queues: tuple[str, int, int]) -> pb.QueueStatsResponse:
    return pb.QueueStatsResponse(
        models=[pb.ModelQueueStats(model=m, version=v, pending=n) for m, v, n in queues]
    )


def test_every_ready_version_is_listed_with_zero_when_nothing_queues() -> None:
    ready = [("simple", 1), ("simple", 2), ("idle", 1)]
    assert pending_counts(ready, []) == {("simple", 1): 0, ("simple", 2): 0, ("idle", 1): 0}


def test_counts_come_from_the_scheduler_that_holds_the_queue() -> None:
    ready = [("a", 1), ("b", 1)]
    reports = [_report(("a", 1, 4)), _report(("b", 1, 0))]
    assert pending_counts(ready, reports) == {("a", 1): 4, ("b", 1): 0}


def test_a_model_queued_in_two_schedulers_while_it_moves_counts_both() -> None:
    reports = [_report(("a", 1, 3)), _report(("a", 1, 2))]
    assert pending_counts([("a", 1)], reports) == {("a", 1): 5}


def test_queues_of_versions_not_ready_are_not_shown() -> None:
    reports = [_report(("a", 1, 2), ("a", 2, 7), ("gone", 1, 1))]
    assert pending_counts([("a", 1)], reports) == {("a", 1): 2}
