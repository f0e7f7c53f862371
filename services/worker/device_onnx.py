"""The in-place path's device memory operations for an ONNX Runtime instance
whose session runs the CUDA execution provider on a CUDA device
(device_batches.DeviceOps): OrtValues in the device's memory, bound to the
session through IO binding, never going through host memory.

- A batch input is one OrtValue ORT allocates on the device
  (OrtValue.ortvalue_from_shape_and_type, already the padded shape); each
  request's part is copied to its place in it with cudaMemcpy
  (stageserve/cuda_ipc.py) at OrtValue.data_ptr(): device to device from a
  client's region, host to device for a part that came as bytes. Padded
  rows are copies of the last real row, device to device
  (device_layout.pad_copies).
- The run binds those OrtValues as inputs and the outputs to the device
  (OnnxInstance.run_on_device); ORT allocates the outputs there.
- An output asked for in a client's region is copied there device to
  device from its rows of the output; any other comes back to host memory
  (device to host) as OnnxInstance.run gives it.

Ordering: the copies run on CUDA's legacy default stream, ORT's CUDA EP on
streams of its own that need not wait for it. So the device is synchronized
(cudaDeviceSynchronize: every stream of this process on it) after the input
copies, before the run; again after the run, before the outputs are read;
and once the outputs are in the clients' regions, before the answer.

Anything that fails before the run (no CUDA runtime here, an allocation or
copy that fails, a BYTES tensor: strings never live on the device) raises
tensor_shm.RegionNotLocal: the gateway resends the batch with the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from services.worker.backends import BackendError, TensorBackend
from services.worker.device_batches import Source
from services.worker.device_layout import pad_copies, slot_bytes, slot_shape
from stageserve import cuda_ipc
from stageserve.cuda_ipc import D2D, D2H, H2D, CudaError
from stageserve.datatypes import DataType
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import RegionNotLocal


class Copier(Protocol):
    """The CUDA runtime calls the path makes (cuda_ipc.Runtime's)."""

    def copy(self, dst: int, src: int, nbytes: int, kind: int, device: int) -> None: ...

    def synchronize(self, device: int) -> None: ...


def _probed_runtime() -> Copier | None:
    return cuda_ipc.state().runtime


def element_type(dt: DataType) -> Any:
    """What OrtValue.ortvalue_from_shape_and_type takes for `dt`: its numpy
    dtype, or for BF16 (no numpy dtype) ONNX's element type number."""
    return dt.onnx if dt.triton == "BF16" else dt.numpy


class OnnxDevice:
    """DeviceOps of one OnnxInstance on a CUDA device. `ort_device`: where
    ORT allocates ("cuda"; a test passes "cpu" with a host-memory copier)."""

    def __init__(
        self,
        session: TensorBackend,
        runtime: Callable[[], Copier | None] = _probed_runtime,
        ort_device: str = "cuda",
    ) -> None:
        instance: Any = session
        device_id = instance.in_place_device()
        if device_id is None:
            raise RegionNotLocal(
                f"the ONNX Runtime instance on {session.device} has no in-place path "
                f"(providers {instance.providers})"
            )
        rt = runtime()
        if rt is None:
            raise RegionNotLocal("CUDA is not available in this worker")
        self.session: Any = session
        self.device = f"cuda:{device_id}"
        self.device_id = device_id
        self.ort_device = ort_device
        self._rt = rt

    def build_input(self, t: pb.Tensor, sources: list[Source], padded: int) -> Any:
        dt = self.session.input_types.get(t.name)
        if dt is None or dt.triton == "BYTES" or dt.triton != t.datatype:
            raise RegionNotLocal(f"input '{t.name}' ({t.datatype}) has no in-place path")
        shape = list(t.shape)
        real = shape[0] if shape else 0
        if padded > real and real == 0:
            raise RegionNotLocal(f"input '{t.name}' of shape {shape} cannot be padded")
        if padded > real:
            shape[0] = padded
        try:
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, element_type(dt), self.ort_device, self.device_id
            )
            base = value.data_ptr()
            for s in sources:
                self._copy_in(base + s.at, s)
            row = math.prod(shape[1:]) * dt.item_size
            for dst, src, n in pad_copies(real, padded, row):
                self._rt.copy(base + dst, base + src, n, D2D, self.device_id)
        except RegionNotLocal:
            raise
        except Exception as exc:  # ORT's or CUDA's: the gateway resends the bytes
            raise RegionNotLocal(f"input '{t.name}' not built on {self.device}: {exc}") from None
        return value

    def _copy_in(self, dst: int, s: Source) -> None:
        if s.ptr is not None:
            self._rt.copy(dst, s.ptr, s.size, D2D, self.device_id)
            return
        assert s.data is not None
        host = np.frombuffer(s.data, dtype=np.uint8)  # no copy; cudaMemcpy reads it
        self._rt.copy(dst, host.ctypes.data, s.size, H2D, self.device_id)

    def run(self, feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        strings = [n for n in wanted if self.session.output_types[n].triton == "BYTES"]
        if strings:
            raise RegionNotLocal(f"BYTES output(s) {strings} have no in-place path")
        try:
            self._rt.synchronize(self.device_id)  # the input copies are done
        except CudaError as exc:
            raise RegionNotLocal(f"{self.device}: {exc}") from None
        outputs = self.session.run_on_device(feeds, wanted, self.ort_device, self.device_id)
        self.synchronize()  # the outputs are complete for the copies out
        return outputs

    def shape(self, name: str, out: Any) -> tuple[int, ...]:
        return tuple(out.shape())

    def nbytes(self, name: str, out: Any, rows: slice | None) -> int:
        return slot_bytes(self.shape(name, out), rows, self._item_size(name))[1]

    def write(self, name: str, out: Any, rows: slice | None, ptr: int) -> None:
        start, n = slot_bytes(self.shape(name, out), rows, self._item_size(name))
        if n:
            self._copy(ptr, out.data_ptr() + start, n, D2D)

    def to_host(self, name: str, out: Any, rows: slice | None) -> np.ndarray:
        """As OnnxInstance.run gives it: the configured dtype (BF16: uint16 words)."""
        dt = self.session.output_types[name]
        shape = self.shape(name, out)
        host = np.empty(slot_shape(shape, rows), dtype=dt.numpy)
        start, n = slot_bytes(shape, rows, dt.item_size)
        if n:
            self._copy(host.ctypes.data, out.data_ptr() + start, n, D2H)
        return host

    def synchronize(self) -> None:
        try:
            self._rt.synchronize(self.device_id)
        except CudaError as exc:
            raise BackendError(f"{self.device}: {exc}") from None

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        try:
            self._rt.copy(dst, src, nbytes, kind, self.device_id)
        except CudaError as exc:
            raise BackendError(f"copying an output on {self.device}: {exc}") from None

    def _item_size(self, name: str) -> int:
        return int(self.session.output_types[name].item_size)
