"""A small ctypes binding of the CUDA runtime (libcudart) for CUDA IPC regions.

What Triton's CUDA shared-memory extension needs of CUDA, and no more: count
the devices, open a client's cudaIpcMemHandle_t on a device (and close it),
copy bytes between host and device, and the size of the allocation a pointer
lies in (cuMemGetAddressRange, from the driver library). No CUDA toolkit and
no Python CUDA package is needed: the runtime is found as a shared library.

Where it is looked for, first found wins (`candidates`): $CUDA_HOME (or
$CUDA_PATH) lib64/ and lib/; in every folder of the `nvidia` namespace
package, the nvidia-cuda-runtime-cu12 wheel's cuda_runtime/lib and the
cu<N>/lib folders CUDA 13 wheels use (torch's cu130 build brings
nvidia/cu13/lib/libcudart.so.13), the newest CUDA first; torch's bundled
lib/; then the plain sonames, newest first, through the loader's own
search. `available()` is False when no library loads or no
device answers (a host without a driver gets error 35, insufficient driver;
one with a driver but no GPU, 100, no device): callers then refuse as a
Triton build without GPU support does. The probe runs once per process, at
first use, so a process that never sees a CUDA region never loads CUDA.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
#: cudaIpcMemLazyEnablePeerAccess, what Triton opens handles with
_LAZY_ENABLE_PEER_ACCESS = 1
#: cudaMemcpyKind
H2D, D2H, D2D = 1, 2, 3
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_DRIVER = "libcuda.so.1"


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaError(Exception):
    """A CUDA runtime call that did not answer cudaSuccess."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call}: error {code} ({text})")
        self.call = call
        self.code = code
        self.text = text  # cudaGetErrorString's, what Triton's messages quote


def candidates(
    env: Mapping[str, str] = os.environ, nvidia: Sequence[Path] | None = None
) -> list[str]:
    """The libcudart files (or sonames) to try, in order. `nvidia`: the
    folders of the `nvidia` namespace package (None: where this Python finds
    them)."""
    found: list[str] = []
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        for sub in ("lib64", "lib"):
            found += _libraries(Path(home) / sub, "libcudart.so*")
    for folder in _package_dirs("nvidia") if nvidia is None else nvidia:
        found += nvidia_runtimes(folder)
    torch = _package_dirs("torch")
    if torch:  # some torch builds carry a renamed copy (libcudart-<hash>.so.12)
        found += _libraries(torch[0] / "lib", "libcudart*.so*")
    return found + list(_SONAMES)


def nvidia_runtimes(folder: Path) -> list[str]:
    """The libcudart files of one folder of the `nvidia` namespace package:
    cuda_runtime/lib (the CUDA 12 wheel), then cu<N>/lib, the highest N first."""
    found = _libraries(folder / "cuda_runtime" / "lib", "libcudart.so*")
    versions = [d for d in folder.glob("cu*") if d.name[2:].isdigit()] if folder.is_dir() else []
    for sub in sorted(versions, key=lambda d: -int(d.name[2:])):
        found += _libraries(sub / "lib", "libcudart.so*")
    return found


def _libraries(folder: Path, pattern: str) -> list[str]:
    """Shared objects in `folder`, the most specific version first (.so.12.4 before .so)."""
    if not folder.is_dir():
        return []
    return [str(p) for p in sorted(folder.glob(pattern), key=lambda p: (-len(p.name), p.name))]


def _package_dirs(name: str) -> list[Path]:
    """Where an installed package lies, every folder of a namespace package,
    without importing it (torch's import takes seconds)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def load(paths: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The first of `paths` that loads, with its path; (None, why) if none does."""
    errors: list[str] = []
    for path in paths:
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            errors.append(str(exc))
    return None, "no CUDA runtime library: " + "; ".join(errors[-2:])


def load_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or None on a machine without one."""
    try:
        return ctypes.CDLL(_DRIVER)
    except OSError:
        return None


class Runtime:
    """The calls of one loaded libcudart."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        self._sig("cudaGetDeviceCount", ctypes.POINTER(c_int))
        self._sig("cudaSetDevice", c_int)
        self._sig("cudaIpcOpenMemHandle", ctypes.POINTER(c_void_p), IpcHandle, ctypes.c_uint)
        self._sig("cudaIpcCloseMemHandle", c_void_p)
        self._sig("cudaIpcGetMemHandle", ctypes.POINTER(IpcHandle), c_void_p)
        self._sig("cudaMemcpy", c_void_p, c_void_p, c_size_t, c_int)
        self._sig("cudaDeviceSynchronize")
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._driver: ctypes.CDLL | None = None

    def _sig(self, name: str, *args: object) -> None:
        fn = getattr(self._lib, name)
        fn.argtypes = list(args)
        fn.restype = ctypes.c_int

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            text = self._lib.cudaGetErrorString(code)
            raise CudaError(call, code, text.decode() if text else "unknown error")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._check("cudaGetDeviceCount", self._lib.cudaGetDeviceCount(ctypes.byref(count)))
        return count.value

    def set_device(self, device: int) -> None:
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))

    def open_handle(self, raw: bytes, device: int) -> int:
        """The device pointer of another process's allocation, mapped on `device`."""
        if len(raw) != IPC_HANDLE_BYTES:
            raise ValueError(f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
        self.set_device(device)
        ptr = ctypes.c_void_p()
        handle = IpcHandle.from_buffer_copy(raw)
        code = self._lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS)
        self._check("cudaIpcOpenMemHandle", code)
        assert ptr.value is not None
        return ptr.value

    def close_handle(self, ptr: int, device: int) -> None:
        self.set_device(device)
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ptr))

    def get_handle(self, ptr: int) -> bytes:
        """The IPC handle of this process's allocation holding `ptr` (what a client sends)."""
        handle = IpcHandle()
        self._check("cudaIpcGetMemHandle", self._lib.cudaIpcGetMemHandle(handle, ptr))
        # bytes(handle), not handle.reserved: a c_char array field reads as a C
        # string and stops at the first NUL, and a real handle holds several.
        return bytes(handle)

    def to_host(self, ptr: int, byte_size: int, device: int) -> bytes:
        """`byte_size` bytes at device pointer `ptr` (D2H)."""
        self.set_device(device)
        buf = ctypes.create_string_buffer(byte_size)
        self._check("cudaMemcpy", self._lib.cudaMemcpy(buf, ptr, byte_size, D2H))
        return buf.raw

    def to_device(self, ptr: int, data: bytes, device: int) -> None:
        """`data` into device memory at `ptr` (H2D)."""
        self.set_device(device)
        self._check("cudaMemcpy", self._lib.cudaMemcpy(ptr, data, len(data), H2D))

    def copy(self, dst: int, src: int, nbytes: int, kind: int, device: int) -> None:
        """`nbytes` from `src` to `dst` (`kind`: H2D, D2H or D2D), on the
        legacy default stream: a D2D copy may still run when this returns
        (`synchronize` waits for it)."""
        self.set_device(device)
        self._check("cudaMemcpy", self._lib.cudaMemcpy(dst, src, nbytes, kind))

    def synchronize(self, device: int) -> None:
        """Wait for all of this process's work on `device`, every stream's."""
        self.set_device(device)
        self._check("cudaDeviceSynchronize", self._lib.cudaDeviceSynchronize())

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding `ptr`, in the current context
        (the driver's cuMemGetAddressRange_v2; Triton's register bound)."""
        if self._driver is None:
            drv = load_driver()
            if drv is None:
                raise CudaError("cuMemGetAddressRange", -1, f"{_DRIVER} does not load")
            drv.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
            drv.cuMemGetAddressRange_v2.restype = ctypes.c_int
            self._driver = drv
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        code = self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if code != 0:
            raise CudaError("cuMemGetAddressRange", code, "driver error")
        return base.value, size.value


@dataclass(frozen=True)
class Probe:
    """What this process found: a runtime with devices, or why not."""

    runtime: Runtime | None
    devices: int
    reason: str  # why unavailable; "" when available


def probe(paths: list[str] | None = None) -> Probe:
    """Load the runtime and ask it for devices (no context is created)."""
    lib, where = load(candidates() if paths is None else paths)
    if lib is None:
        return Probe(None, 0, where)
    runtime = Runtime(lib, where)
    try:
        count = runtime.device_count()
    except CudaError as exc:
        return Probe(None, 0, f"{where}: {exc}")
    if count == 0:
        return Probe(None, 0, f"{where}: no CUDA device")
    return Probe(runtime, count, "")


_probed: Probe | None = None
_lock = threading.Lock()


def state() -> Probe:
    """This process's probe, taken once."""
    global _probed
    with _lock:
        if _probed is None:
            _probed = probe()
        return _probed


def available() -> bool:
    return state().runtime is not None


def runtime() -> Runtime:
    """The loaded runtime; only after available() said True."""
    rt = state().runtime
    if rt is None:
        raise RuntimeError(f"CUDA is not available here: {state().reason}")
    return rt
