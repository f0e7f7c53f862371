"""What Triton's own client examples (tritonclient's src/python/examples) need of
the server, beyond inference: checked here with our own calls, answers as real
Triton 2.51 gives them (bench/triton_diff.py diffs the same calls against it).

- CUDA shared memory: status and unregister succeed with nothing registered
  (every shared-memory example unregisters CUDA regions first); register is
  refused with Triton's code and message.
- A gRPC request carrying raw_input_contents and typed contents gets Triton's
  message (grpc_explicit_int_content_client).
- The gRPC client options the examples use: request compression
  (simple_grpc_infer_client --compression), keepalive options
  (simple_grpc_keepalive_client), custom headers (simple_grpc_custom_args_client)
  and the asyncio client (simple_grpc_aio_infer_client).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.utils import InferenceServerException

from tests.integration.helpers import RPC_TIMEOUT_S, infer_simple, simple_inputs
from tests.stack import RunningStack

REGISTER_REFUSED = "failed to register shared memory region: invalid args"


def _http(stack: RunningStack, method: str, path: str, body: bytes = b"") -> tuple[int, str]:
    host, port = stack.gateway.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body if method == "POST" else None)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _error(fn, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    return str(info.value.status()), info.value.message() or ""


def test_cuda_shared_memory_status_and_unregister_succeed_on_grpc(stack: RunningStack) -> None:
    c = stack.client()
    c.unregister_cuda_shared_memory(client_timeout=RPC_TIMEOUT_S)
    c.unregister_cuda_shared_memory("never_registered", client_timeout=RPC_TIMEOUT_S)
    assert c.get_cuda_shared_memory_status(as_json=True, client_timeout=RPC_TIMEOUT_S) == {}
    assert _error(c.get_cuda_shared_memory_status, "r", client_timeout=RPC_TIMEOUT_S) == (
        "StatusCode.NOT_FOUND",
        "Unable to find cuda shared memory region: 'r'",
    )


def test_cuda_shared_memory_register_is_refused_as_triton_does_on_grpc(
    stack: RunningStack,
) -> None:
    c = stack.client()
    handle = bytes(range(64))  # the size of a cudaIpcMemHandle_t
    assert _error(c.register_cuda_shared_memory, "r", handle, 0, 16) == (
        "StatusCode.INVALID_ARGUMENT",
        REGISTER_REFUSED,
    )
    assert c.get_cuda_shared_memory_status(as_json=True) == {}  # nothing half-registered
    infer_simple(c)  # and the server keeps serving


def test_cuda_shared_memory_on_http(stack: RunningStack) -> None:
    hc = httpclient.InferenceServerClient(stack.gateway.http_address)
    hc.unregister_cuda_shared_memory()
    hc.unregister_cuda_shared_memory("never_registered")
    assert hc.get_cuda_shared_memory_status() == []
    assert _error(hc.get_cuda_shared_memory_status, "r") == (
        "404",
        "Unable to find cuda shared memory region: 'r'",
    )
    region = "/v2/cudasharedmemory/region/r"
    handle = {"b64": base64.b64encode(bytes(range(64))).decode()}
    body = json.dumps({"raw_handle": handle, "device_id": 0, "byte_size": 16}).encode()
    assert _http(stack, "POST", f"{region}/register", body) == (
        400,
        json.dumps({"error": REGISTER_REFUSED}, separators=(",", ":")),
    )
    status, text = _http(stack, "POST", f"{region}/register", b"{}")
    assert status == 400
    assert json.loads(text)["error"] == "Shared memory register request has no 'raw_handle' field"
    short = json.dumps({"raw_handle": {"b64": "YWJjZA=="}, "byte_size": 16}).encode()
    status, text = _http(stack, "POST", f"{region}/register", short)
    assert (status, json.loads(text)["error"]) == (
        400,
        "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t",
    )
    assert _http(stack, "GET", f"{region}/register")[0] == 405
    assert _http(stack, "POST", "/v2/cudasharedmemory/status")[0] == 405


def _raw_and_typed(model: str, typed_input: str) -> tpb.ModelInferRequest:
    request = tpb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        t = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        if name == typed_input:
            t.contents.int_contents.extend(range(16))
    request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return request


@pytest.mark.parametrize("typed_input", ["INPUT0", "INPUT1"])
def test_raw_and_typed_contents_get_tritons_message(stack: RunningStack, typed_input: str) -> None:
    """One raw entry for two inputs, one of them with typed contents: Triton names
    the input with contents, before any count of the raw entries."""
    c = stack.client()
    stub = c._client_stub  # the generated stub: tritonclient never sends this mix itself
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_raw_and_typed("simple", typed_input), timeout=RPC_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "contents field must not be specified when using raw_input_contents for "
        f"'{typed_input}' for model 'simple'"
    )


def test_server_metadata_name_is_tritons_on_both_fronts(stack: RunningStack) -> None:
    """Triton's health/metadata examples exit unless the name is "triton"."""
    assert stack.client().get_server_metadata().name == "triton"
    hc = httpclient.InferenceServerClient(stack.gateway.http_address)
    assert hc.get_server_metadata()["name"] == "triton"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_grpc_request_compression(stack: RunningStack, algorithm: str) -> None:
    infer_simple(stack.client(), compression_algorithm=algorithm)


def test_grpc_keepalive_options_and_custom_headers(stack: RunningStack) -> None:
    keepalive = grpcclient.KeepAliveOptions(
        keepalive_time_ms=2**31 - 1,
        keepalive_timeout_ms=20000,
        keepalive_permit_without_calls=False,
        http2_max_pings_without_data=2,
    )
    c = grpcclient.InferenceServerClient(stack.gateway.address, keepalive_options=keepalive)
    try:
        infer_simple(c, headers={"my-key": "my-value"})
        assert c.is_server_live(headers={"my-key": "my-value"})
    finally:
        c.close()


def test_grpc_asyncio_client(stack: RunningStack) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)

    async def main() -> tuple[bool, str, np.ndarray | None]:
        async with aiogrpcclient.InferenceServerClient(stack.gateway.address) as c:
            live = await c.is_server_live()
            meta = await c.get_server_metadata()
            result = await c.infer("simple", simple_inputs(a, b), client_timeout=RPC_TIMEOUT_S)
            return live, meta.name, result.as_numpy("OUTPUT0")

    live, name, out = asyncio.run(main())
    assert live and name == "triton"
    np.testing.assert_array_equal(out, a + b)
