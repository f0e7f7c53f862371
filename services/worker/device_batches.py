"""One formed batch of an instance on a CUDA device whose inputs lie in, or
whose outputs go to, clients' CUDA shared-memory regions: the in-place path
(services/worker/cuda_inplace.py opens the regions).

Each input is built on the instance's device: one device buffer the size of
the batch's input, each request's part copied into it once (device to
device from a client's region; host to device for a part that came as
bytes). The session runs on those buffers. Each output a request asked to
have in a CUDA region is copied there device to device; every other output
comes back to host memory as on the copy path. The batch waits for its
device's work before answering, so the client's memory holds the outputs
when the gateway answers.

An instance that pads (batch_padding.py) pads on the device: the last real
row repeated; the padded rows are never read back.

What is the same for every backend is here and in device_layout.py (which
request's part goes where, which rows of an output are whose); the device
memory itself is a `DeviceOps`: TorchScript's (device_torch.py) or ONNX
Runtime's with the CUDA execution provider (device_onnx.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from services.worker.backends import BackendError, TensorBackend
from services.worker.batch_padding import padded_size
from services.worker.cuda_inplace import HANDLES, IpcHandles
from services.worker.device_layout import fits as fits_region
from services.worker.device_layout import input_bytes, input_parts, output_slots, slot_shape
from services.worker.device_layout import written as written_tensor
from stageserve import tensor_shm
from stageserve.config import ModelSpec
from stageserve.datatypes import from_triton
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import RegionNotLocal, part_bytes

#: (name, host array, spec, batch size or None, tensor-region target) -> the
#: output's message on the copy path (tensor_batches._tensor)
HostTensor = Callable[..., pb.Tensor]


@dataclass(frozen=True)
class Source:
    """What one part of a batch input is copied from: `size` bytes to byte
    `at` of the input, from device pointer `ptr` (a client's region) or
    from host `data` (a part that came as bytes)."""

    at: int
    size: int
    ptr: int | None
    data: bytes | memoryview | None


class DeviceOps(Protocol):
    """The device memory operations of one instance's in-place batches."""

    device: str  # "cuda:N" (a test runs it on "cpu")
    device_id: int

    def build_input(self, t: pb.Tensor, sources: list[Source], padded: int) -> Any:
        """Batch input `t` on the device, each source copied in once, grown
        to `padded` rows (the last real row repeated) where that is more."""
        ...

    def run(self, feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        """The session on the device inputs; the outputs stay on the device."""
        ...

    def shape(self, name: str, out: Any) -> tuple[int, ...]: ...

    def nbytes(self, name: str, out: Any, rows: slice | None) -> int:
        """The bytes of `rows` of output `out` (None: all of it)."""
        ...

    def write(self, name: str, out: Any, rows: slice | None, ptr: int) -> None:
        """`rows` of `out` copied to device pointer `ptr` (device to device)."""
        ...

    def to_host(self, name: str, out: Any, rows: slice | None) -> np.ndarray:
        """`rows` of `out` in host memory, as the session's `run` gives them."""
        ...

    def synchronize(self) -> None:
        """Wait for the device: every copy into a client's region is done."""
        ...


def device_ops(session: TensorBackend) -> DeviceOps:
    """The device operations of `session`, or RegionNotLocal where it
    cannot take the in-place path (a CPU instance, a TensorRT-first ONNX
    Runtime session, ...). Each backend's module is imported only here: a
    worker that never gets a CUDA reference never loads them for it."""
    if hasattr(session, "run_device"):  # TorchScript
        from services.worker.device_torch import TorchDevice

        return TorchDevice(session)
    if hasattr(session, "run_on_device"):  # ONNX Runtime
        from services.worker.device_onnx import OnnxDevice

        return OnnxDevice(session)
    raise RegionNotLocal(f"a {type(session).__name__} instance has no in-place path")


class DeviceBatches:
    """Executes in-place batches of `spec` on one instance on a CUDA device."""

    def __init__(
        self,
        spec: ModelSpec,
        session: TensorBackend,
        host_tensor: HostTensor,
        handles: IpcHandles = HANDLES,
        ops: DeviceOps | None = None,
    ) -> None:
        self.spec = spec
        self.ops = ops if ops is not None else device_ops(session)
        self.host_tensor = host_tensor
        self.handles = handles

    def execute(
        self, request: pb.ExecuteRequest, pad_sizes: tuple[int, ...], wanted: list[str]
    ) -> pb.ExecuteResponse:
        t0 = time.monotonic_ns()
        real = sum(request.request_batch_sizes)
        padded = padded_size(real, pad_sizes)
        feeds = {t.name: self._input(t, padded) for t in request.inputs}
        t1 = time.monotonic_ns()
        results = self.ops.run(feeds, wanted)
        t2 = time.monotonic_ns()
        response = self._outputs(request, results)
        self.ops.synchronize()  # the client's memory holds the outputs now
        t3 = time.monotonic_ns()
        response.compute_input_ns = t1 - t0
        response.compute_infer_ns = t2 - t1
        response.compute_output_ns = t3 - t2
        return response

    def _input(self, t: pb.Tensor, padded: int) -> Any:
        dt = from_triton(t.datatype)
        parts = input_parts(t)
        if dt.item_size and sum(p.size for p in parts) != input_bytes(t, dt.item_size):
            raise BackendError(
                f"input '{t.name}' has {sum(p.size for p in parts)} bytes for shape "
                f"{list(t.shape)} of {t.datatype}"
            )
        return self.ops.build_input(t, [self._source(p.at, p.size, p.part) for p in parts], padded)

    def _source(self, at: int, size: int, part: pb.TensorPart) -> Source:
        if part.HasField("cuda"):
            if part.cuda.device_id != self.ops.device_id:
                raise RegionNotLocal(
                    f"a CUDA region on device {part.cuda.device_id} reached an instance on "
                    f"{self.ops.device}"
                )
            return Source(at, size, self.handles.pointer(part.cuda), None)
        # bytes of a request on the copy path batched with in-place ones
        return Source(at, size, None, part_bytes(part))

    def _outputs(self, request: pb.ExecuteRequest, results: dict[str, Any]) -> pb.ExecuteResponse:
        response = pb.ExecuteResponse()
        shm = tensor_shm.OWNER if request.shm_pids else None
        ops = self.ops
        for i, slots in enumerate(output_slots(request, self.spec)):
            per_request = response.results.add()
            to = (shm, shm.consumer(request, i)) if shm is not None else None
            for slot in slots:
                out = results[slot.name]
                target = slot.target
                if target is not None and fits_region(
                    ops.nbytes(slot.name, out, slot.rows), target, ops.device_id
                ):
                    ops.write(slot.name, out, slot.rows, self.handles.pointer(target))
                    shape = slot_shape(ops.shape(slot.name, out), slot.rows)
                    per_request.outputs.append(
                        written_tensor(self.spec, slot.name, shape, slot.batch)
                    )
                    continue
                host = ops.to_host(slot.name, out, slot.rows)
                per_request.outputs.append(
                    self.host_tensor(slot.name, host, self.spec, slot.batch, to)
                )
        return response
