"""OpenTelemetry spans of traced requests, each emitted by the stage that did
the work, all under one trace: the gateway's root span ("InferRequest", under
the client's W3C traceparent when it sent one) and validation, the
scheduler's queue wait and batch execution, the worker's compute input /
infer / output. A stage learns its parent from the `traceparent` carried in
the internal messages (stageserve.proto) and passes its own span's on.

Spans go over OTLP/gRPC to the collector `--trace-config
opentelemetry,url=<host:port>` names (Triton's own exporter speaks OTLP/HTTP
to a /v1/traces URL; an http:// URL given here is used as the collector's
address without its path), with the resource attributes of
`opentelemetry,resource=<key>=<value>` and the stage's service.name. The
stages read that configuration from the stack's Redis the first time they
see a traced request: an untraced one costs nothing here.

Times: stages measure with the monotonic clock; a span's start and end are
those readings shifted by this process's wall-clock offset, taken once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from stageserve.tracing import MODE_OPENTELEMETRY, TraceConfig

log = logging.getLogger(__name__)

WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_ns: int) -> int:
    return monotonic_ns + WALL_OFFSET_NS


@dataclass(frozen=True)
class Parent:
    trace_id: int
    span_id: int

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"


def parse_traceparent(text: str) -> Parent | None:
    """A W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex>"); None if malformed
    or all-zero (such a header is ignored, as the W3C spec says)."""
    parts = text.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or parts[0] == "ff":
        return None
    try:
        trace_id, span_id = int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return Parent(trace_id, span_id)


def collector_endpoint(url: str) -> str:
    """host:port of the OTLP/gRPC collector from Triton's url option."""
    if "://" in url:
        parsed = urlparse(url)
        return parsed.netloc
    return url.split("/", 1)[0]


class SpanEmitter:
    """One stage's span output (a TracerProvider with a batch processor).
    OpenTelemetry is imported here, by the first traced request: a stage
    that never traces does not load it."""

    def __init__(self, service: str, config: TraceConfig) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        options = config.options
        resource = {"service.name": f"stageserve-{service}", **config.resources()}
        self.provider = TracerProvider(resource=Resource.create(resource))
        delay_ms = int((options.get("bsp_schedule_delay") or ("5000",))[0])
        queue = int((options.get("bsp_max_queue_size") or ("2048",))[0])
        batch = int((options.get("bsp_max_export_batch_size") or ("512",))[0])
        exporter = OTLPSpanExporter(endpoint=collector_endpoint(config.url()), insecure=True)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=queue,
                schedule_delay_millis=delay_ms,
                max_export_batch_size=min(batch, queue),
            )
        )
        self.tracer = self.provider.get_tracer("stageserve")

    def start(
        self,
        name: str,
        parent: Parent | None,
        start_ns: int,
        attributes: dict[str, Any] | None = None,
        server: bool = False,
    ) -> tuple[Any, Parent]:
        """A span started at `start_ns` (monotonic), and its context for children."""
        from opentelemetry import trace as otel
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        context = None
        if parent is not None:
            remote = SpanContext(
                parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(1)
            )
            context = otel.set_span_in_context(NonRecordingSpan(remote))
        kind = otel.SpanKind.SERVER if server else otel.SpanKind.INTERNAL
        span = self.tracer.start_span(
            name, context=context, kind=kind, start_time=wall_ns(start_ns), attributes=attributes
        )
        sc = span.get_span_context()
        return span, Parent(sc.trace_id, sc.span_id)

    @staticmethod
    def end(span: Any, end_ns: int, error: str = "") -> None:
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=wall_ns(end_ns))

    def span(
        self,
        name: str,
        parent: Parent | None,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
    ) -> Parent:
        """Record one finished span (monotonic times); its context, for children."""
        span, context = self.start(name, parent, start_ns, attributes)
        self.end(span, end_ns)
        return context

    def close(self) -> None:
        self.provider.shutdown()


class StageSpans:
    """A stage's emitter, built from the stack's trace settings in Redis the
    first time a traced request needs it (the settings are the gateway's
    --trace-config, seeded in Redis: stageserve/trace_store.py)."""

    def __init__(self, service: str, redis: Any) -> None:
        self.service = service
        self.redis = redis
        self._emitter: SpanEmitter | None = None
        self._pending: set[asyncio.Task] = set()

    async def emitter(self) -> SpanEmitter | None:
        if self._emitter is None:
            from stageserve.trace_store import TraceStore

            try:
                state = await TraceStore(self.redis).load()
            except Exception as exc:  # Redis away: this request's spans are lost
                log.warning("trace settings unavailable", extra={"error": repr(exc)})
                return None
            if state is None or state.config.mode != MODE_OPENTELEMETRY:
                return None  # triton mode: the gateway writes the trace file
            self._emitter = SpanEmitter(self.service, state.config)
        return self._emitter

    def emit(self, record: Callable[[SpanEmitter], None]) -> None:
        """Run `record` with the emitter, now or once it is built (from a
        synchronous path on the event loop)."""
        if self._emitter is not None:
            record(self._emitter)
            return

        async def later() -> None:
            emitter = await self.emitter()
            if emitter is not None:
                record(emitter)

        task = asyncio.get_running_loop().create_task(later())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def close(self) -> None:
        """Export what is buffered, then stop."""
        if self._emitter is not None:
            self._emitter.close()


#: this process's stage spans (set by the stage's serve(); None: not traced)
STAGE: StageSpans | None = None


def configure(service: str, redis: Any) -> StageSpans:
    global STAGE
    STAGE = StageSpans(service, redis)
    return STAGE
