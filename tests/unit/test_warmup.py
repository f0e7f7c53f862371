"""model_warmup: config validation (stageserve.config) and the pure request
builder and runner (services.worker.warmup)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.worker.warmup import WarmupError, run_warmup, warmup_requests
from stageserve.config import ConfigError, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import raw_to_numpy

BASE = """name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] },
        { name: "S" data_type: TYPE_STRING dims: [ 2 ] },
        { name: "R" data_type: TYPE_INT32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } } ]
output [ { name: "O" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _inputs(a: str = "random_data: true", s: str = "zero_data: true", r: str = "zero_data: true"):
    return (
        f'inputs {{ key: "A" value: {{ data_type: TYPE_FP32 dims: [ 3 ] {a} }} }}\n'
        f'inputs {{ key: "S" value: {{ data_type: TYPE_STRING dims: [ 2 ] {s} }} }}\n'
        f'inputs {{ key: "R" value: {{ data_type: TYPE_INT32 dims: [ 4 ] {r} }} }}\n'
    )


def _spec(warmup_body: str, base: str = BASE):
    return to_spec(parse_config_text(base + f"model_warmup [ {{ {warmup_body} }} ]\n"))


def test_requests_have_triton_shapes_and_data(tmp_path: Path) -> None:
    (tmp_path / "warmup").mkdir()
    data = np.arange(12, dtype=np.int32)
    (tmp_path / "warmup" / "r.bin").write_bytes(data.tobytes())
    spec = _spec('name: "w" batch_size: 3 count: 2 ' + _inputs(r='input_data_file: "r.bin"'))
    (w,) = warmup_requests(spec, tmp_path)
    assert w.name == "w" and w.count == 2
    # batch_size 3: three requests of batch 1, run as one batch
    assert list(w.request.request_batch_sizes) == [1, 1, 1] and len(w.request.requested) == 3
    tensors = {t.name: t for t in w.request.inputs}
    assert list(tensors["A"].shape) == [3, 3]
    assert list(tensors["R"].shape) == [3, 2, 2]  # the config's reshape, as the gateway sends
    np.testing.assert_array_equal(
        raw_to_numpy(tensors["R"].raw, "INT32", [3, 2, 2]).reshape(-1), data
    )
    strings = raw_to_numpy(tensors["S"].raw, "BYTES", [3, 2])
    assert strings.tolist() == [[b"", b""]] * 3
    a = raw_to_numpy(tensors["A"].raw, "FP32", [3, 3])
    assert ((a >= 0) & (a < 1)).all() and len(set(a.reshape(-1).tolist())) > 1
    again = warmup_requests(spec, tmp_path)[0].request.inputs[0].raw
    assert again == tensors["A"].raw  # reproducible from load to load


def test_count_zero_runs_once_and_bad_files_are_named(tmp_path: Path) -> None:
    spec = _spec('name: "w" batch_size: 1 ' + _inputs(a='input_data_file: "missing.bin"'))
    with pytest.raises(WarmupError, match="warmup 'w' input 'A'.*missing.bin"):
        warmup_requests(spec, tmp_path)
    assert _spec('name: "w" batch_size: 1 ' + _inputs()).warmups[0].count == 1


@pytest.mark.parametrize(
    "body,match",
    [
        ("batch_size: 1 " + _inputs(), "has no name"),
        ('name: "w" batch_size: 5 ' + _inputs(), "batch_size 5 must be in 1..4"),
        ('name: "w" batch_size: 0 ' + _inputs(), "batch_size 0"),
        (
            'name: "w" batch_size: 1 '
            + _inputs()
            + 'inputs { key: "Z" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }',
            "'Z'.* not model inputs",
        ),
        (
            'name: "w" batch_size: 1 '
            'inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }',
            "no warmup data for input",
        ),
        (
            'name: "w" batch_size: 1 '
            + _inputs().replace("TYPE_FP32 dims: [ 3 ]", "TYPE_FP64 dims: [ 3 ]"),
            "data_type TYPE_FP64, the model input is TYPE_FP32",
        ),
        (
            'name: "w" batch_size: 1 ' + _inputs().replace("dims: [ 3 ]", "dims: [ -1 ]"),
            "must be fixed",
        ),
        ('name: "w" batch_size: 1 ' + _inputs(a=""), "needs zero_data, random_data"),
        (
            'name: "w" batch_size: 1 ' + _inputs(a='input_data_file: "/etc/passwd"'),
            "under the model's warmup/ folder",
        ),
    ],
)
def test_invalid_warmups_are_refused_at_load(body: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _spec(body)


def test_runner_counts_as_triton_and_names_the_failing_sample(tmp_path: Path) -> None:
    spec = _spec('name: "w" batch_size: 2 count: 3 ' + _inputs())
    requests = warmup_requests(spec, tmp_path)
    seen = []

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        seen.append(request)
        return pb.ExecuteResponse(compute_infer_ns=1000)

    stats = run_warmup(execute, requests)
    assert len(seen) == 3
    assert stats.inference_count == 6 and stats.execution_count == 3
    assert stats.success.count == 6 and stats.compute_infer.ns == 6000
    assert {size: b.compute_infer.count for size, b in stats.batches.items()} == {2: 3}

    def broken(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        raise RuntimeError("kaput")

    with pytest.raises(WarmupError, match="warmup 'w' failed: kaput"):
        run_warmup(broken, requests)
