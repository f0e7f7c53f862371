"""Inference through the real tritonclient against the whole stack."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.stack import RunningStack


def simple_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    i0 = grpcclient.InferInput("INPUT0", list(a.shape), "INT32")
    i0.set_data_from_numpy(a)
    i1 = grpcclient.InferInput("INPUT1", list(b.shape), "INT32")
    i1.set_data_from_numpy(b)
    return [i0, i1]


def test_simple_infer_sums_and_differences(stack: RunningStack) -> None:
    client = stack.client()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    result = client.infer("simple", simple_inputs(a, b), request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response.model_name == "simple"
    assert response.model_version == "1"
    assert response.id == "req-7"


def test_simple_async_infer(stack: RunningStack) -> None:
    client = stack.client()
    results: queue.Queue = queue.Queue()
    pairs = []
    for k in range(8):
        a = np.full((1, 16), k, dtype=np.int32)
        b = np.arange(16, dtype=np.int32).reshape(1, 16)
        pairs.append((a, b))
        client.async_infer(
            "simple",
            simple_inputs(a, b),
            callback=lambda result, error, k=k: results.put((k, result, error)),
        )
    for _ in range(8):
        k, result, error = results.get(timeout=30)
        assert error is None
        a, b = pairs[k]
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_batched_request(stack: RunningStack) -> None:
    client = stack.client()
    a = np.random.default_rng(0).integers(-100, 100, size=(8, 16), dtype=np.int32)
    b = np.random.default_rng(1).integers(-100, 100, size=(8, 16), dtype=np.int32)
    result = client.infer("simple", simple_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_requested_output_subset(stack: RunningStack) -> None:
    client = stack.client()
    a = np.ones((2, 16), dtype=np.int32)
    b = np.ones((2, 16), dtype=np.int32)
    result = client.infer(
        "simple", simple_inputs(a, b), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")]
    )
    names = [o.name for o in result.get_response().outputs]
    assert names == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((2, 16), np.int32))
    assert result.as_numpy("OUTPUT0") is None


def test_model_without_batching(stack: RunningStack) -> None:
    client = stack.client()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer("simple_nobatch", simple_inputs(a, a))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)


DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_identity_round_trip_every_numeric_datatype(stack: RunningStack, datatype: str) -> None:
    rng = np.random.default_rng(42)
    dtype: np.dtype = np.dtype(DTYPES[datatype])
    if dtype == np.bool_:
        data = rng.integers(0, 2, size=(3, 7)).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        data = rng.integers(info.min, info.max, size=(3, 7), dtype=dtype, endpoint=True)
    else:
        data = rng.standard_normal((3, 7)).astype(dtype)
    inp = grpcclient.InferInput("INPUT0", [3, 7], datatype)
    inp.set_data_from_numpy(data)
    result = stack.client().infer(f"identity_{datatype.lower()}", [inp])
    out = result.get_output("OUTPUT0")
    assert out.datatype == datatype
    assert list(out.shape) == [3, 7]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def test_identity_round_trip_bf16(stack: RunningStack) -> None:
    # tritonclient carries BF16 as raw 2-byte words; compare the bit patterns.
    words = np.arange(0, 65536, 257, dtype=np.uint16).reshape(1, -1)
    inp = grpcclient.InferInput("INPUT0", list(words.shape), "BF16")
    inp._raw_content = words.tobytes()
    inp._input.ClearField("contents")
    result = stack.client().infer("identity_bf16", [inp])
    assert result.get_output("OUTPUT0").datatype == "BF16"
    raw = result.get_response().raw_output_contents[0]
    np.testing.assert_array_equal(np.frombuffer(raw, dtype=np.uint16).reshape(words.shape), words)


def test_identity_round_trip_bytes(stack: RunningStack) -> None:
    data = np.array([[b"", b"hello", "héllo wörld ✓".encode(), b"x" * 3000]], dtype=np.object_)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "BYTES")
    inp.set_data_from_numpy(data)
    result = stack.client().infer("identity_bytes", [inp])
    assert result.get_output("OUTPUT0").datatype == "BYTES"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def test_mlp_classifier_probabilities(stack: RunningStack) -> None:
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT0", [4, 256], "FP32")
    inp.set_data_from_numpy(x)
    probs = stack.client().infer("mlp", [inp]).as_numpy("OUTPUT0")
    assert probs.shape == (4, 10)
    np.testing.assert_allclose(probs.sum(axis=1), np.ones(4), rtol=1e-5)
    from stageserve_tools.examples import mlp_reference, mlp_weights

    np.testing.assert_allclose(probs, mlp_reference(x, mlp_weights()), rtol=1e-4, atol=1e-6)


def _stats(client, model):
    return client.get_inference_statistics(model).model_stats[0]


def test_dynamic_batching_forms_batches_under_concurrency(stack: RunningStack) -> None:
    client = stack.client()
    before = _stats(client, "mlp")
    x = np.random.default_rng(5).standard_normal((1, 256)).astype(np.float32)

    def one(_: int) -> np.ndarray:
        c = grpcclient.InferenceServerClient(stack.url)
        inp = grpcclient.InferInput("INPUT0", [1, 256], "FP32")
        inp.set_data_from_numpy(x)
        return c.infer("mlp", [inp]).as_numpy("OUTPUT0")

    n = 400
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(one, range(n)))
    first = outs[0]
    for out in outs:
        np.testing.assert_allclose(out, first, rtol=1e-5)
    after = _stats(client, "mlp")
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == n
    assert executions < inferences, "concurrent requests should share executions"
    assert any(b.batch_size > 1 for b in after.batch_stats)


def test_stream_infer_many_requests_and_per_response_errors(stack: RunningStack) -> None:
    client = stack.client()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(10):
            a = np.full((1, 16), k, dtype=np.int32)
            client.async_stream_infer("simple", simple_inputs(a, a), request_id=f"r{k}")
        bad = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 16), np.float32))
        client.async_stream_infer("simple", [bad], request_id="bad")
        seen: dict[str, np.ndarray] = {}
        errors = []
        for _ in range(11):
            result, error = results.get(timeout=30)
            if error is not None:
                errors.append(error)
            else:
                seen[result.get_response().id] = result.as_numpy("OUTPUT0")
    finally:
        client.stop_stream()
    assert sorted(seen) == sorted(f"r{k}" for k in range(10))
    for k in range(10):
        np.testing.assert_array_equal(seen[f"r{k}"], np.full((1, 16), 2 * k, np.int32))
    assert len(errors) == 1 and "data-type" in str(errors[0])
