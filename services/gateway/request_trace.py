"""One sampled request's trace at the gateway. In opentelemetry mode
(RequestTrace): the root span "InferRequest" (under the client's traceparent
when it sent one), its "validation" child, and the traceparent the
scheduler's spans go under (ScheduleRequest.traceparent); the other stages
emit their own spans. In triton mode (FileRequestTrace): the request's
entries in Triton's trace file, from the gateway's times and the ones the
scheduler returns (its Timing, filled for a request with a traceparent)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from services.gateway.trace_file import TraceFile, trace_records
from services.gateway.trace_tensors import (
    BACKEND_OUTPUT,
    QUEUE_INPUT,
    tensor_events,
    tensor_records,
)
from stageserve.generated import stageserve_pb2 as pb
from stageserve.trace_spans import Parent, SpanEmitter, parse_traceparent, wall_ns

TENSORS = "TENSORS"


class RequestTrace:
    __slots__ = ("emitter", "root", "context", "tensors")

    def __init__(
        self,
        emitter: SpanEmitter,
        model: str,
        version: int,
        client: str,
        start_ns: int,
        level: Sequence[str] = ("TIMESTAMPS",),
    ) -> None:
        self.emitter = emitter
        self.tensors = TENSORS in level
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

    def inputs(self, tensors: Iterable[pb.Tensor]) -> None:
        """Level TENSORS: the request's inputs, events of its span."""
        if self.tensors:
            self._events(QUEUE_INPUT, tensors)

    def answered(self, resp: pb.ScheduleResponse) -> None:
        """Level TENSORS: the model's outputs, events of the request's span
        (an ensemble's steps emitted their own spans at the scheduler)."""
        if self.tensors and not resp.failure:
            self._events(BACKEND_OUTPUT, resp.outputs)

    def _events(self, activity: str, tensors: Iterable[pb.Tensor]) -> None:
        at = wall_ns(time.monotonic_ns())
        for name, attributes in tensor_events(activity, tensors):
            self.root.add_event(name, attributes, timestamp=at)

    def end(self, end_ns: int, error: str = "", timing: pb.Timing | None = None) -> None:
        self.emitter.end(self.root, end_ns, error)


class FileRequestTrace:
    __slots__ = (
        "file",
        "trace_id",
        "model",
        "version",
        "request_id",
        "start_ns",
        "level",
        "tensors",
        "steps",
    )

    def __init__(
        self,
        file: TraceFile,
        model: str,
        version: int,
        request_id: str,
        start_ns: int,
        level: Sequence[str] = ("TIMESTAMPS",),
    ) -> None:
        self.level = tuple(level)
        self.tensors: list[dict[str, Any]] | None = [] if TENSORS in level else None
        self.steps: Sequence[pb.StepStat] = ()
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

    def inputs(self, tensors: Iterable[pb.Tensor]) -> None:
        """Level TENSORS: the request's inputs (TENSOR_QUEUE_INPUT)."""
        if self.tensors is not None:
            self.tensors += tensor_records(self.trace_id, QUEUE_INPUT, tensors)

    def answered(self, resp: pb.ScheduleResponse) -> None:
        """Level TENSORS: the model's outputs (TENSOR_BACKEND_OUTPUT); an
        ensemble's traced steps, each its own trace in the file."""
        if self.tensors is not None and not resp.failure:
            self.tensors += tensor_records(self.trace_id, BACKEND_OUTPUT, resp.outputs)
        self.steps = [st for st in resp.steps if st.start_ns]

    def end(self, end_ns: int, error: str = "", timing: pb.Timing | None = None) -> None:
        """The trace's entries, an ensemble's composing requests' first (each
        under a trace id of its own, with the ensemble's as parent_id, as
        Triton writes them), all counted as one trace."""
        timestamps = "TIMESTAMPS" in self.level
        records = []
        for st in self.steps if timestamps else ():
            step_id = self.file.next_id
            self.file.next_id += 1
            records += trace_records(
                step_id,
                st.model,
                st.version,
                self.request_id,
                st.start_ns,
                st.start_ns + st.duration_ns,
                st.timing,
                parent_id=self.trace_id,
            )
        records += trace_records(
            self.trace_id,
            self.model,
            self.version,
            self.request_id,
            self.start_ns,
            end_ns,
            timing,
            self.tensors,
            timestamps,
        )
        self.file.add(records)
