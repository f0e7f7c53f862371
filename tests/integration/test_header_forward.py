"""Triton's --grpc-header-forward-pattern / --http-header-forward-pattern
(services/gateway/header_forward.py): request headers whose name matches become string
parameters of the request, which a Python model reads in `request.parameters()`. The same
model and gRPC calls on real Triton 2.51 are the referee; the HTTP answers asserted are the
ones Triton 2.51's HTTP front gave the same calls (recorded: the referee helper here starts
Triton with gRPC only)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from stageserve_tools.examples import write_python_model
from tests.integration.helpers import RPC_TIMEOUT_S, skip_if_triton_crashed, triton_grpc
from tests.stack import RunningStack, running_stack

SOURCE = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            text = np.array([request.parameters().encode()], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PARAMS", text)]))
        return out
"""
CONFIG = """
name: "params"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
PATTERN = "x-.*"
GRPC_HEADERS = {"x-tenant": "a", "my-x-thing": "b", "other": "c"}
HTTP_HEADERS = {**GRPC_HEADERS, "X-Upper": "d"}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("header_forward")
    write_python_model(root, "params", SOURCE, CONFIG)
    return root


@pytest.fixture(scope="module")
def stack(repository: Path) -> Iterator[RunningStack]:
    extra = ("--grpc-header-forward-pattern", PATTERN, "--http-header-forward-pattern", PATTERN)
    with running_stack(repository, gateway_extra=extra) as s:
        yield s


def grpc_params(url: str, **kwargs: Any) -> dict[str, Any]:
    inp = grpcclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with grpcclient.InferenceServerClient(url) as client:
        result = client.infer("params", [inp], client_timeout=RPC_TIMEOUT_S, **kwargs)
    return json.loads(result.as_numpy("PARAMS")[0])


def http_params(url: str, **kwargs: Any) -> dict[str, Any]:
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with httpclient.InferenceServerClient(url) as client:
        result = client.infer("params", [inp], **kwargs)
    return json.loads(result.as_numpy("PARAMS")[0])


def answers(grpc_url: str, http_url: str | None) -> list[dict[str, Any]]:
    out = [
        grpc_params(grpc_url, headers=GRPC_HEADERS),
        grpc_params(grpc_url, headers=GRPC_HEADERS, parameters={"x-tenant": "given", "k": 1}),
    ]
    if http_url is not None:
        out.append(http_params(http_url, headers=HTTP_HEADERS))
        out.append(http_params(http_url, headers=HTTP_HEADERS, parameters={"x-tenant": "given"}))
    return out


def test_matching_headers_become_request_parameters(stack: RunningStack) -> None:
    grpc_plain, grpc_given, http_plain, http_given = answers(stack.url, stack.gateway.http_address)
    assert grpc_plain == {"x-tenant": "a", "my-x-thing": "b"}
    assert grpc_given == {"x-tenant": "a", "my-x-thing": "b", "k": 1}
    assert http_plain == {"x-tenant": "a", "my-x-thing": "b", "x-upper": "d"}
    assert http_given == http_plain


def test_the_same_calls_on_triton(stack: RunningStack, repository: Path, tmp_path: Path) -> None:
    ours = answers(stack.url, None)
    extra = (f"--grpc-header-forward-pattern={PATTERN}",)
    with triton_grpc(repository, tmp_path, ["params"], *extra) as url, skip_if_triton_crashed(url):
        theirs = answers(url, None)
    assert ours == theirs
