"""The layout of one in-place batch (device_batches.py), whatever runs it:
where each request's part lies in a batch input, which rows of each output
are whose and where they go, the shape a written output is answered with,
and the copies that pad a batch input on the device.

Pure (no device, no backend library), unit-tested; the torch and ONNX
Runtime device operations (device_torch.py, device_onnx.py) both use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb


@dataclass(frozen=True)
class Part:
    """One request's part of a batch input: `size` bytes at byte `at` of
    the batch's input, from `part` (a client's CUDA extent or bytes)."""

    at: int
    size: int
    part: pb.TensorPart


def input_parts(t: pb.Tensor) -> list[Part]:
    """The parts of batch input `t`, in order; empty ones left out."""
    parts = list(t.parts) or [pb.TensorPart(raw=t.raw)]
    out, at = [], 0
    for p in parts:
        size = p.cuda.byte_size if p.HasField("cuda") else _host_size(p)
        if size:
            out.append(Part(at, size, p))
        at += size
    return out


def _host_size(part: pb.TensorPart) -> int:
    return part.length if part.region else len(part.raw)


def input_bytes(t: pb.Tensor, item_size: int) -> int:
    """The bytes batch input `t` holds by its shape."""
    return math.prod(t.shape) * item_size


@dataclass(frozen=True)
class Slot:
    """One output of one request: its rows of the batch's output (None: the
    whole output, a model without batching), its batch size, and the region
    it goes to (None: it comes back as bytes)."""

    name: str
    rows: slice | None
    batch: int
    target: pb.CudaExtent | None


def output_slots(request: pb.ExecuteRequest, spec: ModelSpec) -> list[list[Slot]]:
    """Per request of the batch, in order, the outputs it asked for (all the
    model's when it named none). Padded rows lie past every request's rows."""
    targets = [{o.name: o.extent for o in r.outputs} for r in request.cuda_outputs]
    out: list[list[Slot]] = []
    offset = 0
    for i, (size, requested) in enumerate(
        zip(request.request_batch_sizes, request.requested, strict=True)
    ):
        names = list(requested.names) or [o.name for o in spec.outputs]
        mine = targets[i] if i < len(targets) else {}
        rows = slice(offset, offset + size) if spec.batching else None
        out.append([Slot(n, rows, size, mine.get(n)) for n in names])
        offset += size
    return out


def slot_shape(shape: Sequence[int], rows: slice | None) -> tuple[int, ...]:
    """The shape of `rows` of an output of `shape`."""
    if rows is None:
        return tuple(shape)
    return (rows.stop - rows.start, *shape[1:])


def slot_bytes(shape: Sequence[int], rows: slice | None, item_size: int) -> tuple[int, int]:
    """(first byte, byte count) of `rows` of a contiguous output of `shape`."""
    count = math.prod(slot_shape(shape, rows)) * item_size
    if rows is None:
        return 0, count
    row = math.prod(shape[1:]) * item_size
    return rows.start * row, count


def fits(nbytes: int, target: pb.CudaExtent, device_id: int) -> bool:
    """Whether an output of `nbytes` is written into `target` by an instance
    on `device_id`; else it comes back as bytes (for a region too small, the
    gateway then answers Triton's "should be at least N bytes" error)."""
    return nbytes <= target.byte_size and target.device_id == device_id


def written(spec: ModelSpec, name: str, shape: Sequence[int], batch: int) -> pb.Tensor:
    """The answer's entry for an output written into its region: no bytes,
    the shape the copy path would give it."""
    out = spec.output_tensor(name)
    assert out is not None
    if out.reshape is not None:  # the model's shape -> the config's dims
        shape = ((batch,) if spec.batching else ()) + out.dims
    return pb.Tensor(
        name=name, datatype=out.datatype.triton, shape=list(shape), device_written=True
    )


def pad_copies(real: int, padded: int, row_bytes: int) -> list[tuple[int, int, int]]:
    """(destination, source, byte count) copies, in order, that fill rows
    real..padded-1 of a batch input with its last real row (batch_padding's
    rule): the rows already filled are copied on, doubling each time, so at
    most log2(padded - real) + 1 copies, none overlapping its source."""
    if padded <= real or real == 0 or row_bytes == 0:
        return []
    copies = []
    first = (real - 1) * row_bytes  # the last real row, the first of the filled block
    filled = 1
    left = padded - real
    while left:
        n = min(filled, left)
        copies.append((first + filled * row_bytes, first, n * row_bytes))
        filled += n
        left -= n
    return copies
