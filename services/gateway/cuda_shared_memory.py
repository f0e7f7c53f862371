"""Triton's CUDA shared-memory extension on a server that opens no CUDA IPC handle.

StageServe's gateway never maps GPU memory, so no CUDA region can be registered:
register is refused with the answer Triton 2.51 gives when it cannot open the
handle (INVALID_ARGUMENT "failed to register shared memory region: invalid
args"; checked against the 2.51 wheel on a machine without a GPU). Status and
unregister succeed on any build, as in Triton: the status of all regions is
empty, of a named one NOT_FOUND, and unregistering nothing is no error.
Triton's own client examples unregister every CUDA region before they start,
so these two must answer even where CUDA is never used.
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any, NoReturn

from stageserve.errors import invalid, not_found

log = logging.getLogger(__name__)

#: sizeof(cudaIpcMemHandle_t): what Triton's HTTP front requires raw_handle to decode to
IPC_HANDLE_BYTES = 64


def status(name: str) -> list[Any]:
    """The registered regions (always none); NOT_FOUND for a named one."""
    if name:
        raise not_found(f"Unable to find cuda shared memory region: '{name}'")
    return []


def unregister(name: str) -> None:
    """One region or all: there is never one, which is no error (as Triton)."""


def register(name: str, device_id: int) -> NoReturn:
    log.warning(
        "CUDA shared memory register refused: this server opens no CUDA IPC handle; "
        "use system shared memory",
        extra={"region": name, "device_id": device_id},
    )
    raise invalid("failed to register shared memory region: invalid args")


def check_http_register(doc: Any) -> int:
    """The device id of an HTTP register body, after Triton's checks of its
    `raw_handle` ({"b64": ...} decoding to a cudaIpcMemHandle_t)."""
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
    return device if isinstance(device, int) else 0
