"""One sampled request's trace at the gateway. In opentelemetry mode
(RequestTrace): the root span "InferRequest" (under the client's traceparent
when it sent one), its "validation" child, and the traceparent the
scheduler's spans go under (ScheduleRequest.traceparent); the other stages
emit their own spans. In triton mode (FileRequestTrace): the request's
entries in Triton's trace file, from the gateway's times and the ones the
scheduler returns (its Timing, filled for a request with a traceparent)."""

from __future__ import annotations

from typing import Any

from services.gateway.trace_file import TraceFile, trace_records
from stageserve.generated import stageserve_pb2 as pb
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

    def end(self, end_ns: int, error: str = "", timing: pb.Timing | None = None) -> None:
        self.emitter.end(self.root, end_ns, error)


class FileRequestTrace:
    __slots__ = ("file", "trace_id", "model", "version", "request_id", "start_ns")

    def __init__(
        self, file: TraceFile, model: str, version: int, request_id: str, start_ns: int
    ) -> None:
        self.file = file
        self.trace_id = file.next_id
        file.next_id += 1
        self.model = model
        self.version = version
        self.request_id = request_id
        self.start_ns = start_ns

    def traceparent(self) -> str:
        """Marks the request traced for the scheduler (which then returns its times)."""
        return Parent(self.trace_id, 1).traceparent()

    def validated(self, start_ns: int, end_ns: int) -> None:
        """Triton's file has no validation timestamp."""

    def end(self, end_ns: int, error: str = "", timing: pb.Timing | None = None) -> None:
        self.file.add(
            trace_records(
                self.trace_id,
                self.model,
                self.version,
                self.request_id,
                self.start_ns,
                end_ns,
                timing,
            )
        )
