"""The worker's side of the CUDA in-place path: clients' CUDA shared-memory
regions opened in this process, and torch views of their memory.

A batch may carry references to a client's device allocation
(pb.CudaExtent: the cudaIpcMemHandle_t, an offset, a byte size, a device)
instead of bytes, and ask for outputs to be written there
(ExecuteRequest.cuda_outputs); the gateway chose this path
(services/gateway/cuda_inplace.py). Each handle is opened once in this
process (cudaIpcOpenMemHandle through stageserve/cuda_ipc.py) and kept for
the next batch; one unused for IDLE_CLOSE_S is closed. The client's own
process exported the handle and the gateway's open is another process's, so
opening it here is allowed (a process cannot open a handle it exported).

A worker that cannot open a handle (no CUDA here, another device, a handle
that does not open) raises tensor_shm.RegionNotLocal: the batch is refused
TENSOR_REGION_NOT_LOCAL and the gateway resends it with the bytes, as for a
tensor region this worker cannot map.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stageserve import cuda_ipc
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import RegionNotLocal

log = logging.getLogger(__name__)

#: a handle no batch used for this long is closed (a client's unregister is
#: not seen here; this bounds how long its allocation stays mapped)
IDLE_CLOSE_S = 60.0


def wanted(request: pb.ExecuteRequest) -> bool:
    """Whether the batch reads or writes a client's CUDA region in place."""
    if request.cuda_outputs:
        return True
    return any(p.HasField("cuda") for t in request.inputs for p in t.parts)


def _probed_runtime() -> cuda_ipc.Runtime | None:
    return cuda_ipc.state().runtime


@dataclass
class _Opened:
    ptr: int
    used: float


class IpcHandles:
    """The clients' handles this process opened, by (handle, device)."""

    def __init__(
        self,
        runtime: Callable[[], cuda_ipc.Runtime | None] = _probed_runtime,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = IDLE_CLOSE_S,
    ) -> None:
        self._runtime = runtime
        self._clock = clock
        self._idle_s = idle_s
        self._open: dict[tuple[bytes, int], _Opened] = {}
        self._lock = threading.Lock()

    def pointer(self, ext: pb.CudaExtent) -> int:
        """The device pointer of `ext`'s first byte, its handle opened once."""
        key = (bytes(ext.raw_handle), int(ext.device_id))
        now = self._clock()
        with self._lock:
            opened = self._open.get(key)
            if opened is None:
                opened = self._open[key] = _Opened(self._open_handle(*key), now)
            opened.used = now
            self._close_idle(now)
        return opened.ptr + int(ext.offset)

    def _open_handle(self, raw: bytes, device: int) -> int:
        rt = self._runtime()
        if rt is None:
            raise RegionNotLocal("CUDA is not available in this worker")
        try:
            return rt.open_handle(raw, device)
        except (cuda_ipc.CudaError, ValueError) as exc:
            raise RegionNotLocal(f"this worker cannot open the CUDA IPC handle: {exc}") from None

    def _close_idle(self, now: float) -> None:
        for key, opened in list(self._open.items()):
            if now - opened.used > self._idle_s:
                del self._open[key]
                self._close(opened.ptr, key[1])

    def _close(self, ptr: int, device: int) -> None:
        rt = self._runtime()
        if rt is None:
            return
        try:
            rt.close_handle(ptr, device)
        except cuda_ipc.CudaError as exc:  # the mapping stays; nothing else to do
            log.warning("closing a client's CUDA IPC handle failed", extra={"error": str(exc)})

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def close_all(self) -> None:
        with self._lock:
            for (_, device), opened in self._open.items():
                self._close(opened.ptr, device)
            self._open.clear()


#: this worker process's opened handles
HANDLES = IpcHandles()


class DeviceMemory:
    """Raw device memory as an object torch (or any CUDA Array Interface
    consumer) takes without copying: `nbytes` bytes at `ptr`."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the caller orders its work on its own stream
        }


def device_bytes(torch: Any, ptr: int, nbytes: int, device: str) -> Any:
    """A torch uint8 tensor over `nbytes` of device memory at `ptr` (a view,
    no copy); on `device` or RegionNotLocal. torch finds the memory's device
    itself: asked for a device, it would copy there instead, and an output
    written into that copy would never reach the client."""
    try:
        view = torch.as_tensor(DeviceMemory(ptr, nbytes))
    except (RuntimeError, TypeError, ValueError) as exc:  # torch does not take this memory
        raise RegionNotLocal(f"torch cannot use the client's CUDA memory: {exc}") from None
    if str(view.device) != device:
        raise RegionNotLocal(f"a CUDA region on {view.device} reached an instance on {device}")
    return view
