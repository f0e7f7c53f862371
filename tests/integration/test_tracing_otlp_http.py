"""OTLP/HTTP export, Triton's transport (`--trace-config
opentelemetry,url=localhost:4318/v1/traces`): a stage's emitter posts its
spans as protobuf ExportTraceServiceRequest bodies to the url, here a real
HTTP receiver in this process (the OTLP/gRPC path runs through a whole stack
in test_tracing_otel.py; a stage picks its exporter from the url alone,
stageserve/trace_spans.py's otlp_target)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsp

from stageserve import trace_spans
from stageserve.tracing import parse_trace_config


class Posts:
    def __init__(self) -> None:
        self.got: list[tuple[str, str, tsp.ExportTraceServiceRequest]] = []
        self.changed = threading.Condition()


@pytest.fixture
def receiver() -> Iterator[tuple[Posts, int]]:
    posts = Posts()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = tsp.ExportTraceServiceRequest.FromString(body)
            with posts.changed:
                posts.got.append((self.path, self.headers["Content-Type"], request))
                posts.changed.notify_all()
            answer = tsp.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield posts, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("scheme", ["http://", ""])
def test_spans_go_over_otlp_http_to_the_url(receiver: tuple[Posts, int], scheme: str) -> None:
    posts, port = receiver
    config = parse_trace_config(
        [
            "mode=opentelemetry",
            f"opentelemetry,url={scheme}127.0.0.1:{port}/v1/traces",
            "opentelemetry,resource=deployment.environment=test",
        ]
    )
    emitter = trace_spans.SpanEmitter("gateway", config)
    parent = trace_spans.Parent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    context = emitter.span("InferRequest", parent, 1_000, 2_000, {"triton.model_name": "m"})
    emitter.close()  # exports what is buffered
    with posts.changed:
        assert posts.changed.wait_for(lambda: posts.got, 30)
    path, content_type, request = posts.got[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    (resource_spans,) = request.resource_spans
    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert attrs["service.name"] == "stageserve-gateway"
    assert attrs["deployment.environment"] == "test"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "InferRequest"
    assert span.trace_id.hex() == f"{parent.trace_id:032x}"
    assert span.parent_span_id.hex() == f"{parent.span_id:016x}"
    assert span.span_id.hex() == f"{context.span_id:016x}"
