"""Every non-inference RPC of GRPCInferenceService, through the real tritonclient.

Health, metadata, configuration, statistics and the repository index against
the session stack (example repository, model control mode none), plus
inference with typed ``contents`` built with tritonclient's own generated
stubs (tritonclient's InferInput always sends raw_input_contents).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2

from stageserve_tools.examples import ALL_DATATYPES
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    expect_error,
    index_states,
    infer_simple,
    model_stats,
    output_array,
    raw_infer,
    raw_request,
    raw_stub,
)
from tests.stack import RunningStack

# ---------------------------------------------------------------- health


def test_server_live_and_ready(stack: RunningStack) -> None:
    c = stack.client()
    assert c.is_server_live(client_timeout=RPC_TIMEOUT_S) is True
    assert c.is_server_ready(client_timeout=RPC_TIMEOUT_S) is True


def test_server_live_and_ready_raw(stack: RunningStack) -> None:
    with raw_stub(stack.url) as stub:
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=RPC_TIMEOUT_S).live
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=RPC_TIMEOUT_S).ready


@pytest.mark.parametrize("model", ["simple", "simple_nobatch", "mlp", "identity_bytes"])
def test_model_ready_for_every_served_model(stack: RunningStack, model: str) -> None:
    c = stack.client()
    assert c.is_model_ready(model, client_timeout=RPC_TIMEOUT_S) is True
    assert c.is_model_ready(model, "1", client_timeout=RPC_TIMEOUT_S) is True


@pytest.mark.parametrize(
    ("model", "version"),
    [
        ("no_such_model", ""),
        ("no_such_model", "1"),
        ("simple", "2"),
        ("simple", "0"),
        ("", ""),
    ],
)
def test_model_ready_false_for_unknown_model_or_version(
    stack: RunningStack, model: str, version: str
) -> None:
    assert stack.client().is_model_ready(model, version, client_timeout=RPC_TIMEOUT_S) is False


def test_model_ready_refuses_a_version_that_is_not_an_integer(stack: RunningStack) -> None:
    expect_error(  # as Triton 2.51 (bench/triton_diff.py)
        stack.client().is_model_ready,
        "simple",
        "not-a-number",
        status="StatusCode.INVALID_ARGUMENT",
        contains=("not-a-number", "integral value"),
    )


# --------------------------------------------------------------- metadata


def test_server_metadata(stack: RunningStack) -> None:
    c = stack.client()
    md = c.get_server_metadata(client_timeout=RPC_TIMEOUT_S)
    assert md.name == "triton"  # the default, as Triton answers (its examples check it)
    assert md.version
    extensions = set(md.extensions)
    for ext in ("model_repository", "model_configuration", "statistics"):
        assert ext in extensions
    js = c.get_server_metadata(as_json=True, client_timeout=RPC_TIMEOUT_S)
    assert js["name"] == "triton"
    assert js["version"] == md.version
    assert set(js["extensions"]) == extensions


def _tensors(entries) -> list[tuple[str, str, list[int]]]:
    return [(t.name, t.datatype, list(t.shape)) for t in entries]


def test_model_metadata_batching_model_has_variable_batch_dim(stack: RunningStack) -> None:
    md = stack.client().get_model_metadata("simple", client_timeout=RPC_TIMEOUT_S)
    assert md.name == "simple"
    assert list(md.versions) == ["1"]
    assert md.platform == "onnxruntime_onnx"
    assert _tensors(md.inputs) == [("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    assert _tensors(md.outputs) == [
        ("OUTPUT0", "INT32", [-1, 16]),
        ("OUTPUT1", "INT32", [-1, 16]),
    ]


def test_model_metadata_explicit_version(stack: RunningStack) -> None:
    md = stack.client().get_model_metadata("simple", "1", client_timeout=RPC_TIMEOUT_S)
    assert md.name == "simple"
    assert list(md.versions) == ["1"]


def test_model_metadata_without_batching_has_no_batch_dim(stack: RunningStack) -> None:
    md = stack.client().get_model_metadata("simple_nobatch", client_timeout=RPC_TIMEOUT_S)
    assert _tensors(md.inputs) == [("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16])]
    assert _tensors(md.outputs) == [("OUTPUT0", "INT32", [1, 16]), ("OUTPUT1", "INT32", [1, 16])]


def test_model_metadata_mlp(stack: RunningStack) -> None:
    md = stack.client().get_model_metadata("mlp", client_timeout=RPC_TIMEOUT_S)
    assert _tensors(md.inputs) == [("INPUT0", "FP32", [-1, 256])]
    assert _tensors(md.outputs) == [("OUTPUT0", "FP32", [-1, 10])]


@pytest.mark.parametrize("datatype", ALL_DATATYPES)
def test_model_metadata_datatypes(stack: RunningStack, datatype: str) -> None:
    md = stack.client().get_model_metadata(
        f"identity_{datatype.lower()}", client_timeout=RPC_TIMEOUT_S
    )
    assert _tensors(md.inputs) == [("INPUT0", datatype, [-1, -1])]
    assert _tensors(md.outputs) == [("OUTPUT0", datatype, [-1, -1])]


def test_model_metadata_as_json(stack: RunningStack) -> None:
    js = stack.client().get_model_metadata("simple", as_json=True, client_timeout=RPC_TIMEOUT_S)
    assert js["name"] == "simple"
    assert js["versions"] == ["1"]
    assert js["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": ["-1", "16"]}


@pytest.mark.parametrize(
    ("model", "version", "status"),
    [("no_such_model", "", "StatusCode.NOT_FOUND"), ("simple", "3", "StatusCode.NOT_FOUND")],
)
def test_model_metadata_unknown(stack: RunningStack, model: str, version: str, status: str) -> None:
    c = stack.client()
    expect_error(c.get_model_metadata, model, version, status=status, contains=(model,))
    expect_error(c.get_model_config, model, version, status=status, contains=(model,))


# ----------------------------------------------------------------- config


def _config_on_disk(repository: Path, model: str) -> model_config_pb2.ModelConfig:
    text = (repository / model / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize("model", ["simple", "simple_nobatch", "mlp", "identity_fp16"])
def test_model_config_matches_config_pbtxt(
    stack: RunningStack, example_repository: Path, model: str
) -> None:
    expected = _config_on_disk(example_repository, model)
    got = stack.client().get_model_config(model, client_timeout=RPC_TIMEOUT_S).config
    assert isinstance(got, model_config_pb2.ModelConfig)
    assert got.name == model
    assert got.platform == expected.platform == "onnxruntime_onnx"
    assert got.max_batch_size == expected.max_batch_size
    for side in ("input", "output"):
        got_t = [(t.name, t.data_type, list(t.dims)) for t in getattr(got, side)]
        exp_t = [(t.name, t.data_type, list(t.dims)) for t in getattr(expected, side)]
        assert got_t == exp_t
    assert got.HasField("dynamic_batching") == expected.HasField("dynamic_batching")
    assert (
        got.dynamic_batching.max_queue_delay_microseconds
        == expected.dynamic_batching.max_queue_delay_microseconds
    )
    assert [(g.count, g.kind) for g in got.instance_group] == [
        (g.count, g.kind) for g in expected.instance_group
    ]


def test_model_config_as_json(stack: RunningStack, example_repository: Path) -> None:
    js = stack.client().get_model_config("mlp", as_json=True, client_timeout=RPC_TIMEOUT_S)
    config = js["config"]
    assert config["name"] == "mlp"
    assert config["platform"] == "onnxruntime_onnx"
    assert int(config["max_batch_size"]) == 64
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["256"]}]
    assert config["output"] == [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["10"]}]
    assert config["instance_group"][0]["count"] == 2
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert "dynamic_batching" in config


def test_model_config_with_version(stack: RunningStack) -> None:
    got = stack.client().get_model_config("simple", "1", client_timeout=RPC_TIMEOUT_S).config
    assert got.name == "simple"


# ------------------------------------------------------------- statistics


def test_model_statistics_move_after_inference(stack: RunningStack) -> None:
    c = stack.client()
    before = model_stats(c, "simple")
    assert before.name == "simple"
    assert before.version == "1"
    t0_ms = int(time.time() * 1000)
    infer_simple(c, batch=3)
    infer_simple(c, batch=1)
    after = model_stats(c, "simple")

    s0, s1 = before.inference_stats, after.inference_stats
    assert after.inference_count - before.inference_count == 4
    assert after.execution_count - before.execution_count == 2
    assert s1.success.count - s0.success.count == 2
    assert s1.success.ns > s0.success.ns
    assert s1.fail.count == s0.fail.count
    for field in ("queue", "compute_input", "compute_infer", "compute_output"):
        d0, d1 = getattr(s0, field), getattr(s1, field)
        assert d1.count - d0.count == 2, field
        assert d1.ns > d0.ns, field
    # each request's total time covers its queue and compute time
    assert (s1.success.ns - s0.success.ns) >= (s1.compute_infer.ns - s0.compute_infer.ns)
    assert after.last_inference >= t0_ms - 1000
    assert after.last_inference <= int(time.time() * 1000) + 1000

    by_size = {b.batch_size: b for b in after.batch_stats}
    before_size = {b.batch_size: b for b in before.batch_stats}
    for size in (1, 3):
        assert size in by_size
        old = before_size[size].compute_infer.count if size in before_size else 0
        assert by_size[size].compute_infer.count - old == 1
        assert by_size[size].compute_infer.ns > 0


def test_model_statistics_with_version_and_as_json(stack: RunningStack) -> None:
    c = stack.client()
    infer_simple(c, model="simple_nobatch")
    stats = c.get_inference_statistics("simple_nobatch", "1", client_timeout=RPC_TIMEOUT_S)
    assert [(s.name, s.version) for s in stats.model_stats] == [("simple_nobatch", "1")]
    assert stats.model_stats[0].inference_count >= 1
    js = c.get_inference_statistics("simple_nobatch", as_json=True, client_timeout=RPC_TIMEOUT_S)
    entry = js["model_stats"][0]
    assert entry["name"] == "simple_nobatch"
    assert int(entry["inference_count"]) >= 1
    assert int(entry["inference_stats"]["success"]["count"]) >= 1


def test_model_statistics_for_all_models(stack: RunningStack) -> None:
    stats = stack.client().get_inference_statistics(client_timeout=RPC_TIMEOUT_S)
    names = {(s.name, s.version) for s in stats.model_stats}
    for model in ("simple", "simple_nobatch", "mlp", "bench_identity", "identity_bytes"):
        assert (model, "1") in names


def test_model_statistics_unknown_model(stack: RunningStack) -> None:
    expect_error(
        stack.client().get_inference_statistics,
        "no_such_model",
        status="StatusCode.INVALID_ARGUMENT",  # Triton 2.51: "requested model ... not available"
        contains=("no_such_model",),
    )


# ------------------------------------------------------------- repository


def test_repository_index_lists_every_model_ready(
    stack: RunningStack, example_repository: Path
) -> None:
    c = stack.client()
    states = index_states(c)
    on_disk = sorted(p.name for p in example_repository.iterdir() if p.is_dir())
    assert sorted(states) == on_disk
    for model, versions in states.items():
        assert versions == {"1": ("READY", "")}, model
    ready_only = c.get_model_repository_index(client_timeout=RPC_TIMEOUT_S)
    assert len(ready_only.models) == len(on_disk)
    js = c.get_model_repository_index(as_json=True, client_timeout=RPC_TIMEOUT_S)
    assert {"name": "simple", "version": "1", "state": "READY"} in js["models"]


def test_repository_index_ready_filter_raw(stack: RunningStack) -> None:
    with raw_stub(stack.url) as stub:
        resp = stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=True), timeout=RPC_TIMEOUT_S
        )
    assert resp.models
    assert all(m.state == "READY" for m in resp.models)


# ------------------------------------------------------- typed `contents`

# datatype -> (InferTensorContents field, numpy dtype, sample values)
CONTENTS = {
    "BOOL": ("bool_contents", np.bool_, [True, False, True, True, False, False]),
    "INT8": ("int_contents", np.int8, [-128, -1, 0, 1, 64, 127]),
    "INT16": ("int_contents", np.int16, [-32768, -7, 0, 9, 1000, 32767]),
    "INT32": ("int_contents", np.int32, [-(2**31), -5, 0, 5, 123456, 2**31 - 1]),
    "INT64": ("int64_contents", np.int64, [-(2**63), -5, 0, 5, 2**40, 2**63 - 1]),
    "UINT8": ("uint_contents", np.uint8, [0, 1, 2, 100, 200, 255]),
    "UINT16": ("uint_contents", np.uint16, [0, 1, 2, 1000, 40000, 65535]),
    "UINT32": ("uint_contents", np.uint32, [0, 1, 2, 70000, 2**31, 2**32 - 1]),
    "UINT64": ("uint64_contents", np.uint64, [0, 1, 2, 2**40, 2**53 + 1, 2**63 - 1]),
    "FP32": ("fp32_contents", np.float32, [-1.5, 0.0, 0.25, 3.0, 1e10, -7.125]),
    "FP64": ("fp64_contents", np.float64, [-1.5, 0.0, 0.1, 3.0, 1e300, -7.125]),
}


@pytest.mark.parametrize("datatype", sorted(CONTENTS))
def test_typed_contents_identity(stack: RunningStack, datatype: str) -> None:
    field, dtype, values = CONTENTS[datatype]
    request = raw_request(f"identity_{datatype.lower()}", [("INPUT0", datatype, [2, 3])])
    getattr(request.inputs[0].contents, field).extend(values)
    response = raw_infer(stack.url, request)
    assert response.model_name == f"identity_{datatype.lower()}"
    assert response.model_version == "1"
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("OUTPUT0", datatype, [2, 3])
    got = output_array(response, "OUTPUT0", np.dtype(dtype))
    np.testing.assert_array_equal(got, np.array(values, dtype=dtype).reshape(2, 3))


def test_typed_uint64_contents_above_int64_range(stack: RunningStack) -> None:
    values = [0, 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]
    request = raw_request("identity_uint64", [("INPUT0", "UINT64", [1, 6])])
    request.inputs[0].contents.uint64_contents.extend(values)
    response = raw_infer(stack.url, request)
    got = output_array(response, "OUTPUT0", np.dtype(np.uint64))
    np.testing.assert_array_equal(got, np.array(values, dtype=np.uint64).reshape(1, 6))


def test_typed_int_contents_simple(stack: RunningStack) -> None:
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), -4, dtype=np.int32)
    request = raw_request("simple", [("INPUT0", "INT32", [2, 16]), ("INPUT1", "INT32", [2, 16])])
    request.inputs[0].contents.int_contents.extend(a.ravel().tolist())
    request.inputs[1].contents.int_contents.extend(b.ravel().tolist())
    request.id = "typed-1"
    response = raw_infer(stack.url, request)
    assert response.id == "typed-1"
    np.testing.assert_array_equal(output_array(response, "OUTPUT0", np.dtype(np.int32)), a + b)
    np.testing.assert_array_equal(output_array(response, "OUTPUT1", np.dtype(np.int32)), a - b)


def test_typed_fp32_contents_mlp_matches_raw(stack: RunningStack) -> None:
    x = np.random.default_rng(11).standard_normal((3, 256)).astype(np.float32)
    request = raw_request("mlp", [("INPUT0", "FP32", [3, 256])])
    request.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    typed = output_array(raw_infer(stack.url, request), "OUTPUT0", np.dtype(np.float32))

    inp = grpcclient.InferInput("INPUT0", [3, 256], "FP32")
    inp.set_data_from_numpy(x)
    raw = stack.client().infer("mlp", [inp], client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
    np.testing.assert_allclose(typed, raw, rtol=1e-6)


def test_typed_bytes_contents(stack: RunningStack) -> None:
    values = [b"", b"hello", "grüße ✓".encode(), b"x" * 1000]
    request = raw_request("identity_bytes", [("INPUT0", "BYTES", [1, 4])])
    request.inputs[0].contents.bytes_contents.extend(values)
    response = raw_infer(stack.url, request)
    out = response.outputs[0]
    assert (out.datatype, list(out.shape)) == ("BYTES", [1, 4])
    # decode the raw BYTES framing with tritonclient's own helper
    from tritonclient.utils import deserialize_bytes_tensor

    got = deserialize_bytes_tensor(response.raw_output_contents[0])
    assert list(got) == values


def test_typed_contents_requested_output_subset(stack: RunningStack) -> None:
    request = raw_request("simple", [("INPUT0", "INT32", [1, 16]), ("INPUT1", "INT32", [1, 16])])
    request.inputs[0].contents.int_contents.extend(range(16))
    request.inputs[1].contents.int_contents.extend([1] * 16)
    request.outputs.add(name="OUTPUT1")
    response = raw_infer(stack.url, request)
    assert [o.name for o in response.outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(
        output_array(response, "OUTPUT1", np.dtype(np.int32)), (np.arange(16) - 1).reshape(1, 16)
    )
