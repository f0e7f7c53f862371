"""How a worker's thread waits for its GPU: CUDA's scheduling flag of the
device's primary context, the context ONNX Runtime's CUDA EP and PyTorch share.

CUDA's default (`auto`) spins the waiting thread on its core while there are
no more CUDA contexts than cores, which is always the case for a worker. On the
H100 host a batch of 32 CNN images through ONNX Runtime's CUDA EP cost the
worker 238 us of CPU per request, most of it inside the stream synchronisation
at the end of each run (py-spy, docs/benchmarks.md "On an H100 host"): CPU the
stages in front of the GPU need on the same host. `blocking` makes the thread
sleep on an OS primitive until the GPU signals, `yield` makes it yield its core
between polls. The flag must be set before the context is created, so the
worker sets it at start, before any model loads.

The default stays CUDA's own until a GPU host has measured the others
(bench.gpu with STAGESERVE_WORKER_CUDA_SYNC set; docs/gpu.md).

Only the driver library (libcuda.so.1, present wherever an NVIDIA driver is)
is used: it is the same context whichever CUDA runtime a backend links.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from stageserve.cuda_ipc import load_driver

log = logging.getLogger(__name__)

#: CU_CTX_SCHED_* of the driver API (cuda.h)
SCHEDULE_FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}
_SCHEDULE_MASK = 0x07


class CudaDriverError(RuntimeError):
    """A driver call answered an error code."""


def schedule_flags(mode: str) -> int:
    """The CU_CTX_SCHED_* value of a mode; ValueError names the choices."""
    try:
        return SCHEDULE_FLAGS[mode]
    except KeyError:
        choices = ", ".join(SCHEDULE_FLAGS)
        raise ValueError(f"cuda_sync must be one of {choices}, not {mode!r}") from None


def apply(
    mode: str, device: int | None, driver: Callable[[], ctypes.CDLL | None] = load_driver
) -> str:
    """Set `device`'s primary-context scheduling flag to `mode`; what was done,
    in words, for the worker's log. `auto`, no device, or no driver: nothing."""
    flags = schedule_flags(mode)
    if mode == "auto" or device is None:
        return "CUDA's default"
    lib = driver()
    if lib is None:
        return "not set: no libcuda.so.1 on this host"
    try:
        _set_primary_flags(lib, device, flags)
    except CudaDriverError as exc:
        log.warning("CUDA sync mode not set", extra={"mode": mode, "error": str(exc)})
        return f"not set: {exc}"
    return f"{mode} on cuda:{device}"


def primary_flags(lib: ctypes.CDLL, device: int) -> tuple[int, bool]:
    """The scheduling flag of `device`'s primary context and whether it is active."""
    dev = _device(lib, device)
    flags, active = ctypes.c_uint(0), ctypes.c_int(0)
    _check(lib, "cuDevicePrimaryCtxGetState", dev, ctypes.byref(flags), ctypes.byref(active))
    return flags.value & _SCHEDULE_MASK, bool(active.value)


def _set_primary_flags(lib: ctypes.CDLL, device: int, flags: int) -> None:
    dev = _device(lib, device)
    # The _v2 entry point may be called while the context is active (CUDA 11+).
    name = (
        "cuDevicePrimaryCtxSetFlags_v2"
        if hasattr(lib, "cuDevicePrimaryCtxSetFlags_v2")
        else "cuDevicePrimaryCtxSetFlags"
    )
    _check(lib, name, dev, ctypes.c_uint(flags))


def _device(lib: ctypes.CDLL, ordinal: int) -> ctypes.c_int:
    _check(lib, "cuInit", ctypes.c_uint(0))
    dev = ctypes.c_int(0)
    _check(lib, "cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
    return dev


def _check(lib: ctypes.CDLL, name: str, *args: object) -> None:
    code = int(getattr(lib, name)(*args))
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(text))
        what = text.value.decode() if text.value else f"error {code}"
        raise CudaDriverError(f"{name}: {what}")
