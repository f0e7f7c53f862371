"""services/worker/device_layout.py: an in-place batch's layout, pure."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.batch_padding import pad_feeds
from services.worker.device_layout import (
    fits,
    input_parts,
    output_slots,
    pad_copies,
    slot_bytes,
    slot_shape,
    written,
)
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb

CONFIG = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "I" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "B" data_type: TYPE_INT32 dims: [ 2, 2 ] reshape: { shape: [ 4 ] } } ]
"""
SPEC = to_spec(parse_config_text(CONFIG))


def _ext(offset: int, size: int, device: int = 0) -> pb.CudaExtent:
    return pb.CudaExtent(raw_handle=bytes(64), offset=offset, byte_size=size, device_id=device)


def test_input_parts_lie_one_after_another() -> None:
    t = pb.Tensor(name="I", datatype="FP32", shape=[3, 4])
    t.parts.add(length=32, cuda=_ext(0, 32))
    t.parts.add(raw=b"")  # an empty part takes no place
    t.parts.add(raw=bytes(16))
    got = [(p.at, p.size, p.part.HasField("cuda")) for p in input_parts(t)]
    assert got == [(0, 32, True), (32, 16, False)]
    whole = pb.Tensor(name="I", datatype="FP32", shape=[1, 4], raw=bytes(16))
    assert [(p.at, p.size) for p in input_parts(whole)] == [(0, 16)]


def test_output_slots_give_each_request_its_rows_and_targets() -> None:
    request = pb.ExecuteRequest(request_batch_sizes=[2, 3])
    request.requested.add(names=["B"])
    request.requested.add()  # every output
    request.cuda_outputs.add().outputs.add(name="B", extent=_ext(0, 64))
    first, second = output_slots(request, SPEC)
    assert [(s.name, s.rows, s.batch, s.target is not None) for s in first] == [
        ("B", slice(0, 2), 2, True)
    ]
    assert [(s.name, s.rows, s.target) for s in second] == [
        ("A", slice(2, 5), None),
        ("B", slice(2, 5), None),
    ]


def test_slot_shapes_and_bytes() -> None:
    assert slot_shape((8, 4), slice(2, 5)) == (3, 4)
    assert slot_shape((4,), None) == (4,)
    assert slot_bytes((8, 4), slice(2, 5), 4) == (32, 48)
    assert slot_bytes((2, 2), None, 8) == (0, 32)


def test_fits_needs_the_room_and_the_device() -> None:
    assert fits(64, _ext(0, 64), 0)
    assert not fits(65, _ext(0, 64), 0)  # the gateway answers Triton's size error
    assert not fits(16, _ext(0, 64, device=1), 0)


def test_a_written_output_has_the_copy_paths_shape() -> None:
    t = written(SPEC, "A", (2, 4), 2)
    assert t.device_written and t.datatype == "FP32" and list(t.shape) == [2, 4] and not t.raw
    assert list(written(SPEC, "B", (2, 4), 2).shape) == [2, 2, 2]  # reshape: the config's dims


@pytest.mark.parametrize("real, padded", [(1, 1), (1, 2), (1, 8), (3, 4), (3, 8), (5, 8), (2, 7)])
def test_pad_copies_repeat_the_last_row_as_batch_padding_does(real: int, padded: int) -> None:
    row = 3
    rows = np.arange(real * row, dtype=np.uint8).reshape(real, row) + 1
    buf = np.zeros(padded * row, dtype=np.uint8)
    buf[: real * row] = rows.reshape(-1)
    copies = pad_copies(real, padded, row)
    for dst, src, n in copies:
        assert src + n <= dst  # never overlapping (cudaMemcpy's rule)
        buf[dst : dst + n] = buf[src : src + n].copy()
    want = pad_feeds({"x": rows}, real, padded)["x"]
    np.testing.assert_array_equal(buf.reshape(padded, row), want)
    if padded > real:
        assert len(copies) <= (padded - real).bit_length()
