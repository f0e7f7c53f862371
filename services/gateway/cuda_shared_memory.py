"""Triton's CUDA shared-memory extension: a client's device allocation, opened
from its cudaIpcMemHandle_t, as the memory behind a region (shared_memory.py
keeps the table of regions of both kinds).

Register opens the handle on the region's device (stageserve/cuda_ipc.py) and
keeps the pointer; unregister closes it. The gateway reads an input out of
the region with a device-to-host copy and writes an output into it with a
host-to-device copy after the answer arrives: the request otherwise travels
as any other (stageserve_cuda_shm_copies_total counts the copies). Where the
model's worker can use the region on its device, the tensors travel as
references instead and the worker copies device to device (cuda_inplace.py).

Where CUDA is unavailable (no runtime library, no driver, no device) register
is refused with the answer a Triton GPU build gives when it cannot open the
handle: INVALID_ARGUMENT "failed to register shared memory region: invalid
args" (checked against the 2.51 wheel on a machine without a GPU). So are a
handle that does not open, a device id out of range and a handle of the wrong
length (Triton logs the CUDA error and answers the same generic message). A
byte size past the end of the allocation is refused as Triton's
CheckCudaSharedMemoryRegionSize does, naming the region. Status and
unregister succeed on any host, as Triton's do; a handle whose close fails
keeps its region registered and the unregister answers Triton's INTERNAL
(shared_memory.py).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from stageserve import cuda_ipc
from stageserve.errors import StageError, internal, invalid
from stageserve.telemetry import CUDA_SHM_COPIES

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = cuda_ipc.IPC_HANDLE_BYTES
#: Triton's answer to a handle it cannot open (and ours where CUDA is unavailable)
REFUSED = "failed to register shared memory region: invalid args"

_D2H = CUDA_SHM_COPIES.labels("d2h")
_H2D = CUDA_SHM_COPIES.labels("h2d")


@dataclass
class CudaWindow:
    """A CUDA region's bytes: the opened allocation on its device."""

    runtime: cuda_ipc.Runtime
    ptr: int
    device_id: int

    def read(self, begin: int, byte_size: int) -> bytes:
        data = self.runtime.to_host(self.ptr + begin, byte_size, self.device_id)
        _D2H.inc()
        return data

    def write(self, begin: int, data: bytes) -> None:
        self.runtime.to_device(self.ptr + begin, data, self.device_id)
        _H2D.inc()

    # A worker thread's copies are the same calls: ctypes releases the GIL for
    # the cudaMemcpy. A read's host buffer (its zeroing, then its copy into
    # bytes: cuda_ipc.Runtime.to_host) still holds it.
    read_in_thread = read
    write_in_thread = write

    def close(self) -> None:
        """Close the handle; a failing close is Triton's INTERNAL "failed to
        close CUDA IPC handle: <CUDA's error string>" (the caller keeps the
        region registered, as Triton does)."""
        try:
            self.runtime.close_handle(self.ptr, self.device_id)
        except cuda_ipc.CudaError as exc:
            log.error("failed to close CUDA IPC handle", extra={"error": str(exc)})
            raise internal(f"failed to close CUDA IPC handle: {exc.text}") from None


def refusal(raw_handle: bytes, device_id: int, devices: int) -> str:
    """Why a register is refused before any CUDA call ("" when it may go on):
    no device, a device id out of range, a handle of the wrong length."""
    if devices == 0:
        return "CUDA is not available on this host"
    if not 0 <= device_id < devices:
        return f"device {device_id} is out of range: this host has {devices} CUDA devices"
    if len(raw_handle) != IPC_HANDLE_BYTES:
        return f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes, this one {len(raw_handle)}"
    return ""


def check_fits(name: str, byte_size: int, ptr: int, base: int, size: int) -> None:
    """Triton's register bound: `byte_size` bytes from the opened pointer must
    lie inside the allocation [base, base + size)."""
    if byte_size < 0 or ptr + byte_size > base + size:
        raise invalid(f"failed to register shared memory region '{name}': invalid args")


def open_window(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaWindow:
    """Open the client's handle on `device_id`, or refuse with Triton's answer."""
    state = cuda_ipc.state()
    why = refusal(raw_handle, device_id, state.devices)
    if why or state.runtime is None:
        _log_refusal(name, device_id, why + (f" ({state.reason})" if state.reason else ""))
        raise invalid(REFUSED)
    runtime = state.runtime
    try:
        ptr = runtime.open_handle(raw_handle, device_id)
    except cuda_ipc.CudaError as exc:
        _log_refusal(name, device_id, f"failed to open CUDA IPC handle: {exc}")
        raise invalid(REFUSED) from None
    window = CudaWindow(runtime, ptr, device_id)
    try:
        base, size = runtime.address_range(ptr)
        check_fits(name, byte_size, ptr, base, size)
    except (cuda_ipc.CudaError, StageError) as exc:
        with contextlib.suppress(StageError):  # logged by close(); the register is refused
            window.close()
        _log_refusal(name, device_id, str(exc))
        raise invalid(f"failed to register shared memory region '{name}': invalid args") from None
    return window


def _log_refusal(name: str, device_id: int, why: str) -> None:
    log.warning(
        "CUDA shared memory register refused",
        extra={"region": name, "device_id": device_id, "reason": why},
    )


def check_http_register(doc: Any) -> tuple[bytes, int, int]:
    """(raw handle, device id, byte size) of an HTTP register body, after
    Triton's checks of its `raw_handle` ({"b64": ...} decoding to a
    cudaIpcMemHandle_t)."""
    if not isinstance(doc, dict) or "raw_handle" not in doc:
        raise invalid("Shared memory register request has no 'raw_handle' field")
    handle = doc["raw_handle"]
    b64 = handle.get("b64") if isinstance(handle, dict) else None
    try:
        raw = base64.b64decode(b64, validate=True) if isinstance(b64, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != IPC_HANDLE_BYTES:
        raise invalid("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    device = doc.get("device_id", 0)
    size = doc.get("byte_size", 0)
    return raw, device if isinstance(device, int) else 0, size if isinstance(size, int) else 0
