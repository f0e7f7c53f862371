"""stageserve/cuda_ipc.py without a GPU: where libcudart is looked for, what
loads, and that a host whose driver or device does not answer is unavailable
(so the gateway keeps refusing CUDA registers). The real runtime library is
used where this host has one; on a GPU host the same probe finds devices."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stageserve import cuda_ipc
from stageserve.gpus import gpu_count

SONAMES = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


def test_cuda_home_comes_first_lib64_before_lib_most_specific_first(tmp_path: Path) -> None:
    _touch(tmp_path / "lib64", "libcudart.so", "libcudart.so.12", "libcudart.so.12.4.127")
    _touch(tmp_path / "lib", "libcudart.so.12", "libcublas.so.12")
    found = cuda_ipc.candidates({"CUDA_HOME": str(tmp_path)})
    assert found[:4] == [
        str(tmp_path / "lib64/libcudart.so.12.4.127"),
        str(tmp_path / "lib64/libcudart.so.12"),
        str(tmp_path / "lib64/libcudart.so"),
        str(tmp_path / "lib/libcudart.so.12"),
    ]
    assert found[-3:] == SONAMES  # the loader's own search comes last


def test_cuda_path_stands_in_for_cuda_home(tmp_path: Path) -> None:
    _touch(tmp_path / "lib64", "libcudart.so.12")
    assert cuda_ipc.candidates({"CUDA_PATH": str(tmp_path)})[0] == str(
        tmp_path / "lib64/libcudart.so.12"
    )


def test_without_cuda_home_the_wheels_then_the_sonames(tmp_path: Path) -> None:
    found = cuda_ipc.candidates({"CUDA_HOME": str(tmp_path / "missing")})
    assert found[-3:] == SONAMES
    for path in found[:-3]:  # what is found before them lies in an installed wheel
        assert "/nvidia/" in path or "/torch/lib/" in path


def test_the_cuda13_wheel_layout_is_found_in_every_nvidia_folder(tmp_path: Path) -> None:
    # torch's cu130 build: site-packages/nvidia/cu13/lib/libcudart.so.13, no
    # nvidia.cuda_runtime; `nvidia` is a namespace package spread over folders
    first, second = tmp_path / "site-a" / "nvidia", tmp_path / "site-b" / "nvidia"
    _touch(first / "cu13" / "lib", "libcudart.so.13", "libcublas.so.13")
    _touch(first / "cublas" / "lib", "libcudart.so.12")  # not a runtime folder
    _touch(second / "cuda_runtime" / "lib", "libcudart.so.12")
    _touch(second / "cu12" / "lib", "libcudart.so.12")
    _touch(second / "cu13" / "lib", "libcudart.so.13")
    _touch(second / "cudnn" / "lib", "libcudnn.so.9")
    found = cuda_ipc.candidates({}, nvidia=[first, second])
    wheels = [p for p in found if p.startswith(str(tmp_path))]
    assert wheels == [
        str(first / "cu13/lib/libcudart.so.13"),
        str(second / "cuda_runtime/lib/libcudart.so.12"),
        str(second / "cu13/lib/libcudart.so.13"),
        str(second / "cu12/lib/libcudart.so.12"),
    ]
    assert found[: len(wheels)] == wheels  # before torch's lib/ and the sonames
    assert found[-3:] == SONAMES


def test_a_cuda_home_still_comes_before_the_wheels(tmp_path: Path) -> None:
    _touch(tmp_path / "home" / "lib64", "libcudart.so.13")
    _touch(tmp_path / "nvidia" / "cu13" / "lib", "libcudart.so.13")
    found = cuda_ipc.candidates({"CUDA_HOME": str(tmp_path / "home")}, nvidia=[tmp_path / "nvidia"])
    assert found[:2] == [
        str(tmp_path / "home/lib64/libcudart.so.13"),
        str(tmp_path / "nvidia/cu13/lib/libcudart.so.13"),
    ]


def test_the_first_path_that_loads_wins(tmp_path: Path) -> None:
    broken = tmp_path / "libcudart.so.12"
    broken.write_bytes(b"not an ELF object")
    libc = "libc.so.6"
    lib, where = cuda_ipc.load([str(broken), str(tmp_path / "absent.so"), libc])
    assert lib is not None and where == libc


def test_nothing_loading_says_why(tmp_path: Path) -> None:
    lib, why = cuda_ipc.load([str(tmp_path / "absent.so")])
    assert lib is None
    assert why.startswith("no CUDA runtime library: ") and "absent.so" in why


def _real_runtime() -> str:
    lib, where = cuda_ipc.load(cuda_ipc.candidates())
    if lib is None:
        pytest.skip("no libcudart on this host")
    return where


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU answers here")
def test_a_host_without_a_usable_gpu_is_unavailable_with_the_runtime_error() -> None:
    where = _real_runtime()
    found = cuda_ipc.probe([where])
    assert found.runtime is None and found.devices == 0
    # 35: a driver older than the runtime or none (this VM); 100: no device
    assert (
        "error 35" in found.reason
        or "error 100" in found.reason
        or "no CUDA device" in (found.reason)
    )
    assert found.reason.startswith(where)


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU answers here")
def test_runtime_calls_raise_the_runtime_error_without_a_device() -> None:
    where = _real_runtime()
    lib, _ = cuda_ipc.load([where])
    assert lib is not None
    rt = cuda_ipc.Runtime(lib, where)
    with pytest.raises(cuda_ipc.CudaError) as err:
        rt.open_handle(bytes(cuda_ipc.IPC_HANDLE_BYTES), 0)
    assert err.value.call == "cudaSetDevice" and err.value.code in (35, 100)
    with pytest.raises(ValueError, match="64 bytes, not 3"):
        rt.open_handle(b"abc", 0)


def test_a_renamed_copy_in_cuda_home_loads(tmp_path: Path) -> None:
    _real_runtime()
    maps = Path("/proc/self/maps").read_text().split()
    real = next(w for w in maps if "libcudart" in w and w.startswith("/"))
    (tmp_path / "lib64").mkdir()
    shutil.copy(real, tmp_path / "lib64/libcudart.so.12")
    paths = cuda_ipc.candidates({"CUDA_HOME": str(tmp_path)})
    lib, got = cuda_ipc.load(paths)
    assert lib is not None and got == str(tmp_path / "lib64/libcudart.so.12")


@pytest.mark.gpu
def test_a_gpu_host_is_available() -> None:
    if gpu_count() == 0:
        pytest.skip("no GPU")
    found = cuda_ipc.probe()
    assert found.runtime is not None, found.reason
    assert found.devices == gpu_count()
    assert cuda_ipc.available()


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU answers here")
def test_every_call_takes_the_arguments_the_binding_passes() -> None:
    """Each entry point is called with the Python values its method passes: the
    runtime answers its own error (no device), never a ctypes ArgumentError,
    so a signature mistake shows here and not first on a GPU host."""
    where = _real_runtime()
    lib, _ = cuda_ipc.load([where])
    assert lib is not None
    rt = cuda_ipc.Runtime(lib, where)
    raw = lib  # the CDLL with the signatures Runtime set
    ptr = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(16)
    codes = [
        raw.cudaSetDevice(0),
        raw.cudaIpcOpenMemHandle(ctypes.byref(ptr), cuda_ipc.IpcHandle(), 1),
        raw.cudaIpcCloseMemHandle(1 << 40),
        raw.cudaIpcGetMemHandle(cuda_ipc.IpcHandle(), 1 << 40),
        raw.cudaMemcpy(buf, 1 << 40, 16, cuda_ipc.D2H),
        raw.cudaMemcpy(1 << 40, b"0123456789abcdef", 16, cuda_ipc.H2D),
        raw.cudaMemcpy(1 << 40, 1 << 41, 16, cuda_ipc.D2D),
    ]
    assert all(code != 0 for code in codes)
    with pytest.raises(cuda_ipc.CudaError) as err:
        rt.get_handle(1 << 40)
    assert err.value.call == "cudaIpcGetMemHandle" and "error" in str(err.value)
    with pytest.raises(cuda_ipc.CudaError):
        rt.address_range(1 << 40)  # no driver, or no context: an error either way


def test_get_handle_returns_all_64_bytes_of_a_handle_holding_nul_bytes() -> None:
    """A real cudaIpcMemHandle_t holds NUL bytes (on an H100 the fourth byte
    of one was NUL): the handle a client sends must still be all 64 bytes."""
    handle = bytes([7, 1, 2, 0, 0, 9]) + bytes(range(58))
    calls: list[int] = []

    def get_mem_handle(out: Any, ptr: int) -> int:
        ctypes.memmove(ctypes.addressof(out), handle, len(handle))
        calls.append(ptr)
        return 0

    lib = SimpleNamespace(
        **{
            name: (lambda *a: 0)
            for name in (
                "cudaGetDeviceCount",
                "cudaSetDevice",
                "cudaIpcOpenMemHandle",
                "cudaIpcCloseMemHandle",
                "cudaMemcpy",
                "cudaDeviceSynchronize",
                "cudaGetErrorString",
            )
        }
    )
    lib.cudaIpcGetMemHandle = get_mem_handle
    rt = cuda_ipc.Runtime(lib, "fake")  # type: ignore[arg-type]
    assert rt.get_handle(1 << 40) == handle and calls == [1 << 40]
