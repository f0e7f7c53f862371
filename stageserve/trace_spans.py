"""OpenTelemetry spans of traced requests, each emitted by the stage that did
the work, all under one trace: the gateway's root span ("InferRequest", under
the client's W3C traceparent when it sent one) and validation, the
scheduler's queue wait, batch formation and execution (and an ensemble's
composing requests), the rate limiter's grant, the worker's compute input /
infer / output. A stage learns its parent from the `traceparent` carried in
the internal messages (stageserve.proto) and passes its own span's on.

Spans go over OTLP to the collector `--trace-config opentelemetry,url=`
names: OTLP/HTTP for an http(s):// URL or one with a path (Triton's form,
`localhost:4318/v1/traces`), OTLP/gRPC for a bare `host:port` or
`grpc://host:port` (otlp_target), with the resource attributes of
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


OTLP_HTTP, OTLP_GRPC = "http", "grpc"


def otlp_target(url: str) -> tuple[str, str]:
    """Which OTLP transport `--trace-config opentelemetry,url=` names, and
    where to: an http:// or https:// URL is OTLP/HTTP, posted to that URL as
    it is (Triton's exporter); so is a URL without a scheme that has a path,
    as Triton's default `localhost:4318/v1/traces` (http:// is assumed). A
    bare `host:port`, or `grpc://host:port`, is OTLP/gRPC to that address
    (the collector's 4317 port)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    scheme = scheme.lower()
    if scheme in ("http", "https"):
        return OTLP_HTTP, url
    if scheme == "grpc":
        return OTLP_GRPC, rest.split("/", 1)[0]
    if scheme:
        raise ValueError(f"OTLP url {url!r}: the scheme must be http, https or grpc")
    address, slash, path = rest.partition("/")
    if slash and path:
        return OTLP_HTTP, f"http://{rest}"
    return OTLP_GRPC, address


def span_exporter(url: str) -> Any:
    """The OTLP exporter `url` names (otlp_target)."""
    transport, target = otlp_target(url)
    if transport == OTLP_HTTP:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=target)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=target, insecure=True)


class SpanEmitter:
    """One stage's span output (a TracerProvider with a batch processor).
    OpenTelemetry is imported here, by the first traced request: a stage
    that never traces does not load it."""

    def __init__(self, service: str, config: TraceConfig, exporter: Any = None) -> None:
        """`exporter`: where spans go (an OpenTelemetry SpanExporter); by
        default OTLP to the configured url (span_exporter)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        options = config.options
        resource = {"service.name": f"stageserve-{service}", **config.resources()}
        self.provider = TracerProvider(resource=Resource.create(resource))
        delay_ms = int((options.get("bsp_schedule_delay") or ("5000",))[0])
        queue = int((options.get("bsp_max_queue_size") or ("2048",))[0])
        batch = int((options.get("bsp_max_export_batch_size") or ("512",))[0])
        if exporter is None:
            exporter = span_exporter(config.url())
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
        self._triton_mode = False  # the stack traces to a file: this stage emits nothing
        self._pending: set[asyncio.Task] = set()

    async def emitter(self) -> SpanEmitter | None:
        if self._triton_mode:
            return None
        if self._emitter is None:
            from stageserve.trace_store import TraceStore

            try:
                state = await TraceStore(self.redis).load()
            except Exception as exc:  # Redis away: this request's spans are lost
                log.warning("trace settings unavailable", extra={"error": repr(exc)})
                return None
            if state is None:
                return None
            if state.config.mode != MODE_OPENTELEMETRY:  # fixed at the stack's start
                self._triton_mode = True
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
