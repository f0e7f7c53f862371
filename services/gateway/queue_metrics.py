"""`nv_inference_pending_request_count` on the gateway's metrics port.

Triton's metrics port lists, for every ready model version, the requests
queued and not yet executing (0 when none; an ensemble's own count stays 0:
its steps queue in the composing models, as here). Here the queues live in
the schedulers, so on each scrape the gateway asks every live scheduler for
its QueueStats, all at once with a short timeout, and sets the gauge from
the answers: the stack's backlog, whichever gateway is scraped. A scheduler
that does not answer in time (one being restarted) is left out of that
scrape. Each scheduler's own metrics port keeps its own share.

`pending_counts` is the pure part; `PendingGauge` asks the schedulers from
the gateway's event loop and is called from the metrics server's thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from services.gateway.model_table import ModelTable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.telemetry import TRITON, TritonMetrics, model_labels

log = logging.getLogger(__name__)

PENDING = "nv_inference_pending_request_count"

#: Per scheduler and scrape: a live scheduler answers QueueStats in
#: milliseconds; Prometheus' own scrape timeout is 10 s by default.
QUEUE_STATS_TIMEOUT_S = 1.0


def pending_counts(
    ready: Iterable[tuple[str, int]], reports: Iterable[pb.QueueStatsResponse]
) -> dict[tuple[str, int], int]:
    """Each ready (model, version)'s queued requests over the schedulers'
    reports: 0 where none queued, the sum where several schedulers hold a
    queue for it (one draining while its heir takes the model). A queue of
    a version no longer ready is not shown, as in Triton."""
    counts = dict.fromkeys(ready, 0)
    for report in reports:
        for queue in report.models:
            key = (queue.model, queue.version)
            if key in counts:
                counts[key] += queue.pending
    return counts


def ready_versions(models: ModelTable) -> list[tuple[str, int]]:
    return [(name, v) for name, e in list(models.entries.items()) for v in e.ready_versions()]


class PendingGauge:
    def __init__(
        self,
        models: ModelTable,
        router: SchedulerRouter,
        loop: asyncio.AbstractEventLoop,
        metrics: TritonMetrics = TRITON,
        timeout_s: float = QUEUE_STATS_TIMEOUT_S,
    ) -> None:
        self.models = models
        self.router = router
        self.loop = loop
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._shown: set[tuple[str, int]] = set()

    def _addresses(self) -> list[str]:
        view = self.router.view
        addresses = set(view.addresses.values()) if view is not None else set()
        if not addresses and self.router.fallback:
            addresses.add(self.router.fallback)
        return sorted(addresses)

    async def _ask(self, address: str) -> pb.QueueStatsResponse | None:
        stub = pb_grpc.SchedulerStub(self.router.link(address).channel)
        try:
            response: pb.QueueStatsResponse = await stub.QueueStats(
                pb.QueueStatsRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("queue stats unanswered", extra={"scheduler": address, "code": exc.code()})
            return None
        return response

    async def collect(self) -> dict[tuple[str, int], int]:
        """The pending counts now, from every scheduler that answered."""
        answers = await asyncio.gather(*(self._ask(a) for a in self._addresses()))
        reports = (a for a in answers if a is not None)
        return pending_counts(ready_versions(self.models), reports)

    def refresh(self) -> None:
        """Set the gauge (from the metrics server's thread): one series per
        ready model version, none for a version no longer ready. The scrape
        goes on with the last values when the loop does not answer in time."""
        collect = self.collect()
        try:
            future = asyncio.run_coroutine_threadsafe(collect, self.loop)
        except RuntimeError:  # the loop closed: the gateway is stopping
            collect.close()
            return
        try:
            counts = future.result(self.timeout_s + 0.5)
        except Exception as exc:  # the scrape must answer whatever the loop did
            future.cancel()
            log.warning("pending counts unavailable", extra={"error": repr(exc)})
            return
        for key in self._shown - counts.keys():
            self.metrics.remove(PENDING, model_labels(*key))
        for key, pending in counts.items():
            self.metrics.set(PENDING, model_labels(*key), pending)
        self._shown = set(counts)
