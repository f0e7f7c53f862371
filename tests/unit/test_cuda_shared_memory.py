"""services/gateway/cuda_shared_memory.py's decisions that need no GPU: what
is refused before any CUDA call, Triton's register bound, the HTTP body, and
the refusal on a host where CUDA is unavailable (this VM: the runtime loads,
the driver answers error 35)."""

from __future__ import annotations

import base64

import grpc
import pytest

from services.gateway import cuda_shared_memory as cshm
from stageserve import cuda_ipc
from stageserve.errors import StageError

HANDLE = bytes(range(64))


def test_refusals_before_any_cuda_call() -> None:
    assert cshm.refusal(HANDLE, 0, 0) == "CUDA is not available on this host"
    assert cshm.refusal(HANDLE, 1, 1) == "device 1 is out of range: this host has 1 CUDA devices"
    assert cshm.refusal(HANDLE, -1, 2).startswith("device -1 is out of range")
    assert cshm.refusal(HANDLE[:10], 0, 1) == "a cudaIpcMemHandle_t is 64 bytes, this one 10"
    assert cshm.refusal(HANDLE, 1, 2) == ""


@pytest.mark.parametrize(
    "byte_size, ptr, base, size, fits",
    [
        (1024, 4096, 4096, 1024, True),  # the whole allocation
        (1025, 4096, 4096, 1024, False),  # one byte past it
        (0, 4096, 4096, 1024, True),  # Triton registers an empty window
        (512, 4608, 4096, 1024, True),  # a pointer inside the allocation: what is left
        (513, 4608, 4096, 1024, False),
    ],
)
def test_the_register_bound_is_the_allocation(
    byte_size: int, ptr: int, base: int, size: int, fits: bool
) -> None:
    if fits:
        cshm.check_fits("r", byte_size, ptr, base, size)
        return
    with pytest.raises(StageError) as exc:
        cshm.check_fits("r", byte_size, ptr, base, size)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.message == "failed to register shared memory region 'r': invalid args"


def test_the_http_body_gives_handle_device_and_size() -> None:
    doc = {"raw_handle": {"b64": base64.b64encode(HANDLE).decode()}, "device_id": 1}
    assert cshm.check_http_register({**doc, "byte_size": 64}) == (HANDLE, 1, 64)
    assert cshm.check_http_register({"raw_handle": doc["raw_handle"]}) == (HANDLE, 0, 0)
    with pytest.raises(StageError, match="has no 'raw_handle' field"):
        cshm.check_http_register({"device_id": 0})
    with pytest.raises(StageError, match="must be a valid base64 encoded cudaIpcMemHandle_t"):
        cshm.check_http_register({"raw_handle": {"b64": "YWJjZA=="}})


@pytest.mark.skipif(cuda_ipc.available(), reason="CUDA answers here")
def test_without_cuda_register_is_refused_with_tritons_message() -> None:
    with pytest.raises(StageError) as exc:
        cshm.open_window("r", HANDLE, 0, 16)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        exc.value.message
        == cshm.REFUSED
        == ("failed to register shared memory region: invalid args")
    )
