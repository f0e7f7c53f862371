"""The protobuf a batch travels in: pure builders, no I/O.

`build_execute_request` turns a formed batch into the worker's
ExecuteRequest (inputs concatenated as bytes, never decoded);
`error_response` is a request's answer when it fails anywhere in the
scheduler. Used by the batch run (batch_run.py), the sequences' adapter
(sequence_queue.py, which builds its own requests with state rows) and the
service.
"""

from __future__ import annotations

import math

from services.scheduler.batch_strategy import Queued
from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb


def error_response(request_id: int, err: StageError) -> pb.ScheduleResponse:
    return pb.ScheduleResponse(id=request_id, failure=err.reason, message=err.message)


def build_execute_request(
    instance_id: str,
    batch: list[Queued],
    batching: bool,
    ragged: frozenset[str] = frozenset(),
    request_info: bool = False,
) -> pb.ExecuteRequest:
    """Concatenate each input's raw bytes across the batch (batch dim is outermost);
    inputs in shared memory (pb.TensorPart) are listed, not read.

    A ragged input becomes one 1-D tensor of all the requests' elements (what
    Triton's ONNX Runtime backend feeds such an input), with the requests' own
    shapes alongside; the bytes are still only concatenated, never decoded."""
    first = batch[0].msg
    req = pb.ExecuteRequest(instance_id=instance_id)
    for i, t in enumerate(first.inputs):
        if t.name in ragged:
            _add_ragged_input(req, t, [q.msg.inputs[i] for q in batch])
            continue
        if len(batch) == 1:
            req.inputs.append(t)
            continue
        total = sum(q.msg.inputs[i].shape[0] for q in batch)
        _join_into(  # built in place: an appended message is a copy of its bytes
            req.inputs.add(name=t.name, datatype=t.datatype, shape=[total, *t.shape[1:]]),
            [q.msg.inputs[i] for q in batch],
        )
    req.request_batch_sizes.extend(q.msg.batch_size if batching else 1 for q in batch)
    for q in batch:
        req.requested.add(names=q.msg.outputs)
        if request_info:  # only Python models read them (InferenceRequest)
            add_request_info(req, q.msg)
    if any(q.msg.shm_pid for q in batch):
        req.shm_hosts.extend(q.msg.shm_host for q in batch)
        req.shm_pids.extend(q.msg.shm_pid for q in batch)
    if any(q.msg.cuda_outputs for q in batch):  # the worker writes these in place
        for q in batch:
            req.cuda_outputs.add().outputs.extend(q.msg.cuda_outputs)
    return req


def _join_into(out: pb.Tensor, parts: list[pb.Tensor]) -> None:
    """`out` gets the requests' bytes in order: concatenated raw bytes, or,
    when some request's bytes are in a gateway's shared memory, the list of
    every request's parts (references passed through, never read here)."""
    if not any(t.parts for t in parts):
        out.raw = b"".join(t.raw for t in parts)
        return
    for t in parts:
        if t.parts:
            out.parts.extend(t.parts)
        else:
            out.parts.add(raw=t.raw)


def add_request_info(req: pb.ExecuteRequest, msg: pb.ScheduleRequest | None) -> None:
    """A request's metadata for pb_utils.InferenceRequest; None: a padding row,
    which Triton 2.51 gives correlation id 0, flags 0 and no request id."""
    if msg is None:
        req.request_info.add(padding=True)
        return
    req.request_info.add(
        request_id=msg.request_id,
        correlation_id=msg.sequence_id,
        correlation_id_str=msg.sequence_id_str,
        # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1, _END = 2
        flags=int(msg.sequence_start) | (int(msg.sequence_end) << 1),
        parameters_json=msg.parameters_json,
    )


def _add_ragged_input(req: pb.ExecuteRequest, first: pb.Tensor, parts: list[pb.Tensor]) -> None:
    """One ragged input across the batch; records each request's shape in req."""
    shapes = req.ragged_shapes.add(input=first.name, rank=len(first.shape))
    for t in parts:
        shapes.dims.extend(t.shape)
    total = sum(math.prod(t.shape) for t in parts)
    _join_into(req.inputs.add(name=first.name, datatype=first.datatype, shape=[total]), parts)
