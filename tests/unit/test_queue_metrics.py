"""The gateway's nv_inference_pending_request_count from the schedulers'
QueueStats (services/gateway/queue_metrics.py, its pure part)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from services.gateway.model_table import LOADING, READY, UNLOADING, ModelEntry, ModelTable
from services.gateway.queue_metrics import PENDING, PendingGauge, pending_counts
from stageserve.generated import stageserve_pb2 as pb
from stageserve.net import free_port
from stageserve.scheduler_link import SchedulerLink
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.settings import Settings
from stageserve.telemetry import TritonMetrics, model_labels


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


# ----------------------------------------------------------- PendingGauge


@contextmanager
def _loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _models(**versions: dict[int, str]) -> ModelTable:
    table = ModelTable()
    for name, states in versions.items():
        table.entries[name] = ModelEntry(name, versions=states)
    return table


def _router(fallback: str | None) -> SchedulerRouter:
    settings = Settings()
    return SchedulerRouter(
        None,
        fallback,
        lambda address: SchedulerLink(address, 1.0, settings.stage_tls),
    )


def test_a_scheduler_that_does_not_answer_leaves_zeros_and_the_scrape_goes_on() -> None:
    metrics = TritonMetrics()
    models = _models(simple={1: READY, 2: READY}, loading={1: LOADING})
    with _loop_thread() as loop:
        # nothing listens there: QueueStats fails at once, as a dead scheduler's
        router = _router(f"127.0.0.1:{free_port()}")
        PendingGauge(models, router, loop, metrics).refresh()
        asyncio.run_coroutine_threadsafe(router.close(), loop).result(5)
    assert metrics.get(PENDING, model_labels("simple", 1)) == 0
    text = metrics.render()
    assert 'nv_inference_pending_request_count{model="simple",version="2"} 0' in text
    assert 'model="loading"' not in text  # not ready: no series, as in Triton


def test_a_version_no_longer_ready_loses_its_series() -> None:
    metrics = TritonMetrics()
    models = _models(simple={1: READY})
    with _loop_thread() as loop:
        gauge = PendingGauge(models, _router(None), loop, metrics)
        gauge.refresh()
        assert 'model="simple"' in metrics.render()
        models.entries["simple"].versions[1] = UNLOADING
        gauge.refresh()
    assert 'model="simple"' not in metrics.render()


def test_a_closed_loop_leaves_the_gauge_as_it_was() -> None:
    metrics = TritonMetrics()
    metrics.set(PENDING, model_labels("simple", 1), 3)
    loop = asyncio.new_event_loop()
    loop.close()
    PendingGauge(_models(simple={1: READY}), _router(None), loop, metrics).refresh()
    assert metrics.get(PENDING, model_labels("simple", 1)) == 3
