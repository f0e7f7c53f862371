"""services/scheduler/execute_request.py: the worker's request for a formed
batch, field by field, for batches that mix what requests may carry."""

from __future__ import annotations

from services.scheduler.batch_strategy import Queued
from services.scheduler.execute_request import build_execute_request
from stageserve.generated import stageserve_pb2 as pb


def _queued(msg: pb.ScheduleRequest) -> Queued:
    return Queued(msg, lambda _r: None, 0)


def _request(rid: int, rows: int, a: bytes, b: pb.Tensor, outputs: list[str]) -> Queued:
    return _queued(
        pb.ScheduleRequest(
            id=rid,
            request_id=f"r{rid}",
            batch_size=rows,
            inputs=[pb.Tensor(name="A", datatype="INT8", shape=[rows, 2], raw=a), b],
            outputs=outputs,
        )
    )


def test_each_input_joins_the_rows_of_every_request_in_order() -> None:
    first = _request(
        1, 1, b"\x01\x02", pb.Tensor(name="B", datatype="INT8", shape=[1], raw=b"\x09"), ["Y"]
    )
    second = _request(
        2, 2, b"\x03\x04\x05\x06", pb.Tensor(name="B", datatype="INT8", shape=[2], raw=b"\x08\x07"),
        [],
    )  # fmt: skip
    req = build_execute_request("inst", [first, second], batching=True, request_info=True)
    assert req.instance_id == "inst"
    assert [(t.name, list(t.shape), t.raw) for t in req.inputs] == [
        ("A", [3, 2], b"\x01\x02\x03\x04\x05\x06"),
        ("B", [3], b"\x09\x08\x07"),
    ]
    assert list(req.request_batch_sizes) == [1, 2]
    assert [list(r.names) for r in req.requested] == [["Y"], []]
    assert [i.request_id for i in req.request_info] == ["r1", "r2"]
    assert not req.shm_pids and not req.shm_hosts and not req.cuda_outputs


def test_shared_memory_parts_are_listed_beside_inline_rows() -> None:
    region = pb.TensorPart(region="gw-1", offset=64, length=2)
    shared = _request(
        1, 1, b"", pb.Tensor(name="B", datatype="INT8", shape=[1], parts=[region]), ["Y"]
    )
    shared.msg.inputs[0].raw = b"\x01\x02"
    shared.msg.shm_host, shared.msg.shm_pid = "host-a", 41
    inline = _request(
        2, 1, b"\x03\x04", pb.Tensor(name="B", datatype="INT8", shape=[1], raw=b"\x05"), ["Y"]
    )
    req = build_execute_request("inst", [shared, inline], batching=True)
    b = req.inputs[1]
    assert list(b.shape) == [2] and not b.raw
    assert [(p.region, p.offset, p.length, p.raw) for p in b.parts] == [
        ("gw-1", 64, 2, b""),
        ("", 0, 0, b"\x05"),
    ]
    assert list(req.shm_pids) == [41, 0] and list(req.shm_hosts) == ["host-a", ""]
    assert not req.request_info  # only Python models read them


def test_a_single_request_goes_as_it_came_and_without_batching_counts_one_row() -> None:
    alone = _request(
        7, 1, b"\x01\x02", pb.Tensor(name="B", datatype="INT8", shape=[1], raw=b"\x03"), ["Y"]
    )
    alone.msg.batch_size = 0  # what a gateway sends for a model without batching
    req = build_execute_request("inst", [alone], batching=False)
    assert list(req.inputs) == list(alone.msg.inputs)
    assert list(req.request_batch_sizes) == [1]


def test_a_ragged_input_is_one_flat_tensor_with_each_requests_shape() -> None:
    first = _request(
        1, 1, b"\x01\x02", pb.Tensor(name="B", datatype="INT8", shape=[1, 1], raw=b"\x09"), []
    )
    second = _request(
        2, 1, b"\x03\x04", pb.Tensor(name="B", datatype="INT8", shape=[1, 2], raw=b"\x08\x07"), []
    )
    req = build_execute_request("inst", [first, second], batching=True, ragged=frozenset({"B"}))
    assert [(t.name, list(t.shape), t.raw) for t in req.inputs] == [
        ("A", [2, 2], b"\x01\x02\x03\x04"),
        ("B", [3], b"\x09\x08\x07"),
    ]
    (shapes,) = req.ragged_shapes
    assert (shapes.input, shapes.rank, list(shapes.dims)) == ("B", 2, [1, 1, 1, 2])
