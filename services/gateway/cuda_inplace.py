"""The gateway's side of the CUDA in-place path: a request's CUDA shared-memory
tensors travel to the worker as references (the client's cudaIpcMemHandle_t,
the offset, the byte size, the device), not as bytes, when that worker can
use the region directly.

Eligible (`model_eligible`, `in_place_devices`, `extent`; all pure):
- a TorchScript model, or an ONNX Runtime model without the TensorRT
  accelerator (its CUDA execution provider takes OrtValues in device memory
  through IO binding), whose worker builds the batch on the device; that is
  not a sequence, ensemble or decoupled model, has no ragged input,
  batch_input or batch_output, and no response cache (the cache keeps bytes);
- every instance of the model runs on a worker of this gateway's host (the
  host check tensor_shm uses) and on one CUDA device, the region's;
- a fixed-size datatype (BYTES keeps the copy path);
- an untraced request (a trace with tensors records bytes).
Anything else keeps the gateway's copy path (cuda_shared_memory.py: a
device-to-host read of each input, a host-to-device write of each output).

A worker that cannot open the handle (or whose instance is not on that
device after all) refuses the batch TENSOR_REGION_NOT_LOCAL, as a worker
that cannot map a tensor region does; `to_host` then turns the references
back into bytes read here, and the request is sent once more.
stageserve_cuda_shm_copies_total{direction="d2d"} counts the tensors a
worker read or wrote in place.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.gateway.shared_memory import CUDA, Region, SharedMemory
from stageserve.config import ONNX_PLATFORM, PYTORCH_PLATFORM, ModelSpec
from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import CUDA_SHM_COPIES
from stageserve.validation import SharedRef, ValidatedRequest

_D2D = CUDA_SHM_COPIES.labels("d2d")

#: the platforms whose workers build batches on the device from a reference
PLATFORMS = frozenset({PYTORCH_PLATFORM, ONNX_PLATFORM})
#: the accelerator whose ONNX Runtime sessions keep the copy path (their
#: worker refuses the references: the in-place path is the CUDA EP's)
TENSORRT = "tensorrt"


def model_eligible(spec: ModelSpec) -> bool:
    """What of the model allows the in-place path, whatever its placement."""
    return (
        spec.platform in PLATFORMS
        and spec.sequence is None
        and not spec.steps
        and not spec.decoupled
        and not spec.response_cache
        and not spec.batch_inputs
        and not spec.batch_outputs
        and not spec.ragged_inputs
        and not any(a.name == TENSORRT for a in spec.gpu_accelerators)
    )


def in_place_devices(
    host: str, instances: Iterable[pb.InstanceInfo], hosts: dict[str, str]
) -> dict[str, int]:
    """model -> the CUDA device its every instance runs on, for the models
    whose instances all run on workers of `host` (`hosts`: worker id -> its
    host id) and all on one CUDA device."""
    devices: dict[str, set[int]] = {}
    for i in instances:
        on_gpu = i.kind == "KIND_GPU" and i.device_id >= 0
        here = hosts.get(i.worker_id) == host
        devices.setdefault(i.model, set()).add(i.device_id if on_gpu and here else -1)
    return {m: d.pop() for m, d in devices.items() if len(d) == 1 and -1 not in d}


def usable_in_place(region: Region, device: int, datatype: str) -> bool:
    """Whether a worker on `device` uses a tensor of `region` in place: a CUDA
    region on that device, a fixed-size datatype (else the copy path)."""
    return region.kind == CUDA and region.device_id == device and datatype != "BYTES"


def extent(region: Region, ref: SharedRef, device: int, datatype: str) -> pb.CudaExtent | None:
    """The reference a worker on `device` reads `ref` through, or None when
    the tensor keeps the copy path (a system region, another device, BYTES)."""
    if not usable_in_place(region, device, datatype):
        return None
    region.check(ref.offset, ref.byte_size)  # Triton's bounds, as a read checks them
    return pb.CudaExtent(
        raw_handle=region.raw_handle,
        offset=ref.offset,
        byte_size=ref.byte_size,
        device_id=device,
    )


class InPlace:
    """One request's in-place references: the regions its input references
    name are held (not unregistered under the worker) until `release`."""

    def __init__(self, shm: SharedMemory, device: int) -> None:
        self.shm = shm
        self.device = device
        self._held: list[Region] = []
        self._by_handle: dict[bytes, Region] = {}

    def takes(self, ref: SharedRef, datatype: str) -> bool:
        """Whether input_part will take the input (no bytes to read for it);
        False for a region that is not registered (the read answers that)."""
        try:
            region = self.shm.acquire(ref.region)
        except StageError:
            return False
        try:
            return usable_in_place(region, self.device, datatype)
        finally:
            self.shm.release(region)

    def input_part(self, ref: SharedRef, datatype: str) -> pb.TensorPart | None:
        """validation.InPlace: the input as a reference, or None (bytes)."""
        region = self.shm.acquire(ref.region)
        try:
            found = extent(region, ref, self.device, datatype)
        except BaseException:
            self.shm.release(region)
            raise
        if found is None:
            self.shm.release(region)
            return None
        self._held.append(region)
        self._by_handle[region.raw_handle] = region
        return pb.TensorPart(length=ref.byte_size, cuda=found)

    def outputs(
        self, spec: ModelSpec, validated: ValidatedRequest, held: dict[str, Region]
    ) -> list[pb.CudaOutput]:
        """The requested outputs the worker writes into their CUDA regions
        (`held`: each shared-memory output's region, acquired by the caller)."""
        out = []
        for name, ref in validated.shared_outputs.items():
            declared = spec.output(name)
            datatype = declared.datatype.triton if declared is not None else "BYTES"
            found = extent(held[name], ref, self.device, datatype)
            if found is not None:
                self._by_handle[held[name].raw_handle] = held[name]
                out.append(pb.CudaOutput(name=name, extent=found))
        return out

    def to_host(self, request: pb.ScheduleRequest) -> None:
        """A request a worker refused (TENSOR_REGION_NOT_LOCAL) made ready to
        resend: each CUDA reference replaced by its bytes (a device-to-host
        copy here, counted d2h), no output written by the worker."""
        for t in request.inputs:
            for part in t.parts:
                if part.HasField("cuda"):
                    ext = part.cuda
                    part.raw = self._by_handle[ext.raw_handle].read(ext.offset, ext.byte_size)
                    part.ClearField("cuda")
        request.ClearField("cuda_outputs")

    def release(self) -> None:
        for region in self._held:
            self.shm.release(region)
        self._held.clear()


def count(request: pb.ScheduleRequest, outputs: Iterable[pb.Tensor]) -> None:
    """Count the tensors a worker read or wrote in place for an answered request."""
    used = sum(1 for t in request.inputs for p in t.parts if p.HasField("cuda"))
    used += sum(1 for t in outputs if t.device_written)
    if used:
        _D2D.inc(used)
