"""The in-place path's device memory operations for a TorchScript instance
on a CUDA device (device_batches.DeviceOps): torch tensors on the device.

A client's region is a torch view of its memory (cuda_inplace.device_bytes,
no copy); copies into and out of it are torch copies on the current stream,
the one forward() runs on, so they are ordered with the run by the stream
itself and `synchronize` waits for the last of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.worker.backends import TensorBackend
from services.worker.cuda_inplace import device_bytes
from services.worker.device_batches import Source
from services.worker.torch_backend import TORCH_DTYPES
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import RegionNotLocal


class TorchDevice:
    """DeviceOps of one TorchInstance (its run_device) on a CUDA device."""

    def __init__(self, session: TensorBackend) -> None:
        if not session.device.startswith("cuda"):
            raise RegionNotLocal(f"the instance runs on {session.device}")
        import torch  # the session is TorchScript: torch is loaded already

        self._torch: Any = torch
        self.session: Any = session
        self.device = session.device
        self.device_id = int(self.device.partition(":")[2] or 0)

    def build_input(self, t: pb.Tensor, sources: list[Source], padded: int) -> Any:
        torch = self._torch
        if t.datatype not in TORCH_DTYPES:
            raise RegionNotLocal(f"a {t.datatype} input has no in-place path")
        buf = torch.empty(sum(s.size for s in sources), dtype=torch.uint8, device=self.device)
        for s in sources:
            buf[s.at : s.at + s.size].copy_(self._source(s))
        x = buf.view(getattr(torch, TORCH_DTYPES[t.datatype])).reshape(tuple(t.shape))
        if padded > x.shape[0]:  # the last real row repeated (batch_padding's rule)
            x = torch.cat([x, x[-1:].expand(padded - x.shape[0], *x.shape[1:])])
        return x

    def _source(self, s: Source) -> Any:
        if s.ptr is not None:
            return device_bytes(self._torch, s.ptr, s.size, self.device)
        assert s.data is not None
        return self._torch.frombuffer(bytearray(s.data), dtype=self._torch.uint8)

    def run(self, feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        return self.session.run_device(feeds, wanted)

    def shape(self, name: str, out: Any) -> tuple[int, ...]:
        return tuple(out.shape)

    def nbytes(self, name: str, out: Any, rows: slice | None) -> int:
        part = out if rows is None else out[rows]
        return int(part.numel()) * int(part.element_size())

    def write(self, name: str, out: Any, rows: slice | None, ptr: int) -> None:
        part = out if rows is None else out[rows]
        flat = part.contiguous().reshape(-1).view(self._torch.uint8)
        if flat.numel():
            device_bytes(self._torch, ptr, flat.numel(), self.device).copy_(flat)

    def to_host(self, name: str, out: Any, rows: slice | None) -> np.ndarray:
        """As TorchInstance.run gives it (BF16: the uint16 words)."""
        torch = self._torch
        host = (out if rows is None else out[rows]).detach().cpu().contiguous()
        if self.session.output_types[name].triton == "BF16":
            return host.view(torch.int16).numpy().view(np.uint16)
        return host.numpy()

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            self._torch.cuda.synchronize(self.device)
