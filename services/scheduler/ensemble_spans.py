"""A traced ensemble's composing requests (stageserve/trace_spans.py): as in
Triton, each step's request has its own "InferRequest" span, a child of the
ensemble's request span, named for the composing model; the step's request
carries that span's traceparent, so its queue, batch, execute and compute
spans (and the rate limiter's grant) nest under it, all in one trace."""

from __future__ import annotations

from typing import Any

from stageserve import trace_spans
from stageserve.generated import stageserve_pb2 as pb


class StepSpan:
    __slots__ = ("emitter", "span")

    def __init__(self, emitter: trace_spans.SpanEmitter, span: Any) -> None:
        self.emitter = emitter
        self.span = span

    def end(self, end_ns: int, resp: pb.ScheduleResponse) -> None:
        self.emitter.end(self.span, end_ns, resp.message if resp.failure else "")


async def start_step_span(
    ensemble: pb.ScheduleRequest, request: pb.ScheduleRequest, start_ns: int
) -> StepSpan | None:
    """The step's span, its traceparent set on `request`; None when the
    ensemble's request is untraced or spans are not emitted (triton mode)."""
    parent = trace_spans.parse_traceparent(ensemble.traceparent)
    stage = trace_spans.STAGE
    emitter = await stage.emitter() if stage is not None and parent is not None else None
    if emitter is None:
        return None
    attributes = {
        "triton.model_name": request.model,
        "triton.model_version": request.version,
        "stageserve.ensemble": ensemble.model,
    }
    span, context = emitter.start("InferRequest", parent, start_ns, attributes)
    request.traceparent = context.traceparent()
    return StepSpan(emitter, span)
