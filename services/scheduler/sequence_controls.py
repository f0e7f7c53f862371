"""The sequence batcher's control inputs (START / END / READY / CORRID) for
one batch's rows: pure (no I/O), unit-tested on their own.

A flag's row is one of two byte strings (its true and false values in the
config's int32, fp32 or bool form), encoded once per model here, so a
batch's flag tensor is one join. Built with numpy per batch, the four
controls of the example `accumulator` cost the scheduler ~15 us of CPU per
inference at 4-row batches (py-spy, 2-core VM, perf_analyzer c=8,
docs/benchmarks.md). CORRID's values differ per row and are packed per batch.
Padding rows (None: the direct strategy's gaps) read false and correlation
id 0 (or the empty string), as in Triton.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from stageserve.config import ControlInput
from stageserve.errors import invalid
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, serialize_bytes_elements

CORRID = "CONTROL_SEQUENCE_CORRID"

# The integer CORRID types as unsigned struct codes (a signed id's bytes are
# the same): numpy cost ~25 us of CPU per 4-row batch here (py-spy).
_PACKED = {"UINT64": "Q", "INT64": "Q", "UINT32": "I", "INT32": "I"}


def _row_bytes(control: ControlInput, value: float | bool) -> bytes:
    """One row of a flag (config.py gives flags INT32, FP32 or BOOL only)."""
    return numpy_to_raw(np.asarray([value], dtype=control.datatype.numpy), control.datatype)


class ControlFill:
    """Builds one control input's tensor for a batch's rows."""

    def __init__(self, control: ControlInput) -> None:
        self.name = control.name
        self.kind = control.kind
        self.datatype = control.datatype
        if self.kind != CORRID:
            self._true = _row_bytes(control, control.true_value)
            self._false = _row_bytes(control, control.false_value)

    def add_to(
        self, inputs: Any, rows: Sequence[pb.ScheduleRequest | None], batch_dim: list[int]
    ) -> pb.Tensor:
        """Add the tensor for a batch's `rows` (its requests in row order,
        None: a padding row) to `inputs` (an ExecuteRequest's, built in place:
        an appended message is a copy); `batch_dim`: [rows] for a batching
        model, [] otherwise."""
        raw = self._corrid(rows, batch_dim) if self.kind == CORRID else self._flags(rows)
        shape = [*batch_dim, 1] if batch_dim else [1]
        return inputs.add(name=self.name, datatype=self.datatype.triton, shape=shape, raw=raw)

    def _flags(self, rows: Sequence[pb.ScheduleRequest | None]) -> bytes:
        true, false = self._true, self._false
        if self.kind == "CONTROL_SEQUENCE_READY":
            return b"".join(false if r is None else true for r in rows)
        if self.kind == "CONTROL_SEQUENCE_START":
            return b"".join(true if r is not None and r.sequence_start else false for r in rows)
        return b"".join(true if r is not None and r.sequence_end else false for r in rows)

    def _corrid(self, rows: Sequence[pb.ScheduleRequest | None], batch_dim: list[int]) -> bytes:
        dt = self.datatype
        if dt.triton == "BYTES":
            return serialize_bytes_elements(
                ["" if r is None else (r.sequence_id_str or str(r.sequence_id)) for r in rows]
            )
        values: list[int] = []
        for r in rows:
            if r is None:
                values.append(0)
            elif r.sequence_id_str:
                raise invalid(
                    f"string correlation id '{r.sequence_id_str}' cannot fill the "
                    f"{dt.triton} CORRID control '{self.name}'"
                )
            else:
                values.append(r.sequence_id)
        code = _PACKED.get(dt.triton)
        if code is None:
            shape = [*batch_dim, 1] if batch_dim else [1]
            return numpy_to_raw(np.asarray(values, dtype=dt.numpy).reshape(shape), dt)
        # An id wider than the control keeps its low bytes, as a C++ cast does.
        mask = (1 << (8 * struct.calcsize(code))) - 1
        return struct.pack(f"<{len(values)}{code}", *(v & mask for v in values))
