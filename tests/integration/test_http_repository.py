"""Repository control and metrics over the HTTP front, on a stack of its own
(model control mode explicit, gateway /metrics on a free port)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from stageserve.launcher import Stack, StackServices, start_services
from stageserve.net import free_port


class HttpStack:
    def __init__(self, services: StackServices, metrics_port: int) -> None:
        self.services = services
        self.metrics_port = metrics_port
        self.http = httpclient.InferenceServerClient(services.gateway.http_address)
        self.grpc = grpcclient.InferenceServerClient(services.gateway.address)


@pytest.fixture(scope="module")
def hstack(example_repository: Path) -> Iterator[HttpStack]:
    stack = Stack()
    port = free_port()
    try:
        services = start_services(
            stack,
            example_repository,
            control_mode="explicit",
            load_models=["simple"],
            device="cpu",
            metrics_port=port,
        )
        yield HttpStack(services, port)
    finally:
        stack.stop()


def _infer(client: httpclient.InferenceServerClient, model: str) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return client.infer(model, inputs).as_numpy("OUTPUT0")


def test_load_and_unload_over_http(hstack: HttpStack) -> None:
    client = hstack.http
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["simple"]["state"] == "READY"
    assert not client.is_model_ready("simple_nobatch")
    client.load_model("simple_nobatch")
    assert client.is_model_ready("simple_nobatch")
    assert hstack.grpc.is_model_ready("simple_nobatch")  # one dataplane, one model set
    ready = client.get_model_repository_index()  # POST /v2/repository/index {"ready": ...}
    assert {m["name"] for m in ready} >= {"simple", "simple_nobatch"}
    np.testing.assert_array_equal(
        _infer(client, "simple_nobatch"), 2 * np.arange(16, dtype=np.int32).reshape(1, 16)
    )
    client.unload_model("simple_nobatch")
    assert not client.is_model_ready("simple_nobatch")
    with pytest.raises(InferenceServerException) as err:
        client.load_model("no_such_model")
    assert err.value.status() == "500"  # INTERNAL, as Triton 2.51 answers
    with pytest.raises(InferenceServerException) as grpc_err:
        hstack.grpc.load_model("no_such_model")
    assert err.value.message() == grpc_err.value.message()


def test_load_overrides_answer_as_the_grpc_front(hstack: HttpStack) -> None:
    """Config / file overrides go through the same dataplane call as gRPC's."""
    config = json.dumps({"name": "simple_nobatch", "max_batch_size": 0})
    http_error = grpc_error = None
    try:
        hstack.http.load_model("simple_nobatch", config=config, files={"file:1/model.onnx": b"x"})
    except InferenceServerException as exc:
        http_error = exc.message()
    try:
        hstack.grpc.load_model("simple_nobatch", config=config, files={"file:1/model.onnx": b"x"})
    except InferenceServerException as exc:
        grpc_error = exc.message()
    assert http_error == grpc_error
    if hstack.grpc.is_model_ready("simple_nobatch"):
        hstack.grpc.unload_model("simple_nobatch")


def _samples(port: int, name: str) -> list:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in (name, name + "_total")  # the parser adds _total to counters
    ]


def test_http_metrics_per_endpoint_and_status(hstack: HttpStack) -> None:
    name = "stageserve_http_request_duration_seconds_count"
    _infer(hstack.http, "simple")
    hstack.http.is_server_ready()
    with pytest.raises(InferenceServerException):
        hstack.http.get_model_metadata("no_such_model")
    counts = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in _samples(hstack.metrics_port, name)
    }
    assert counts[("infer", "200")] >= 1
    assert counts[("health_ready", "200")] >= 1
    assert counts[("model_metadata", "404")] >= 1
    # The same inference shows in Triton's per-model counters, whichever front took it.
    success = [
        s.value
        for s in _samples(hstack.metrics_port, "nv_inference_request_success")
        if s.labels.get("model") == "simple"
    ]
    assert success and success[0] >= 1
