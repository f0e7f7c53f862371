"""OpenTelemetry tracing through every stage: one sampled request's spans,
each exported over OTLP/gRPC by the process that did the work (gateway,
scheduler, rate limiter, worker), arrive at a real OTLP receiver (opentelemetry-proto's
TraceService on a free port, in this process) in one trace, under the
client's W3C traceparent, each parented as the stages pass their context on
in the internal messages."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsg

from bench.references import free_port
from bench.triton_diff import write_repository
from tests.stack import RunningStack, running_stack

WAIT_S = 30.0


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    events: tuple[tuple[str, str], ...] = ()  # (name, tensor name) each


def _events(span) -> tuple[tuple[str, str], ...]:
    """A span's events as (name, its triton.tensor.name attribute)."""
    out = []
    for e in span.events:
        attrs = {a.key: a.value.string_value for a in e.attributes}
        out.append((e.name, attrs.get("triton.tensor.name", "")))
    return tuple(out)


class Receiver(tsg.TraceServiceServicer):
    """Collects every exported span; waits on a condition, no sleeps."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.changed = threading.Condition()

    def Export(
        self, request: tsp.ExportTraceServiceRequest, context
    ) -> tsp.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            attrs.get("service.name", ""),
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            _events(s),
                        )
                    )
        with self.changed:
            self.spans.extend(got)
            self.changed.notify_all()
        return tsp.ExportTraceServiceResponse()

    def trace(self, trace_id: str, names: set[str]) -> dict[str, Span]:
        """The trace's spans by name, once every one of `names` arrived."""

        def have() -> bool:
            return names <= {s.name for s in self.spans if s.trace_id == trace_id}

        with self.changed:
            assert self.changed.wait_for(have, WAIT_S), (
                f"spans of {trace_id}: {[s.name for s in self.spans if s.trace_id == trace_id]}"
            )
            return {s.name: s for s in self.spans if s.trace_id == trace_id}


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    tsg.add_TraceServiceServicer_to_server(rec, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield rec, port
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def traced_stack(
    receiver: tuple[Receiver, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    repo = write_repository(tmp_path_factory.mktemp("trace_repo"), triton=False)
    config = [
        "mode=opentelemetry",
        f"opentelemetry,url=127.0.0.1:{receiver[1]}",
        "opentelemetry,resource=deployment.environment=test",
        "opentelemetry,bsp_schedule_delay=20",
        "level=TIMESTAMPS",
        "rate=1",
    ]
    extra = tuple(f"--trace-config={c}" for c in config)
    with running_stack(
        repo, control_mode="explicit", load_models=("identity", "ens"), gateway_extra=extra
    ) as running:
        yield running


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
STAGE_SPANS = {
    "InferRequest",
    "validation",
    "queue",
    "batch",
    "execute",
    "compute",
    "compute_input",
    "compute_infer",
    "compute_output",
}


def _input() -> grpcclient.InferInput:
    x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    return x


def test_one_request_spans_every_stage_in_one_trace(
    traced_stack: RunningStack, receiver: tuple[Receiver, int]
) -> None:
    client_span = "00f067aa0ba902b7"
    with traced_stack.client() as c:
        c.infer("identity", [_input()], headers={"traceparent": f"00-{TRACE_ID}-{client_span}-01"})
    # the first request of the model's queue waits for a grant from the rate limiter
    spans = receiver[0].trace(TRACE_ID, STAGE_SPANS | {"grant"})
    root = spans["InferRequest"]
    assert spans["grant"].parent_id == root.span_id
    assert spans["grant"].service == "stageserve-ratelimiter"
    assert root.parent_id == client_span  # the client's traceparent is honoured
    assert root.service == "stageserve-gateway"
    assert spans["validation"].parent_id == root.span_id
    for name in ("queue", "batch", "execute"):
        assert spans[name].parent_id == root.span_id
        assert spans[name].service == "stageserve-scheduler"
    compute = spans["compute"]
    assert compute.parent_id == spans["execute"].span_id
    assert compute.service == "stageserve-worker"
    for name in ("compute_input", "compute_infer", "compute_output"):
        assert spans[name].parent_id == compute.span_id
    # time nests: the request holds its queue wait, batch formation and execution
    assert root.start_ns <= spans["queue"].start_ns <= spans["queue"].end_ns
    assert spans["queue"].end_ns == spans["batch"].start_ns
    assert spans["batch"].end_ns == spans["execute"].start_ns
    assert spans["execute"].end_ns <= root.end_ns


def test_http_request_honours_traceparent(
    traced_stack: RunningStack, receiver: tuple[Receiver, int]
) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    client = httpclient.InferenceServerClient(traced_stack.gateway.http_address)
    try:
        x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
        client.infer("identity", [x], headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    finally:
        client.close()
    spans = receiver[0].trace(trace_id, {"InferRequest", "compute"})
    assert spans["InferRequest"].parent_id == "b7ad6b7169203331"


def test_untraced_once_level_is_off(
    traced_stack: RunningStack, receiver: tuple[Receiver, int]
) -> None:
    off_id, on_id = "1" * 32, "2" * 32
    with traced_stack.client() as c:
        c.update_trace_settings(settings={"trace_level": ["OFF"]})
        c.infer("identity", [_input()], headers={"traceparent": f"00-{off_id}-{'3' * 16}-01"})
        c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        c.infer("identity", [_input()], headers={"traceparent": f"00-{on_id}-{'3' * 16}-01"})
    receiver[0].trace(on_id, STAGE_SPANS)
    # the gateway exports in order: the later trace arrived, the earlier request has none
    assert not [s for s in receiver[0].spans if s.trace_id == off_id]


def test_ensemble_trace_holds_each_composing_request(
    traced_stack: RunningStack, receiver: tuple[Receiver, int]
) -> None:
    trace_id = "5" * 32
    x = grpcclient.InferInput("IN", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    with traced_stack.client() as c:
        c.infer("ens", [x], headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"})
    spans = receiver[0].trace(trace_id, {"InferRequest", "queue", "batch", "execute", "compute"})

    def requests() -> list[Span]:
        return [s for s in receiver[0].spans if s.trace_id == trace_id and s.name == "InferRequest"]

    with receiver[0].changed:  # the gateway's and the scheduler's, each exported by its stage
        assert receiver[0].changed.wait_for(lambda: len(requests()) == 2, WAIT_S)
    (ensemble,) = [s for s in requests() if s.service == "stageserve-gateway"]
    (step,) = [s for s in requests() if s.service == "stageserve-scheduler"]
    assert ensemble.parent_id == "6" * 16
    assert step.parent_id == ensemble.span_id  # the composing model's request, as Triton nests it
    for name in ("queue", "batch", "execute"):
        assert spans[name].parent_id == step.span_id
    assert spans["compute"].parent_id == spans["execute"].span_id
    assert ensemble.start_ns <= step.start_ns <= step.end_ns <= ensemble.end_ns


def test_tensors_level_adds_tensor_events_to_the_request_span(
    traced_stack: RunningStack, receiver: tuple[Receiver, int]
) -> None:
    trace_id = "7" * 32
    with traced_stack.client() as c:
        c.update_trace_settings("identity", {"trace_level": ["TIMESTAMPS", "TENSORS"]})
        try:
            c.infer("identity", [_input()], headers={"traceparent": f"00-{trace_id}-{'8' * 16}-01"})
        finally:
            c.update_trace_settings("identity", {"trace_level": None})
    root = receiver[0].trace(trace_id, {"InferRequest"})["InferRequest"]
    assert root.events == (
        ("TENSOR_QUEUE_INPUT", "INPUT0"),
        ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"),
    )
