"""Ragged batching: config rules, the batcher's shape rule, the scheduler's
ExecuteRequest, batch-input computation and output scattering, and a batch of
different-length requests through the worker's real ONNX Runtime instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.scheduler.batch_strategy import Queued
from services.scheduler.batch_strategy import shape_key as msg_shape_key
from services.scheduler.batcher import DynamicBatcher, Pending, shape_key
from services.scheduler.execute_request import build_execute_request
from services.worker.batch_io import (
    BatchIOError,
    batch_input_array,
    request_shapes,
    scatter,
    scatter_shapes,
)
from services.worker.instances import HostedInstance, Placement
from services.worker.onnx_backend import OnnxInstance
from services.worker.tensor_batches import TensorBatches
from stageserve.config import (
    BATCH_INPUT_KINDS,
    BatchInputSpec,
    BatchOutputSpec,
    ConfigError,
    ModelSpec,
    parse_config_text,
    read_config,
    to_spec,
)
from stageserve.datatypes import from_triton
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools import examples

# ===================================================================== config

RAGGED_IO = """
input [
  { name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] }
]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "OTHER" data_type: TYPE_FP32 dims: [ 1 ] }
]
"""


def ragged_spec(body: str = "", io: str = RAGGED_IO, mbs: int = 8) -> ModelSpec:
    text = f'name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {mbs}\n{io}{body}'
    return to_spec(parse_config_text(text))


def bi(kind: str = "BATCH_ELEMENT_COUNT", target: str = '"N"', source: str = '"X"', dt="INT32"):
    targets = f"target_name: {target}" if target else ""
    sources = f"source_input: {source}" if source else ""
    return f"batch_input [ {{ kind: {kind} {targets} data_type: TYPE_{dt} {sources} }} ]\n"


def bo(target: str = '"OUT"', source: str = '"X"', kind: str = "BATCH_SCATTER_WITH_INPUT_SHAPE"):
    targets = f"target_name: {target}" if target else ""
    sources = f"source_input: {source}" if source else ""
    return f"batch_output [ {{ kind: {kind} {targets} {sources} }} ]\n"


def test_example_config_parses_into_the_ragged_spec(tmp_path: Path) -> None:
    examples.write_ragged_sum(tmp_path)
    spec = to_spec(read_config(tmp_path / "ragged_sum"))
    assert spec.ragged_inputs == {"INPUT"}
    ragged_input = spec.input("INPUT")
    assert ragged_input is not None and ragged_input.allow_ragged_batch
    int32 = from_triton("INT32")
    assert spec.batch_inputs == (
        BatchInputSpec("BATCH_ITEM_SHAPE_FLATTEN", ("ITEM_LENGTHS",), int32, "INPUT"),
        BatchInputSpec("BATCH_ACCUMULATED_ELEMENT_COUNT", ("REQUEST_ENDS",), int32, "INPUT"),
    )
    assert spec.batch_outputs == (
        BatchOutputSpec("BATCH_SCATTER_WITH_INPUT_SHAPE", ("RUNNING_SUM",), "INPUT"),
    )
    assert spec.batch_output("RUNNING_SUM") is spec.batch_outputs[0]
    assert spec.batch_output("SUM") is None
    # batch inputs are model inputs no request carries, never request inputs
    assert spec.extra_inputs() == {"ITEM_LENGTHS": "INT32", "REQUEST_ENDS": "INT32"}
    assert [t.name for t in spec.inputs] == ["INPUT"]


@pytest.mark.parametrize("kind", BATCH_INPUT_KINDS)
@pytest.mark.parametrize("dt", ["INT32", "FP32"])
def test_every_batch_input_kind_and_type_is_accepted(kind: str, dt: str) -> None:
    # a non-ragged source is fine too (Triton does not require a ragged one)
    for source in ('"X"', '"Y"'):
        spec = ragged_spec(bi(kind, source=source, dt=dt))
        assert spec.batch_inputs[0].kind == kind
        assert spec.batch_inputs[0].datatype.triton == dt


def test_batch_input_with_several_targets() -> None:
    spec = ragged_spec(bi(target='[ "A", "B" ]'))
    assert spec.batch_inputs[0].target_names == ("A", "B")
    assert spec.extra_inputs() == {"A": "INT32", "B": "INT32"}


def test_model_without_ragged_batching_has_none() -> None:
    spec = ragged_spec(io=RAGGED_IO.replace("allow_ragged_batch: true", ""))
    assert spec.ragged_inputs == frozenset()
    assert spec.batch_inputs == () and spec.batch_outputs == ()


SEQUENCE = "sequence_batching { oldest { } }\n"
ENSEMBLE_STEPS = """ensemble_scheduling { step [ { model_name: "inner" model_version: -1
  input_map { key: "X" value: "X" } input_map { key: "Y" value: "Y" }
  output_map { key: "OUT" value: "OUT" } output_map { key: "OTHER" value: "OTHER" } } ] }
"""

REFUSED = {
    "ragged without batching": ("", 0, ("allow_ragged_batch", "'X'", "max_batch_size > 0")),
    "batch_input without batching": (
        bi(),
        0,
        ("batch_input", "max_batch_size > 0"),
    ),
    "ragged with the sequence batcher": (SEQUENCE, 8, ("sequence_batching",)),
    "unknown batch input kind": (bi(kind="9"), 8, ("unknown batch input kind 9",)),
    "batch input without source": (bi(source=""), 8, ("expects 1 source_input, got 0",)),
    "batch input with two sources": (
        bi(source='[ "X", "Y" ]'),
        8,
        ("expects 1 source_input, got 2",),
    ),
    "batch input unknown source": (bi(source='"NOPE"'), 8, ("unknown source_input 'NOPE'",)),
    "batch input bad data type": (bi(dt="INT64"), 8, ("TYPE_INT32 or TYPE_FP32", "TYPE_INT64")),
    "batch input without target": (bi(target=""), 8, ("needs a non-empty target_name",)),
    "batch input target is an input": (bi(target='"Y"'), 8, ("'Y' is also a declared input",)),
    "batch input target twice": (
        bi(target='"N"') + bi(kind="BATCH_ITEM_SHAPE", target='"N"'),
        8,
        ("'N' is declared twice",),
    ),
    "unknown batch output kind": (bo(kind="5"), 8, ("unknown batch output kind 5",)),
    "batch output unknown target": (bo(target='"NOPE"'), 8, ("unknown target output(s) ['NOPE']",)),
    "batch output without target": (bo(target=""), 8, ("batch_output", "needs a target_name")),
    "batch output unknown source": (bo(source='"NOPE"'), 8, ("unknown source_input 'NOPE'",)),
    "batch output without source": (bo(source=""), 8, ("expects 1 source_input, got 0",)),
    "batch output target twice": (bo() + bo(source='"Y"'), 8, ("['OUT'] can only be given once",)),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_invalid_ragged_configs_are_refused(case: str) -> None:
    body, mbs, words = REFUSED[case]
    with pytest.raises(ConfigError) as info:
        ragged_spec(body, mbs=mbs)
    message = str(info.value)
    assert "model 'm'" in message
    for w in words:
        assert w in message, f"{w!r} not in {message}"


def test_batch_io_refused_on_an_ensemble() -> None:
    text = f'name: "m"\nplatform: "ensemble"\nmax_batch_size: 8\n{RAGGED_IO}{ENSEMBLE_STEPS}'
    with pytest.raises(ConfigError, match="not with ensemble_scheduling"):
        to_spec(parse_config_text(text))


# ============================================================ batcher rule


def test_shape_key_ignores_a_ragged_inputs_shape_but_not_its_name() -> None:
    short = [("X", [1, 3]), ("Y", [1, 2])]
    long = [("X", [1, 7]), ("Y", [1, 2])]
    assert shape_key(short, True) != shape_key(long, True)
    assert shape_key(short, True, {"X"}) == shape_key(long, True, {"X"})
    # the batch dimension never counts; a non-ragged input still must match
    assert shape_key([("X", [4, 3]), ("Y", [4, 2])], True, {"X"}) == shape_key(short, True, {"X"})
    assert shape_key(short, True, {"X"}) != shape_key([("X", [1, 3]), ("Y", [1, 5])], True, {"X"})
    # a request without the (optional) ragged input is a different batch
    assert shape_key(short, True, {"X"}) != shape_key([("Y", [1, 2])], True, {"X"})


def _pending(tag: str, shapes: list[tuple[str, list[int]]], ragged: set[str], t: int = 0):
    return Pending(
        batch_size=shapes[0][1][0],
        shape_key=shape_key(shapes, True, ragged),
        enqueue_ns=t,
        payload=tag,
    )


def _taken(b: DynamicBatcher) -> list[object]:
    """The payloads of the batch the batcher sends now; there must be one."""
    batch = b.next_batch(0).batch
    assert batch is not None
    return [p.payload for p in batch]


def test_dynamic_batcher_batches_different_lengths_of_a_ragged_input() -> None:
    b = DynamicBatcher(8)
    for i, length in enumerate([3, 1, 7, 2]):
        b.add(_pending(f"r{i}", [("X", [1, length])], {"X"}))
    assert _taken(b) == ["r0", "r1", "r2", "r3"]


def test_dynamic_batcher_keeps_different_shapes_apart_without_ragged() -> None:
    b = DynamicBatcher(8)
    for i, length in enumerate([3, 3, 7, 3]):
        b.add(_pending(f"r{i}", [("X", [1, length])], set()))
    assert _taken(b) == ["r0", "r1"]
    assert _taken(b) == ["r2"]
    assert _taken(b) == ["r3"]


def test_dynamic_batcher_splits_ragged_requests_on_a_non_ragged_input() -> None:
    b = DynamicBatcher(8)
    shapes = [[3, 2], [5, 2], [1, 4], [2, 4]]  # (ragged X length, fixed-rank Y length)
    for i, (x, y) in enumerate(shapes):
        b.add(_pending(f"r{i}", [("X", [1, x]), ("Y", [1, y])], {"X"}))
    assert _taken(b) == ["r0", "r1"]
    assert _taken(b) == ["r2", "r3"]


def test_ragged_batch_still_respects_max_batch_size() -> None:
    b = DynamicBatcher(4)
    for i, (bs, length) in enumerate([(2, 3), (1, 9), (2, 1)]):
        b.add(_pending(f"r{i}", [("X", [bs, length])], {"X"}))
    assert _taken(b) == ["r0", "r1"]
    assert _taken(b) == ["r2"]


# =================================================== scheduler's ExecuteRequest


def _schedule_request(rid: int, **arrays: np.ndarray) -> pb.ScheduleRequest:
    msg = pb.ScheduleRequest(id=rid, batch_size=next(iter(arrays.values())).shape[0])
    for name, arr in arrays.items():
        dt = (
            "BYTES"
            if arr.dtype == object
            else {"float32": "FP32", "int32": "INT32"}[arr.dtype.name]
        )
        msg.inputs.add(
            name=name, datatype=dt, shape=list(arr.shape), raw=numpy_to_raw(arr, from_triton(dt))
        )
    return msg


def _queued(msg: pb.ScheduleRequest) -> Queued:
    return Queued(msg, lambda _r: None, 0)


def test_execute_request_concatenates_a_ragged_input_as_1d_with_its_shapes() -> None:
    a = np.arange(3, dtype=np.float32).reshape(1, 3)
    b = np.arange(10, dtype=np.float32).reshape(2, 5)
    y = np.ones((1, 2), np.int32)
    batch = [_queued(_schedule_request(1, X=a, Y=y)), _queued(_schedule_request(2, X=b, Y=y))]
    assert msg_shape_key(batch[0].msg, True, frozenset({"X"})) == msg_shape_key(
        batch[1].msg, True, frozenset({"X"})
    )
    req = build_execute_request("inst", batch, True, frozenset({"X"}))
    x, y_batched = req.inputs
    assert (x.name, list(x.shape)) == ("X", [13])
    assert x.raw == a.tobytes() + b.tobytes()  # the bytes are only concatenated
    assert (y_batched.name, list(y_batched.shape)) == ("Y", [2, 2])  # 1 + 1 rows
    assert [(r.input, r.rank, list(r.dims)) for r in req.ragged_shapes] == [("X", 2, [1, 3, 2, 5])]
    assert list(req.request_batch_sizes) == [1, 2]


def test_execute_request_ragged_single_request_and_bytes() -> None:
    words = np.array([[b"a", b"bc", b""]], dtype=object)
    req = build_execute_request(
        "inst", [_queued(_schedule_request(1, X=words))], True, frozenset({"X"})
    )
    (x,) = req.inputs
    assert list(x.shape) == [3]
    assert list(raw_to_numpy(x.raw, "BYTES", x.shape)) == [b"a", b"bc", b""]
    assert list(req.ragged_shapes[0].dims) == [1, 3]


def test_non_ragged_models_send_no_ragged_shapes() -> None:
    a = np.ones((1, 4), np.float32)
    req = build_execute_request(
        "inst", [_queued(_schedule_request(1, X=a)), _queued(_schedule_request(2, X=a))], True
    )
    assert list(req.inputs[0].shape) == [2, 4] and not req.ragged_shapes


# ====================================================== batch-input computation

# Triton's own example: a batch-2 request of shape [3, 1] and a batch-1 request
# of shape [2, 2], i.e. request shapes [2, 3, 1] and [1, 2, 2] (6 and 4 elements).
TRITON_SHAPES = [(2, 3, 1), (1, 2, 2)]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("BATCH_ELEMENT_COUNT", [6, 4]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT", [6, 10]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", [0, 6, 10]),
        ("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", [0] * 6),
        ("BATCH_ITEM_SHAPE", [[3, 1], [3, 1], [2, 2]]),
        ("BATCH_ITEM_SHAPE_FLATTEN", [3, 1, 3, 1, 2, 2]),
    ],
)
@pytest.mark.parametrize("dt", ["INT32", "FP32"])
def test_batch_input_values_shapes_and_types(kind: str, expected: list, dt: str) -> None:
    spec = BatchInputSpec(kind, ("T",), from_triton(dt), "X")
    arr = batch_input_array(spec, TRITON_SHAPES)
    want = np.array(expected, dtype=from_triton(dt).numpy)
    assert arr.dtype == want.dtype
    assert arr.shape == want.shape
    np.testing.assert_array_equal(arr, want)


def test_batch_input_of_a_single_request() -> None:
    int32 = from_triton("INT32")
    shapes = [(1, 5)]
    assert batch_input_array(
        BatchInputSpec("BATCH_ITEM_SHAPE", ("T",), int32, "X"), shapes
    ).shape == (1, 1)
    np.testing.assert_array_equal(
        batch_input_array(
            BatchInputSpec("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", ("T",), int32, "X"), shapes
        ),
        [0, 5],
    )


def test_request_shapes_from_ragged_dims_and_from_batched_tensors() -> None:
    spec = ragged_spec()
    req = pb.ExecuteRequest(request_batch_sizes=[1, 2])
    req.inputs.add(name="X", datatype="FP32", shape=[13])
    req.inputs.add(name="Y", datatype="INT32", shape=[3, 2])
    req.ragged_shapes.add(input="X", rank=2, dims=[1, 3, 2, 5])
    assert request_shapes(req, spec, "X") == [(1, 3), (2, 5)]
    assert request_shapes(req, spec, "Y") == [(1, 2), (2, 2)]
    with pytest.raises(BatchIOError, match="'Z' is not in the batch"):
        request_shapes(req, spec, "Z")
    req.ragged_shapes[0].dims.append(7)
    with pytest.raises(BatchIOError, match="do not make 2 shapes"):
        request_shapes(req, spec, "X")


# ============================================================ output scatter


def test_scatter_shapes_take_each_minus_one_from_the_source() -> None:
    assert scatter_shapes((-1, -1), [(1, 3), (2, 5)]) == [(1, 3), (2, 5)]
    assert scatter_shapes((-1, 4), [(1, 3), (2, 5)]) == [(1, 4), (2, 4)]
    assert scatter_shapes((-1, -1, 2), [(1, 3, 9)]) == [(1, 3, 2)]
    with pytest.raises(BatchIOError, match="position 2"):
        scatter_shapes((-1, 2, -1), [(1, 3)])


def test_scatter_cuts_consecutive_pieces() -> None:
    flat = np.arange(13, dtype=np.float32)
    a, b = scatter(flat, [(1, 3), (2, 5)])
    np.testing.assert_array_equal(a, [[0, 1, 2]])
    np.testing.assert_array_equal(b, np.arange(3, 13).reshape(2, 5))
    with pytest.raises(BatchIOError, match="has 13 elements, the requests' shapes need 14"):
        scatter(flat, [(1, 4), (2, 5)])


# ============================================== a ragged batch through the worker


@pytest.fixture(scope="module")
def ragged_instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostedInstance]:
    root = tmp_path_factory.mktemp("ragged")
    examples.write_ragged_sum(root)
    spec = to_spec(read_config(root / "ragged_sum"))
    backend = OnnxInstance(
        root / "ragged_sum" / "1" / "model.onnx",
        "cpu",
        1,
        {**{t.name: t.datatype.triton for t in spec.inputs}, **spec.extra_inputs()},
        {t.name: t.datatype.triton for t in spec.outputs},
    )
    inst = HostedInstance(
        "w/ragged_sum/1/g1/0",
        "ragged_sum",
        1,
        1,
        Placement("KIND_CPU", -1),
        spec,
        TensorBatches(spec, backend),
    )
    yield inst
    inst.close()


def _run_batch(inst: HostedInstance, arrays: list[np.ndarray], outputs=()) -> list[dict]:
    batch = []
    for i, arr in enumerate(arrays):
        msg = _schedule_request(i, INPUT=arr)
        msg.outputs.extend(outputs)
        batch.append(_queued(msg))
    request = build_execute_request("inst", batch, True, inst.spec.ragged_inputs)
    response = inst.execute(request)
    assert isinstance(response, pb.ExecuteResponse)  # not decoupled: one response
    return [
        {t.name: raw_to_numpy(t.raw, t.datatype, t.shape) for t in r.outputs}
        for r in response.results
    ]


def test_worker_answers_each_request_of_a_ragged_batch(ragged_instance: HostedInstance) -> None:
    arrays = [
        np.array([[1, 2, 3]], np.float32),
        np.array([[10]], np.float32),
        np.array([[1, 1, 1, 1, 1], [2, 2, 2, 2, 2]], np.float32),  # batch 2
        np.array([[4, 5, 6, 7]], np.float32),
    ]
    results = _run_batch(ragged_instance, arrays)
    for arr, got in zip(arrays, results, strict=True):
        np.testing.assert_array_equal(got["SUM"], arr.sum(axis=1, keepdims=True))
        running = np.cumsum(arr.reshape(-1)).reshape(arr.shape)
        assert got["RUNNING_SUM"].shape == arr.shape
        np.testing.assert_array_equal(got["RUNNING_SUM"], running)


def test_worker_scatters_only_requested_outputs(ragged_instance: HostedInstance) -> None:
    arrays = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5]], np.float32)]
    results = _run_batch(ragged_instance, arrays, outputs=["RUNNING_SUM"])
    assert [sorted(r) for r in results] == [["RUNNING_SUM"], ["RUNNING_SUM"]]
    np.testing.assert_array_equal(results[1]["RUNNING_SUM"], [[3, 7, 12]])
