"""One formed batch of a TorchScript instance on a CUDA device whose inputs
lie in, or whose outputs go to, clients' CUDA shared-memory regions: the
in-place path (services/worker/cuda_inplace.py opens the regions).

Each input is built on the instance's device: one device buffer the size of
the batch's input, each request's part copied into it once (device to
device from a client's region; host to device for a part that came as
bytes). The session runs on those tensors (TorchInstance.run_device). Each
output a request asked to have in a CUDA region is copied there device to
device; every other output comes back to host memory as on the copy path.
The batch waits for its device's work before answering, so the client's
memory holds the outputs when the gateway answers.

An instance that pads (batch_padding.py) pads on the device: the last real
row repeated, the padded rows cut off every output after the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from services.worker.backends import TensorBackend
from services.worker.batch_padding import padded_size
from services.worker.cuda_inplace import HANDLES, IpcHandles, device_bytes
from services.worker.torch_backend import TORCH_DTYPES
from stageserve import tensor_shm
from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import RegionNotLocal, part_bytes

#: (name, host array, spec, batch size or None, tensor-region target) -> the
#: output's message on the copy path (tensor_batches._tensor)
HostTensor = Callable[..., pb.Tensor]


def on_device(session: TensorBackend) -> bool:
    """Whether the session can take the in-place path: a TorchScript
    instance (run_device) on a CUDA device."""
    return hasattr(session, "run_device") and session.device.startswith("cuda")


class DeviceBatches:
    """Executes in-place batches of `spec` on one TorchScript instance."""

    def __init__(
        self,
        spec: ModelSpec,
        session: TensorBackend,
        host_tensor: HostTensor,
        handles: IpcHandles = HANDLES,
    ) -> None:
        if not on_device(session):
            raise RegionNotLocal(f"instance of '{spec.name}' runs on {session.device}")
        import torch  # the session is TorchScript: torch is loaded already

        self._torch: Any = torch
        self.spec = spec
        self.session: Any = session
        self.device = session.device
        self.device_id = int(self.device.partition(":")[2] or 0)
        self.host_tensor = host_tensor
        self.handles = handles

    def execute(
        self, request: pb.ExecuteRequest, pad_sizes: tuple[int, ...], wanted: list[str]
    ) -> pb.ExecuteResponse:
        torch = self._torch
        t0 = time.monotonic_ns()
        feeds = {t.name: self._input(t) for t in request.inputs}
        real = sum(request.request_batch_sizes)
        padded = padded_size(real, pad_sizes)
        if padded > real:
            feeds = {n: _pad(torch, x, padded) for n, x in feeds.items()}
        t1 = time.monotonic_ns()
        results = self.session.run_device(feeds, wanted)
        if padded > real:
            results = {n: r[:real] for n, r in results.items()}
        t2 = time.monotonic_ns()
        response = self._outputs(request, results)
        if self.device.startswith("cuda"):  # the client's memory holds the outputs now
            torch.cuda.synchronize(self.device)
        t3 = time.monotonic_ns()
        response.compute_input_ns = t1 - t0
        response.compute_infer_ns = t2 - t1
        response.compute_output_ns = t3 - t2
        return response

    def _input(self, t: pb.Tensor) -> Any:
        """The batch's input `t` as a tensor on the device, each part copied once."""
        torch = self._torch
        parts = list(t.parts) or [pb.TensorPart(raw=t.raw)]
        sizes = [p.cuda.byte_size if p.HasField("cuda") else _host_size(p) for p in parts]
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        at = 0
        for part, size in zip(parts, sizes, strict=True):
            if size:
                buf[at : at + size].copy_(self._source(part, size))
            at += size
        dtype = getattr(torch, TORCH_DTYPES[t.datatype])
        return buf.view(dtype).reshape(tuple(t.shape))

    def _source(self, part: pb.TensorPart, size: int) -> Any:
        torch = self._torch
        if part.HasField("cuda"):
            return device_bytes(torch, self.handles.pointer(part.cuda), size, self.device)
        # bytes of a request on the copy path batched with in-place ones
        return torch.frombuffer(bytearray(part_bytes(part)), dtype=torch.uint8)

    def _outputs(
        self, request: pb.ExecuteRequest, results: Mapping[str, Any]
    ) -> pb.ExecuteResponse:
        response = pb.ExecuteResponse()
        shm = tensor_shm.OWNER if request.shm_pids else None
        targets = [{o.name: o.extent for o in r.outputs} for r in request.cuda_outputs]
        offset = 0
        for i, (size, requested) in enumerate(
            zip(request.request_batch_sizes, request.requested, strict=True)
        ):
            names = list(requested.names) or [o.name for o in self.spec.outputs]
            per_request = response.results.add()
            to = (shm, shm.consumer(request, i)) if shm is not None else None
            mine = targets[i] if i < len(targets) else {}
            for name in names:
                arr = results[name]
                if self.spec.batching:
                    arr = arr[offset : offset + size]
                written = self._write(name, arr, mine[name], size) if name in mine else None
                if written is None:
                    host = _numpy(self._torch, arr, self.session.output_types[name].triton)
                    written = self.host_tensor(name, host, self.spec, size, to)
                per_request.outputs.append(written)
            offset += size
        return response

    def _write(self, name: str, arr: Any, ext: pb.CudaExtent, batch: int) -> pb.Tensor | None:
        """One request's output copied into the client's region (device to
        device); None when the region is too small (the copy path answers
        Triton's size error) or on another device."""
        torch = self._torch
        flat = arr.contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() > ext.byte_size or ext.device_id != self.device_id:
            return None
        if flat.numel():
            device_bytes(torch, self.handles.pointer(ext), flat.numel(), self.device).copy_(flat)
        out = self.spec.output_tensor(name)
        assert out is not None
        shape = tuple(arr.shape)
        if out.reshape is not None:  # the model's shape -> the config's dims
            shape = ((batch,) if self.spec.batching else ()) + out.dims
        return pb.Tensor(
            name=name, datatype=out.datatype.triton, shape=list(shape), device_written=True
        )


def _host_size(part: pb.TensorPart) -> int:
    return part.length if part.region else len(part.raw)


def _pad(torch: Any, x: Any, rows: int) -> Any:
    """`x` grown to `rows` rows, the last real row repeated (batch_padding's rule)."""
    extra = x[-1:].expand(rows - x.shape[0], *x.shape[1:])
    return torch.cat([x, extra])


def _numpy(torch: Any, t: Any, triton: str) -> np.ndarray:
    """A device output in host memory, as TorchInstance.run gives it."""
    host = t.detach().cpu().contiguous()
    if triton == "BF16":
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()
