"""The scheduler's spans of a batch's traced requests (stageserve/trace_spans.py),
per traced request, all under the gateway's span the request carries:

- "queue": enqueued -> the strategy picked it into a batch;
- "batch": picked -> the batch sent to the worker (building the worker's
  request, a sequence batch's claim in Redis);
- "execute": sent -> the worker answered, with the attempt number (a batch
  whose instance went away runs again elsewhere: each attempt is a span, a
  failed one ends with the error).

The worker's compute spans go under "execute", whose traceparent travels in
ExecuteRequest.traceparents."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from services.scheduler.batch_strategy import Queued
from stageserve import trace_spans
from stageserve.generated import stageserve_pb2 as pb


class BatchSpans:
    __slots__ = ("emitter", "live")

    def __init__(self, emitter: trace_spans.SpanEmitter, live: list[Any]) -> None:
        self.emitter = emitter
        self.live = live

    def end(self, end_ns: int, error: str = "") -> None:
        for span in self.live:
            self.emitter.end(span, end_ns, error)


async def start_batch_spans(
    rows: Sequence[Queued | None], request: pb.ExecuteRequest, instance: str, formed_ns: int
) -> BatchSpans | None:
    """Record the queue and batch spans, start the execute spans and fill the
    request's traceparents; None when spans cannot be emitted (no trace settings)."""
    stage = trace_spans.STAGE
    emitter = await stage.emitter() if stage is not None else None
    if emitter is None:
        return None
    sent_ns = time.monotonic_ns()
    total = sum(request.request_batch_sizes)
    live = []
    parents = []
    for q in rows:
        parent = trace_spans.parse_traceparent(q.msg.traceparent) if q is not None else None
        if q is None or parent is None:
            parents.append("")
            continue
        size = {"stageserve.batch_size": total}
        emitter.span("queue", parent, q.enqueue_ns, formed_ns, size)
        batch = {**size, "stageserve.instance": instance}
        emitter.span("batch", parent, formed_ns, sent_ns, batch)
        attributes = {**batch, "stageserve.attempt": q.attempts + 1}
        span, context = emitter.start("execute", parent, sent_ns, attributes)
        live.append(span)
        parents.append(context.traceparent())
    request.traceparents.extend(parents)
    return BatchSpans(emitter, live)
