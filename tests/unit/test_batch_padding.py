"""Batch padding and shape warm-up: the policy (stageserve/pad_policy.py, its
parsing in config.py), the pad/unpad arithmetic (batch_padding.py), which
shapes an instance warms (shape_warmup.py), and a real ONNX Runtime session
on the CPU padded through TensorBatches."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.backends import BackendError
from services.worker.batch_padding import (
    BatchPaddingError,
    pad_feeds,
    padded_size,
    unpad_results,
)
from services.worker.instances import HostedInstance, Placement
from services.worker.onnx_backend import OnnxInstance
from services.worker.shape_warmup import (
    instance_shapes,
    shape_samples,
    warm_up_shapes,
    warmup_shapes,
)
from services.worker.tensor_batches import TensorBatches
from services.worker.tensor_sessions import create_backend
from services.worker.warmup import WarmupError, warmup_requests
from stageserve.config import ConfigError, parse_config_text, to_spec
from stageserve.datatypes import from_triton
from stageserve.generated import stageserve_pb2 as pb
from stageserve.pad_policy import AUTO, OFF, ON, PadPolicy, PadPolicyError, pad_policy
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools.examples import batch_size_model

IO = """
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def spec(body: str, platform: str = "onnxruntime_onnx", io: str = IO):
    return to_spec(parse_config_text(f'name: "m"\nplatform: "{platform}"\n{body}{io}'))


def param(value: str) -> str:
    return f'parameters {{ key: "pad_batch" value {{ string_value: "{value}" }} }}\n'


PREFERRED = "max_batch_size: 16\ndynamic_batching { preferred_batch_size: [ 4, 8 ] }\n"
GPU = "instance_group [ { kind: KIND_GPU } ]\n"


# ---- padded_size, pad_feeds, unpad_results


def test_padded_size_is_the_smallest_allowed_size_that_holds_the_batch() -> None:
    allowed = (4, 8, 16)
    assert [padded_size(n, allowed) for n in (1, 3, 4, 5, 8, 9, 16)] == [4, 4, 4, 8, 8, 16, 16]
    assert padded_size(17, allowed) == 17  # nothing holds it: as is
    assert padded_size(3, ()) == 3  # no padding


def test_pad_feeds_repeats_the_last_real_row() -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    s = np.array([b"a", b"b", b"c"], dtype=object)
    out = pad_feeds({"X": x, "S": s}, real=3, padded=5)
    assert out["X"].tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    assert out["S"].tolist() == [b"a", b"b", b"c", b"c", b"c"]
    assert pad_feeds({"X": x}, 3, 3)["X"] is x  # nothing to pad: no copy


def test_pad_feeds_refuses_a_feed_that_is_not_batch_major() -> None:
    with pytest.raises(BatchPaddingError, match="input 'X' has shape \\[2, 3\\]"):
        pad_feeds({"X": np.zeros((2, 3))}, real=3, padded=4)


def test_unpad_results_keeps_the_real_rows_and_refuses_other_outputs() -> None:
    y = np.arange(8).reshape(4, 2)
    assert unpad_results({"Y": y}, real=3, padded=4)["Y"].tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(BatchPaddingError, match="output 'Z' has shape \\[2\\].*pad_batch"):
        unpad_results({"Z": np.zeros(2)}, real=3, padded=4)


# ---- the policy and its parsing


def test_pad_policy_values() -> None:
    assert pad_policy({}, 16, (4, 8), []) == PadPolicy(AUTO, (4, 8, 16))
    assert pad_policy({}, 16, (), []) == PadPolicy()  # auto needs preferred sizes
    # ... except for ONNX Runtime: one shape, max_batch_size, preferred or not
    assert pad_policy({}, 16, (), [], one_shape=True) == PadPolicy(AUTO, (16,))
    assert pad_policy({}, 16, (4, 8), [], one_shape=True) == PadPolicy(AUTO, (16,))
    assert pad_policy({}, 16, (4, 8), ["ragged"], one_shape=True) == PadPolicy()
    assert pad_policy({}, 0, (), [], one_shape=True) == PadPolicy()
    assert pad_policy({"pad_batch": "4,8"}, 16, (), [], one_shape=True) == PadPolicy(ON, (4, 8, 16))
    assert pad_policy({}, 16, (4, 8), ["ragged"]) == PadPolicy()  # auto: silently off
    assert pad_policy({"pad_batch": "false"}, 16, (4, 8), []) == PadPolicy()
    assert pad_policy({"pad_batch": "true"}, 16, (4, 8), []) == PadPolicy(ON, (4, 8, 16))
    assert pad_policy({"pad_batch": "TRUE"}, 12, (), []) == PadPolicy(ON, (1, 2, 4, 8, 12))
    assert pad_policy({"pad_batch": "2, 6"}, 16, (4,), []) == PadPolicy(ON, (2, 6, 16))
    assert PadPolicy(AUTO, (4, 16)).sizes_for(on_gpu=False) == ()
    assert PadPolicy(AUTO, (4, 16)).sizes_for(on_gpu=True) == (4, 16)
    assert PadPolicy(ON, (4, 16)).sizes_for(on_gpu=False) == (4, 16)
    assert PadPolicy(OFF).sizes_for(on_gpu=True) == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1,x", "must be true, false or a list of batch sizes"),
        ("0,4", "sizes \\[0\\] must be in 1..max_batch_size \\(16\\)"),
        ("32", "sizes \\[32\\] must be in 1..max_batch_size"),
    ],
)
def test_pad_policy_refuses_bad_values(value: str, message: str) -> None:
    with pytest.raises(PadPolicyError, match=message):
        pad_policy({"pad_batch": value}, 16, (), [])


def test_config_pads_gpu_instances_by_default() -> None:
    torch = "pytorch_libtorch"
    assert spec(PREFERRED + GPU, torch).pad_batch == PadPolicy(AUTO, (4, 8, 16))
    assert spec("max_batch_size: 16\n" + GPU, torch).pad_batch == PadPolicy()
    # ONNX Runtime: every batch to max_batch_size, the one shape its CUDA EP keeps set up
    assert spec(PREFERRED + GPU).pad_batch == PadPolicy(AUTO, (16,))
    assert spec("max_batch_size: 16\n").pad_batch == PadPolicy(AUTO, (16,))
    assert spec(PREFERRED).pad_batch.sizes_for(on_gpu=False) == ()
    assert spec(PREFERRED + param("false") + GPU).pad_batch == PadPolicy()
    assert spec("max_batch_size: 8\n" + param("1,2,4")).pad_batch == PadPolicy(ON, (1, 2, 4, 8))


RAGGED_IO = """
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
BATCH_INPUT = """batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N"
  data_type: TYPE_FP32 source_input: "INPUT" } ]
"""
STATE = """sequence_batching { state [ { input_name: "S_IN" output_name: "S_OUT"
  data_type: TYPE_FP32 dims: [ 1 ] } ] }
"""


@pytest.mark.parametrize(
    ("body", "platform", "io", "reason"),
    [
        ("max_batch_size: 0\n", "onnxruntime_onnx", IO, "max_batch_size is 0"),
        ("max_batch_size: 8\n", "onnxruntime_onnx", RAGGED_IO, "ragged input\\(s\\) \\['INPUT'\\]"),
        ("max_batch_size: 8\n" + BATCH_INPUT, "onnxruntime_onnx", RAGGED_IO, "batch_input"),
        ("max_batch_size: 8\n" + STATE, "onnxruntime_onnx", IO, "sequence state"),
        ('backend: "python"\nmax_batch_size: 8\n', "", IO, "only ONNX Runtime and TorchScript"),
    ],
)
def test_an_explicit_pad_batch_where_padding_cannot_be_right_fails_the_load(
    body: str, platform: str, io: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=f"model 'm': parameter pad_batch='true' .*{reason}"):
        spec(body + param("true"), platform=platform, io=io)


def test_auto_padding_stays_off_where_it_cannot_be_right() -> None:
    ragged = spec(PREFERRED + GPU, io=RAGGED_IO)
    assert ragged.pad_batch == PadPolicy()


# ---- which shapes an instance warms up


def test_warmup_shapes() -> None:
    plain = spec("max_batch_size: 4\n")
    assert warmup_shapes(plain, on_gpu=False, pad_sizes=()) == ()
    assert warmup_shapes(plain, on_gpu=True, pad_sizes=()) == (1, 2, 3, 4)
    assert warmup_shapes(plain, on_gpu=False, pad_sizes=(2, 4)) == (2, 4)
    off = spec(
        'max_batch_size: 4\nparameters { key: "shape_warmup" value { string_value: "false" } }'
    )
    assert warmup_shapes(off, on_gpu=True, pad_sizes=(2, 4)) == ()
    on = spec(
        'max_batch_size: 2\nparameters { key: "shape_warmup" value { string_value: "true" } }'
    )
    assert warmup_shapes(on, on_gpu=False, pad_sizes=()) == (1, 2)
    assert warmup_shapes(spec("max_batch_size: 0\n"), on_gpu=True, pad_sizes=()) == ()
    assert warmup_shapes(spec("max_batch_size: 4\n", io=RAGGED_IO), True, ()) == ()
    # a variable non-batch dim: its shapes do not follow from the batch size
    variable = IO.replace("dims: [ 2 ]", "dims: [ -1 ]", 1)
    assert warmup_shapes(spec("max_batch_size: 2\n", io=variable), True, ()) == ()
    forced = 'max_batch_size: 2\nparameters { key: "shape_warmup" value { string_value: "true" } }'
    assert warmup_shapes(spec(forced, io=variable), True, ()) == (1, 2)


def test_shape_samples_feed_every_input_with_zeros_of_each_batch_size() -> None:
    s = spec("max_batch_size: 8\n", io=IO.replace("dims: [ 2 ]", "dims: [ -1 ]", 1))
    samples = shape_samples(s, (4, 8))
    assert [(w.name, w.batch_size, w.count) for w in samples] == [
        ("shape 4", 4, 1),
        ("shape 8", 8, 1),
    ]
    (inp,) = samples[0].inputs
    assert (inp.name, inp.dims, inp.source) == ("INPUT", (1,), "zero_data")


# ---- a real ONNX Runtime session, padded


def _batches(tmp_path: Path, pad_sizes: tuple[int, ...]) -> TensorBatches:
    path = tmp_path / "model.onnx"
    path.write_bytes(batch_size_model(2).SerializeToString())
    session = OnnxInstance(path, intra_op_threads=1)
    return TensorBatches(spec(PREFERRED), session, pad_sizes)


def _request(rows: list[np.ndarray]) -> pb.ExecuteRequest:
    data = np.concatenate(rows)
    request = pb.ExecuteRequest(request_batch_sizes=[len(r) for r in rows])
    for _ in rows:
        request.requested.add()
    request.inputs.add(name="INPUT", datatype="FP32", shape=list(data.shape))
    request.inputs[0].raw = numpy_to_raw(data, from_triton("FP32"))
    return request


def _outputs(response: pb.ExecuteResponse) -> list[np.ndarray]:
    return [
        raw_to_numpy(r.outputs[0].raw, "FP32", tuple(r.outputs[0].shape)) for r in response.results
    ]


def test_a_padded_batch_runs_at_the_padded_size_and_answers_the_real_rows(tmp_path: Path) -> None:
    rows = [np.full((1, 2), 10, np.float32), np.full((2, 2), 20, np.float32)]
    padded = _outputs(_batches(tmp_path, (4, 8, 16)).execute_batch(_request(rows), None))
    # the session saw 4 rows; each request gets exactly its own rows back
    assert [o.tolist() for o in padded] == [[[14, 14]], [[24, 24], [24, 24]]]
    plain = _outputs(_batches(tmp_path, ()).execute_batch(_request(rows), None))
    assert [o.tolist() for o in plain] == [[[13, 13]], [[23, 23], [23, 23]]]


def _batch_sum_model() -> bytes:
    """OUTPUT = the sum over the batch of INPUT [N, 2], kept as one row [1, 2]."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["INPUT", "axes"], ["OUTPUT"], keepdims=1)],
        "batch_sum",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


@pytest.mark.parametrize("asked", [False, True])
def test_an_output_padding_cannot_cut_stops_auto_padding_and_fails_asked_padding(
    tmp_path: Path, asked: bool
) -> None:
    """The batch's one row sums the padded rows too: by default (auto) the
    instance stops padding and answers the real batch; asked, the batch fails."""
    path = tmp_path / "model.onnx"
    path.write_bytes(_batch_sum_model())
    batches = TensorBatches(
        spec(PREFERRED), OnnxInstance(path, intra_op_threads=1), (4,), pad_asked=asked
    )
    request = _request([np.full((1, 2), 5, np.float32)])
    if asked:
        with pytest.raises(BackendError, match="pad_batch"):
            batches.execute_batch(request, None)
        return
    assert [o.tolist() for o in _outputs(batches.execute_batch(request, None))] == [[[5, 5]]]
    assert batches.pad_sizes == ()


def test_the_shape_samples_run_each_size_on_a_real_session(tmp_path: Path) -> None:
    batches = _batches(tmp_path, (4, 8, 16))
    s = dataclasses.replace(batches.spec, warmups=shape_samples(batches.spec, (4, 8, 16)))
    seen = []
    for w in warmup_requests(s, tmp_path):
        outputs = _outputs(batches.execute_batch(w.request, None))
        assert len(outputs) == len(w.request.request_batch_sizes)
        seen.append(int(outputs[0][0, 0]))  # zeros + the rows the session saw
    assert seen == [4, 8, 16]


class _RefusesZeros(torch.nn.Module):
    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803
        if bool((INPUT__0 == 0).all()):
            raise RuntimeError("this model refuses an all-zero input")
        return INPUT__0 + 1


def _refusing_instance(tmp_path: Path, extra: str) -> HostedInstance:
    path = tmp_path / "model.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_RefusesZeros()), str(path))
    io = """
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""
    s = spec("max_batch_size: 2\n" + extra, platform="pytorch_libtorch", io=io)
    session = create_backend(s, path, "cpu", threads=1)
    batches = TensorBatches(s, session, s.pad_batch.sizes_for(on_gpu=False))
    return HostedInstance("i0", "m", 1, 1, Placement("KIND_CPU", -1), s, batches)


SHAPE_WARMUP_TRUE = 'parameters { key: "shape_warmup" value { string_value: "true" } }\n'


def test_a_shape_warmup_the_model_asked_for_fails_its_load(tmp_path: Path) -> None:
    instance = _refusing_instance(tmp_path, SHAPE_WARMUP_TRUE)
    try:
        with pytest.raises(WarmupError, match="shape warm-up .*refuses an all-zero input"):
            asyncio.run(warm_up_shapes(instance, (1, 2), tmp_path))
    finally:
        instance.close()


def test_an_automatic_shape_warmup_that_fails_is_logged_and_the_model_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    instance = _refusing_instance(tmp_path, param("true"))  # pads, so warms its sizes
    try:
        assert instance_shapes(instance) == (1, 2)
        with caplog.at_level(logging.WARNING, logger="services.worker.shape_warmup"):
            assert asyncio.run(warm_up_shapes(instance, (1, 2), tmp_path)) >= 0
        (record,) = [r for r in caplog.records if r.getMessage() == "shape warm-up failed"]
        assert "refuses an all-zero input" in record.__dict__["error"]
    finally:
        instance.close()
