"""Ragged batching at the worker: request shapes, batch inputs, scattered outputs.

Triton's semantics (model_config.proto BatchInput / BatchOutput, as its ONNX
Runtime backend applies them):

* a ragged input (allow_ragged_batch) is fed as one 1-D tensor holding every
  request's elements in batch order;
* a batch input is computed from the shapes the requests gave its source
  input (each with its batch dimension; "items" is the sum of the requests'
  batch sizes, "rank" counts the batch dimension):

  - BATCH_ELEMENT_COUNT: [requests], each request's element count;
  - BATCH_ACCUMULATED_ELEMENT_COUNT: [requests], the running total of those;
  - BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO: [requests + 1], 0 then the
    running total;
  - BATCH_MAX_ELEMENT_COUNT_AS_SHAPE: [largest count], zeros (the shape is
    the information);
  - BATCH_ITEM_SHAPE: [items, rank - 1], each item's shape without the batch
    dimension;
  - BATCH_ITEM_SHAPE_FLATTEN: [items * (rank - 1)], the same values, flat;
* a BATCH_SCATTER_WITH_INPUT_SHAPE output is cut from the model's output,
  flattened, in consecutive pieces: each request gets the output's dims (the
  batch dimension first) with every -1 taken from the same position of that
  request's source-input shape.

Everything here is pure (no I/O) and unit-tested.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from stageserve.config import BatchInputSpec, ModelSpec
from stageserve.generated import stageserve_pb2 as pb

Shape = tuple[int, ...]


class BatchIOError(ValueError):
    """A batch that does not fit its batch input / output declaration."""


def request_shapes(request: pb.ExecuteRequest, spec: ModelSpec, name: str) -> list[Shape]:
    """The shape each request of the batch gave input `name` (batch dim included).

    Ragged inputs carry their shapes in the request; the others share their
    non-batch dims, so the batched tensor and the batch sizes say it all.
    """
    for ragged in request.ragged_shapes:
        if ragged.input == name:
            return _unflatten(list(ragged.dims), int(ragged.rank), len(request.request_batch_sizes))
    tensor = next((t for t in request.inputs if t.name == name), None)
    if tensor is None:
        raise BatchIOError(f"input '{name}' is not in the batch")
    if not spec.batching:
        return [tuple(int(d) for d in tensor.shape)]
    inner = tuple(int(d) for d in tensor.shape[1:])
    return [(int(size), *inner) for size in request.request_batch_sizes]


def _unflatten(dims: list[int], rank: int, requests: int) -> list[Shape]:
    if len(dims) != rank * requests:
        raise BatchIOError(f"{len(dims)} ragged dims do not make {requests} shapes of rank {rank}")
    return [tuple(dims[i * rank : (i + 1) * rank]) for i in range(requests)]


def batch_input_array(batch_input: BatchInputSpec, shapes: Sequence[Shape]) -> np.ndarray:
    """The tensor one batch input takes, from its source input's request shapes."""
    kind = batch_input.kind
    counts = np.array([math.prod(s) for s in shapes], dtype=np.int64)
    if kind == "BATCH_ELEMENT_COUNT":
        values = counts
    elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        values = np.cumsum(counts)
    elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        values = np.concatenate([[0], np.cumsum(counts)])
    elif kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
        values = np.zeros(int(counts.max(initial=0)), dtype=np.int64)
    elif kind in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
        values = _item_shapes(shapes)
        if kind == "BATCH_ITEM_SHAPE_FLATTEN":
            values = values.reshape(-1)
    else:  # config.py admits only the kinds above
        raise BatchIOError(f"unknown batch input kind {kind}")
    assert batch_input.datatype.numpy is not None
    return values.astype(batch_input.datatype.numpy)


def _item_shapes(shapes: Sequence[Shape]) -> np.ndarray:
    """[batch items, rank - 1]: each request's non-batch dims, once per batch item."""
    rank = len(shapes[0]) if shapes else 1
    rows = [inner for s in shapes for inner in [s[1:]] * s[0]]
    return np.array(rows, dtype=np.int64).reshape(len(rows), rank - 1)


def scatter_shapes(dims: Sequence[int], sources: Sequence[Shape]) -> list[Shape]:
    """Each request's output shape: `dims` (batch dim first) with every -1 taken
    from the same position of the request's source-input shape."""
    out = []
    for source in sources:
        shape = []
        for i, d in enumerate(dims):
            if d != -1:
                shape.append(int(d))
            elif i < len(source):
                shape.append(int(source[i]))
            else:
                raise BatchIOError(
                    f"output dims {list(dims)} have a -1 at position {i}, which source shape "
                    f"{list(source)} does not have"
                )
        out.append(tuple(shape))
    return out


def scatter(array: np.ndarray, shapes: Sequence[Shape]) -> list[np.ndarray]:
    """Cut a batch output into consecutive per-request pieces of the given shapes."""
    flat = array.reshape(-1)
    needed = sum(math.prod(s) for s in shapes)
    if flat.size < needed:
        raise BatchIOError(
            f"the model's output has {flat.size} elements, the requests' shapes need {needed}"
        )
    pieces, offset = [], 0
    for shape in shapes:
        count = math.prod(shape)
        pieces.append(flat[offset : offset + count].reshape(shape))
        offset += count
    return pieces
