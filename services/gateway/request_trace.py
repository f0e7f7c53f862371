"""One sampled request's trace at the gateway (opentelemetry mode): the root
span "InferRequest" (under the client's traceparent when it sent one), its
"validation" child, and the traceparent the scheduler's spans go under
(ScheduleRequest.traceparent). The other stages emit their own spans."""

from __future__ import annotations

from typing import Any

from stageserve.trace_spans import Parent, SpanEmitter, parse_traceparent


class RequestTrace:
    __slots__ = ("emitter", "root", "context")

    def __init__(
        self, emitter: SpanEmitter, model: str, version: int, client: str, start_ns: int
    ) -> None:
        self.emitter = emitter
        attributes = {"triton.model_name": model, "triton.model_version": version}
        parent = parse_traceparent(client) if client else None
        self.root: Any
        self.context: Parent
        self.root, self.context = emitter.start(
            "InferRequest", parent, start_ns, attributes, server=True
        )

    def traceparent(self) -> str:
        return self.context.traceparent()

    def validated(self, start_ns: int, end_ns: int) -> None:
        self.emitter.span("validation", self.context, start_ns, end_ns)

    def end(self, end_ns: int, error: str = "") -> None:
        self.emitter.end(self.root, end_ns, error)
