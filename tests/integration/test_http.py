"""The HTTP/REST front (KServe v2 / Triton): tritonclient.http (sync and
async), raw HTTP with JSON and binary bodies, every error status, and the same
answers as the gRPC front. Runs on the session stack (its gateway serves both
fronts on free ports)."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import time
import uuid
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.stack import RunningStack

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def request(
    stack: RunningStack,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    host, port = stack.gateway.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def http_client(stack: RunningStack) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(stack.gateway.http_address)


def simple_inputs(module, binary: bool = True) -> list:
    inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    if module is httpclient or module is aiohttpclient:
        inputs[0].set_data_from_numpy(A, binary_data=binary)
        inputs[1].set_data_from_numpy(B, binary_data=binary)
    else:
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
    return inputs


# ------------------------------------------------------------- tritonclient


def test_tritonclient_http_infer_binary_and_json(stack: RunningStack) -> None:
    client = http_client(stack)
    result = client.infer("simple", simple_inputs(httpclient))  # binary both ways
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer(
        "simple", simple_inputs(httpclient, binary=False), outputs=outputs, request_id="r-7"
    )
    response = result.get_response()
    assert response["id"] == "r-7"
    assert [o["name"] for o in response["outputs"]] == ["OUTPUT1"]
    assert response["outputs"][0]["data"] == (A - B).ravel().tolist()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_responses(stack: RunningStack, algorithm: str) -> None:
    result = http_client(stack).infer(
        "simple",
        simple_inputs(httpclient),
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    body = {
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": A.ravel().tolist()}
            for n in ("INPUT0", "INPUT1")
        ]
    }
    status, headers, raw = request(
        stack, "POST", "/v2/models/simple/infer", body, {"Accept-Encoding": algorithm}
    )
    assert status == 200 and headers["content-encoding"] == algorithm
    doc = json.loads(gzip.decompress(raw) if algorithm == "gzip" else zlib.decompress(raw))
    assert doc["outputs"][0]["data"] == (2 * A).ravel().tolist()
    status, _, raw = request(
        stack,
        "POST",
        "/v2/models/simple/infer",
        b"not gzip",
        {"Content-Encoding": "gzip"},
    )
    assert status == 400 and "failed to decompress" in json.loads(raw)["error"]


def test_tritonclient_http_server_and_model_endpoints(stack: RunningStack) -> None:
    client = http_client(stack)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata()
    assert meta["name"] == "triton" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("simple")
    assert model["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [16]
    index = client.get_model_repository_index()
    assert {"name": "simple", "version": "1", "state": "READY", "reason": ""} in index


def test_http_statistics_match_grpc_and_count_http_requests(stack: RunningStack) -> None:
    client, grpc_c = http_client(stack), stack.client()
    before = grpc_c.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    client.infer("simple", simple_inputs(httpclient))
    stats = client.get_inference_statistics("simple")["model_stats"][0]
    after = grpc_c.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 1
    # Same figures on both fronts; JSON numbers on HTTP, as Triton prints them.
    assert stats["inference_count"] == int(after["inference_count"])
    assert stats["inference_stats"]["success"]["count"] == int(
        after["inference_stats"]["success"]["count"]
    )
    assert isinstance(stats["inference_stats"]["success"]["ns"], int)


def test_async_tritonclient_http(stack: RunningStack) -> None:
    async def run() -> list:
        client = aiohttpclient.InferenceServerClient(stack.gateway.http_address)
        try:
            assert await client.is_server_ready()
            results = await asyncio.gather(
                *(client.infer("simple", simple_inputs(aiohttpclient)) for _ in range(8))
            )
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await client.close()

    for out in asyncio.run(run()):
        np.testing.assert_array_equal(out, A + B)


@pytest.mark.parametrize(
    "datatype",
    ["BOOL", "INT8", "UINT16", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES"],
)
def test_datatypes_round_trip_binary_and_json(stack: RunningStack, datatype: str) -> None:
    client = http_client(stack)
    rng = np.random.default_rng(3)
    if datatype == "BYTES":
        data = np.array([[b"a", "\u00e9t\u00e9".encode(), b""]], dtype=np.object_)
    elif datatype == "BOOL":
        data = np.array([[True, False, True]])
    elif datatype == "UINT64":
        data = np.array([[0, 2**64 - 1, 7]], dtype=np.uint64)
    else:
        from tritonclient.utils import triton_to_np_dtype

        data = (rng.standard_normal((1, 3)) * 100).astype(triton_to_np_dtype(datatype))
    model = f"identity_{datatype.lower()}"
    modes = [True] if datatype == "FP16" else [True, False]  # FP16: binary only, as Triton
    for binary in modes:
        if datatype == "BYTES" and not binary:
            data = np.array([[b"a", b"text", b""]], dtype=np.object_)  # JSON carries text
        inp = httpclient.InferInput("INPUT0", list(data.shape), datatype)
        inp.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        got = client.infer(model, [inp], outputs=[out]).as_numpy("OUTPUT0")
        if datatype == "BYTES" and not binary:
            got = np.array([[v.encode() if isinstance(v, str) else v for v in got.ravel()]])
        np.testing.assert_array_equal(got, data)


# ----------------------------------------------------------------- raw HTTP


def test_raw_json_body(stack: RunningStack) -> None:
    body = {
        "id": "raw-1",
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": A.tolist()},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": B.ravel().tolist()},
        ],
    }
    status, headers, raw = request(stack, "POST", "/v2/models/simple/infer", body)
    assert status == 200 and headers["content-type"] == "application/json"
    doc = json.loads(raw)
    assert doc["model_name"] == "simple" and doc["model_version"] == "1" and doc["id"] == "raw-1"
    outputs = {o["name"]: o for o in doc["outputs"]}
    assert outputs["OUTPUT0"]["shape"] == [1, 16]
    assert outputs["OUTPUT0"]["data"] == (A + B).ravel().tolist()
    assert outputs["OUTPUT1"]["data"] == (A - B).ravel().tolist()


def test_raw_binary_body_and_binary_outputs(stack: RunningStack) -> None:
    header = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [1, 16],
                "datatype": "INT32",
                "parameters": {"binary_data_size": 64},
            },
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": B.tolist()},
        ],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"binary_data": True}},
            {"name": "OUTPUT1"},
        ],
    }
    head = json.dumps(header).encode()
    status, headers, raw = request(
        stack,
        "POST",
        "/v2/models/simple/versions/1/infer",
        head + A.tobytes(),
        {"Inference-Header-Content-Length": str(len(head))},
    )
    assert status == 200, raw
    json_len = int(headers["inference-header-content-length"])
    doc = json.loads(raw[:json_len])
    out0, out1 = doc["outputs"]
    assert out0["parameters"] == {"binary_data_size": 64} and "data" not in out0
    np.testing.assert_array_equal(np.frombuffer(raw[json_len:], dtype="<i4"), (A + B).ravel())
    assert out1["data"] == (A - B).ravel().tolist()  # no binary_data: JSON


def test_binary_data_output_for_all_outputs(stack: RunningStack) -> None:
    header = {
        "parameters": {"binary_data_output": True},
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": A.ravel().tolist()}
            for n in ("INPUT0", "INPUT1")
        ],
    }
    status, headers, raw = request(stack, "POST", "/v2/models/simple/infer", header)
    assert status == 200
    json_len = int(headers["inference-header-content-length"])
    doc = json.loads(raw[:json_len])
    sizes = [o["parameters"]["binary_data_size"] for o in doc["outputs"]]
    assert sizes == [64, 64] and len(raw) == json_len + 128
    blob = np.frombuffer(raw[json_len:], dtype="<i4")
    np.testing.assert_array_equal(blob[:16], 2 * A.ravel())
    np.testing.assert_array_equal(blob[16:], 0)


def test_health_endpoints_raw(stack: RunningStack) -> None:
    assert request(stack, "GET", "/v2/health/live")[0] == 200
    assert request(stack, "GET", "/v2/health/ready")[0] == 200
    assert request(stack, "GET", "/v2/models/simple/ready")[0] == 200
    status, _, body = request(stack, "GET", "/v2/models/simple/versions/9/ready")
    assert (status, json.loads(body)) == (400, {"error": "Model version not ready"})


def test_generate_and_generate_stream_on_a_non_decoupled_model(stack: RunningStack) -> None:
    body = {"INPUT0": A.ravel().tolist(), "INPUT1": B.ravel().tolist(), "unrelated": 1}
    status, headers, raw = request(stack, "POST", "/v2/models/simple/generate", body)
    assert status == 200 and headers["content-type"] == "application/json"
    doc = json.loads(raw)
    assert doc["OUTPUT0"] == (A + B).ravel().tolist() and doc["OUTPUT1"] == (A - B).ravel().tolist()
    assert (doc["model_name"], doc["model_version"]) == ("simple", "1")
    status, headers, raw = request(stack, "POST", "/v2/models/simple/generate_stream", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"data: ") == 1
    assert json.loads(raw[len(b"data: ") :]) == doc


def test_generate_stream_on_a_decoupled_model_sends_each_response_as_an_event(
    stack: RunningStack,
) -> None:
    """py_stream sends n responses delay_ms apart: n Server-Sent Events, each
    read before the next response exists (streamed, not buffered)."""
    host, port = stack.gateway.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = json.dumps({"IN": [3, 400]}).encode()
        conn.request("POST", "/v2/models/py_stream/generate_stream", body=body)
        resp = conn.getresponse()
        assert resp.status == 200
        content_type = resp.getheader("content-type")
        assert content_type is not None and content_type.startswith("text/event-stream")
        events, arrived = [], []
        start = time.monotonic()
        while line := resp.readline():
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
                arrived.append(time.monotonic() - start)
    finally:
        conn.close()
    assert events == [{"OUT": i, "model_name": "py_stream", "model_version": "1"} for i in range(3)]
    assert arrived[0] < arrived[2] - 0.5  # the first event came ~800 ms before the last


def test_generate_on_a_decoupled_model_and_infer_refused(stack: RunningStack) -> None:
    status, _, raw = request(stack, "POST", "/v2/models/py_stream/generate", {"IN": [1, 0]})
    assert status == 200
    assert json.loads(raw) == {"OUT": 0, "model_name": "py_stream", "model_version": "1"}
    status, _, raw = request(stack, "POST", "/v2/models/py_stream/generate", {"IN": [2, 0]})
    assert status == 400 and "use generate_stream" in json.loads(raw)["error"]
    body = {"inputs": [{"name": "IN", "shape": [2], "datatype": "INT32", "data": [1, 0]}]}
    status, _, raw = request(stack, "POST", "/v2/models/py_stream/infer", body)
    assert status == 400
    assert json.loads(raw) == {
        "error": "HTTP end point doesn't support models with decoupled transaction policy"
    }
    # an error before the first event is an HTTP error, not a stream
    status, _, raw = request(stack, "POST", "/v2/models/py_stream/generate_stream", {"X": 1})
    assert status == 400 and "missing required input" in json.loads(raw)["error"]


def test_system_shared_memory_over_http(stack: RunningStack) -> None:
    client = http_client(stack)
    tag = uuid.uuid4().hex[:8]
    nbytes = A.nbytes
    h_in = shm.create_shared_memory_region(f"hin-{tag}", f"/ss-hin-{tag}", 2 * nbytes)
    h_out = shm.create_shared_memory_region(f"hout-{tag}", f"/ss-hout-{tag}", nbytes)
    try:
        shm.set_shared_memory_region(h_in, [A, B])
        client.register_system_shared_memory(f"hin-{tag}", f"/ss-hin-{tag}", 2 * nbytes)
        client.register_system_shared_memory(f"hout-{tag}", f"/ss-hout-{tag}", nbytes)
        status = client.get_system_shared_memory_status(f"hin-{tag}")
        assert status == [
            {"name": f"hin-{tag}", "key": f"/ss-hin-{tag}", "offset": 0, "byte_size": 2 * nbytes}
        ]
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(f"hin-{tag}", nbytes)
        inputs[1].set_shared_memory(f"hin-{tag}", nbytes, offset=nbytes)
        out0 = httpclient.InferRequestedOutput("OUTPUT0")
        out0.set_shared_memory(f"hout-{tag}", nbytes)
        out1 = httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)
        result = client.infer("simple", inputs, outputs=[out0, out1])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
        got = shm.get_contents_as_numpy(h_out, np.int32, [1, 16])
        np.testing.assert_array_equal(got, A + B)

        # An output region too small for the result: INTERNAL, Triton's 500.
        small = httpclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory(f"hout-{tag}", 8)
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", simple_inputs(httpclient), outputs=[small])
        assert err.value.status() == "500"
        assert "should be at least 64 bytes" in err.value.message()

        client.unregister_system_shared_memory(f"hin-{tag}")
        names = {r["name"] for r in client.get_system_shared_memory_status()}
        assert f"hin-{tag}" not in names and f"hout-{tag}" in names
    finally:
        client.unregister_system_shared_memory(f"hout-{tag}")
        client.unregister_system_shared_memory(f"hin-{tag}")
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)


# ------------------------------------------------------------ error statuses


def _error(status: int, raw: bytes) -> tuple[int, str]:
    return status, json.loads(raw)["error"]


#: (method, path, body) or (method, path, body, headers): request()'s arguments
_RequestArgs = (
    tuple[str, str, bytes | dict | None]
    | tuple[str, str, bytes | dict | None, dict[str, str] | None]
)


def test_error_statuses(stack: RunningStack) -> None:
    path = "/v2/models/simple/infer"
    good = {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": A.ravel().tolist()}
    cases: list[tuple[_RequestArgs, int, str]] = [
        # (method, path, body, headers) -> status, a piece of the message
        # Triton answers 500 for a body that does not parse (measured on 2.51).
        (("POST", path, b"{not json", None), 500, "failed to parse the request JSON"),
        (("POST", path, b"[1]", None), 500, "must be an object"),
        (("POST", path, {"inputs": 3}, None), 400, "must have an 'inputs' array"),
        (
            ("POST", path, {"inputs": [{**good, "name": "INPUT0", "shape": [1, 15]}, good]}, None),
            500,
            "Unable to parse 'data' of input 'INPUT0'",
        ),
        (
            ("POST", path, {"inputs": [{**good, "name": "INPUT0", "datatype": "FP32"}, good]}),
            400,
            "data-type is 'FP32'",
        ),
        (("POST", path, {"inputs": [good]}, None), 400, "missing required input(s) ['INPUT0']"),
        (
            ("POST", path, b'{"inputs": []}', {"Inference-Header-Content-Length": "999"}),
            400,
            "outside the body",
        ),
        (
            ("POST", path, b'{"inputs":[]}xyz', {"Inference-Header-Content-Length": "13"}),
            400,
            "no input claims",
        ),
        (("POST", "/v2/models/nope/infer", {"inputs": []}, None), 404, "'nope' is not found"),
        (("GET", "/v2/models/nope", None, None), 404, "'nope' is not found"),
        (("GET", "/v2/models/simple/versions/7/config", None, None), 404, "version 7"),
        (("GET", "/v2/nowhere", None, None), 404, "Not Found"),
        (("GET", path, None, None), 405, "Method Not Allowed"),
        # Model control mode none: load/unload are refused, as on gRPC.
        (("POST", "/v2/repository/models/simple/load", None, None), 503, "control mode is"),
        (("POST", "/v2/repository/models/simple/unload", None, None), 503, "control mode is"),
        (("POST", "/v2/models/simple/generate", {"INPUT0": [1]}), 400, "can not convert input"),
        (("POST", "/v2/models/simple/generate", {}, None), 400, "missing required input(s)"),
        (("POST", "/v2/models/nope/generate_stream", {}, None), 404, "'nope' is not found"),
        (("GET", "/v2/cudasharedmemory/region/r/status", None, None), 404, "cuda shared memory"),
    ]
    for args, status, piece in cases:
        method, p, body, *rest = args
        headers = rest[0] if rest else None
        got_status, message = _error(*request(stack, method, p, body, headers)[::2])
        assert (got_status, piece in message) == (status, True), (p, body, message)
        assert "Traceback" not in message


# ------------------------------------------------------------- both fronts


@pytest.mark.parametrize("model", ["simple", "mlp", "ensemble_mlp"])
def test_same_answers_on_both_fronts(stack: RunningStack, model: str) -> None:
    hc, gc = http_client(stack), stack.client()
    meta = hc.get_model_metadata(model)
    grpc_meta = gc.get_model_metadata(model)
    assert meta["versions"] == list(grpc_meta.versions)
    assert meta["platform"] == grpc_meta.platform
    for kind in ("inputs", "outputs"):
        assert meta[kind] == [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
            for t in getattr(grpc_meta, kind)
        ]
    rng = np.random.default_rng(11)
    tensors: dict[str, np.ndarray] = {}
    for spec in meta["inputs"]:
        shape = [2 if d == -1 else int(d) for d in spec["shape"]]
        if spec["datatype"] == "INT32":
            tensors[spec["name"]] = rng.integers(-50, 50, shape, dtype=np.int32)
        else:
            tensors[spec["name"]] = rng.random(shape, dtype=np.float32)
    outputs = {}
    for module, client in ((httpclient, hc), (grpcclient, gc)):
        inputs = []
        for spec in meta["inputs"]:
            inp = module.InferInput(
                spec["name"], list(tensors[spec["name"]].shape), spec["datatype"]
            )
            inp.set_data_from_numpy(tensors[spec["name"]])
            inputs.append(inp)
        result = client.infer(model, inputs)
        outputs[module.__name__] = {o["name"]: result.as_numpy(o["name"]) for o in meta["outputs"]}
    for name in outputs["tritonclient.grpc"]:
        np.testing.assert_array_equal(
            outputs["tritonclient.http"][name], outputs["tritonclient.grpc"][name]
        )


def test_same_error_messages_on_both_fronts(stack: RunningStack) -> None:
    bad = np.zeros((1, 15), dtype=np.int32)
    messages = {}
    for module, client in ((httpclient, http_client(stack)), (grpcclient, stack.client())):
        inputs = [module.InferInput(n, [1, 15], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(bad)
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", inputs)
        messages[module.__name__] = (err.value.status(), err.value.message())
    http_status, http_message = messages["tritonclient.http"]
    grpc_status, grpc_message = messages["tritonclient.grpc"]
    assert http_status == "400" and grpc_status == "StatusCode.INVALID_ARGUMENT"
    assert http_message == grpc_message
    assert "unexpected shape for input 'INPUT0'" in http_message


def test_sequence_over_http(stack: RunningStack) -> None:
    client = http_client(stack)
    seq = int(uuid.uuid4().int % 2**40) + 1
    totals = []
    for step, value in enumerate([2, 3, 4]):
        inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.full([1, 1], value, dtype=np.int32))
        result = client.infer(
            "accumulator",
            [inp],
            sequence_id=seq,
            sequence_start=step == 0,
            sequence_end=step == 2,
        )
        totals.append(int(result.as_numpy("OUTPUT").ravel()[0]))
    assert totals == [2, 5, 9]
