"""Control tensors the sequence batcher fills, in every form Triton's config allows."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.sequence_controls import ControlFill
from services.scheduler.sequence_queue import _padding
from stageserve.config import ControlInput, parse_config_text, to_spec
from stageserve.datatypes import from_triton
from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import raw_to_numpy


def _row(sid=0, sid_str="", start=False, end=False):
    return pb.ScheduleRequest(
        sequence_id=sid, sequence_id_str=sid_str, sequence_start=start, sequence_end=end
    )


def _control_tensor(control: ControlInput, rows: list, batch_dim: list[int]) -> pb.Tensor:
    inputs = pb.ExecuteRequest().inputs
    t = ControlFill(control).add_to(inputs, rows, batch_dim)
    assert list(inputs) == [t]
    return t


ROWS = [_row(11, start=True), None, _row(12, end=True)]  # None: a padding row (direct)


def _values(t: pb.Tensor) -> list:
    return raw_to_numpy(t.raw, t.datatype, t.shape).reshape(-1).tolist()


@pytest.mark.parametrize(
    ("triton", "false", "true"), [("INT32", 0, 1), ("FP32", 0.5, 2.5), ("BOOL", False, True)]
)
def test_start_end_ready_in_every_form(triton, false, true) -> None:
    dt = from_triton(triton)
    for kind, expected in (
        ("CONTROL_SEQUENCE_START", [true, false, false]),
        ("CONTROL_SEQUENCE_END", [false, false, true]),
        ("CONTROL_SEQUENCE_READY", [true, false, true]),
    ):
        t = _control_tensor(ControlInput("C", kind, dt, false, true), ROWS, [3])
        assert t.datatype == triton and list(t.shape) == [3, 1]
        assert _values(t) == expected, kind
        assert t.raw == np.asarray(expected, dtype=dt.numpy).tobytes(), kind


def test_corrid_integer_and_string() -> None:
    t = _control_tensor(
        ControlInput("ID", "CONTROL_SEQUENCE_CORRID", from_triton("UINT64")), ROWS, [3]
    )
    assert _values(t) == [11, 0, 12]
    rows = [_row(sid_str="alpha"), _row(sid=7)]
    t = _control_tensor(
        ControlInput("ID", "CONTROL_SEQUENCE_CORRID", from_triton("BYTES")), rows, [2]
    )
    assert _values(t) == [b"alpha", b"7"]
    t = _control_tensor(
        ControlInput("ID", "CONTROL_SEQUENCE_CORRID", from_triton("BYTES")), ROWS, [3]
    )
    assert _values(t) == [b"11", b"", b"12"]  # a padding row's id is the empty string


def test_string_id_cannot_fill_an_integer_corrid() -> None:
    with pytest.raises(StageError) as exc:
        _control_tensor(
            ControlInput("ID", "CONTROL_SEQUENCE_CORRID", from_triton("INT64")),
            [_row(sid_str="x")],
            [1],
        )
    assert "string correlation id" in exc.value.message


def test_no_batch_dimension_for_max_batch_size_zero() -> None:
    t = _control_tensor(
        ControlInput("S", "CONTROL_SEQUENCE_START", from_triton("INT32"), 0, 1),
        [_row(1, start=True)],
        [],
    )
    assert list(t.shape) == [1] and _values(t) == [1]
    t = _control_tensor(
        ControlInput("ID", "CONTROL_SEQUENCE_CORRID", from_triton("UINT64")), [_row(9)], []
    )
    assert list(t.shape) == [1] and _values(t) == [9]


def test_padding_rows_are_zeros_or_empty_strings() -> None:
    t = pb.Tensor(name="X", datatype="FP32", shape=[1, 4], raw=np.ones(4, np.float32).tobytes())
    assert _padding(t) == b"\0" * 16
    words = pb.Tensor(name="W", datatype="BYTES", shape=[1, 2], raw=b"")
    assert _padding(words) == b"\0" * 8  # two empty elements


def test_config_forms_parse() -> None:
    spec = to_spec(
        parse_config_text(
            """name: "m" platform: "onnxruntime_onnx" max_batch_size: 4
            input [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
            output [ { name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]
            sequence_batching {
              direct { }
              control_input [
                { name: "S" control [
                  { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
                { name: "R" control [
                  { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
                { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
              ]
            }"""
        )
    )
    seq = spec.sequence
    assert seq is not None and seq.strategy == "direct"
    assert seq.max_idle_us == 1_000_000  # Triton's default
    assert [c.datatype.triton for c in seq.controls] == ["FP32", "BOOL", "BYTES"]
    assert spec.extra_inputs() == {"S": "FP32", "R": "BOOL", "C": "BYTES"}


@pytest.mark.parametrize("triton", ["UINT64", "INT64", "UINT32", "INT32"])
def test_corrid_bytes_are_little_endian_and_wide_ids_keep_their_low_bytes(triton) -> None:
    dt = from_triton(triton)
    control = ControlInput("ID", "CONTROL_SEQUENCE_CORRID", dt)
    ids = [1, 2**31 + 5, 2**40 + 7]  # 2**40 + 7 fits the 64-bit forms only
    t = _control_tensor(control, [_row(i) for i in ids], [3])
    width = dt.item_size * 8
    want = np.asarray([i % 2**width for i in ids], dtype=np.uint64).astype(dt.numpy)
    assert t.raw == want.astype(np.dtype(dt.numpy).newbyteorder("<")).tobytes()
