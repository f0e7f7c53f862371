"""services/gateway/shared_memory.py on real POSIX shm objects in /dev/shm:
Triton's register / status / unregister rules, bounds, deferred unmapping, and
the one table system and CUDA regions share (names unique across kinds)."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator

import grpc
import pytest

from services.gateway.cuda_shared_memory import CudaWindow
from services.gateway.shared_memory import CUDA, SHM_ROOT, SYSTEM, SharedMemory
from stageserve import cuda_ipc
from stageserve.errors import StageError, http_status


@pytest.fixture
def shm_key() -> Iterator[str]:
    """A 3-page shm object holding bytes 0..255 repeated."""
    key = f"/stageserve-test-{uuid.uuid4().hex}"
    path = SHM_ROOT / key[1:]
    path.write_bytes(bytes(range(256)) * (3 * mmap.PAGESIZE // 256))
    yield key
    path.unlink(missing_ok=True)


def _code(exc: pytest.ExceptionInfo[StageError]) -> grpc.StatusCode:
    return exc.value.code


def test_register_read_write_status_unregister(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 16, 64)
    (status,) = shm.status()
    assert (status.name, status.key, status.offset, status.byte_size) == ("r", shm_key, 16, 64)
    region = shm.acquire("r")
    assert region.read(0, 4) == bytes([16, 17, 18, 19])
    region.write(4, b"\xff\xfe")
    shm.release(region)
    with open(SHM_ROOT / shm_key[1:], "rb") as f:  # the client sees the write
        assert f.read(22)[20:22] == b"\xff\xfe"
    shm.unregister("r")
    assert shm.status() == []


def test_an_unaligned_offset_past_the_first_page_maps(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, mmap.PAGESIZE + 3, 8)
    region = shm.acquire("r")
    assert region.read(0, 2) == bytes([3, 4])
    shm.release(region)


def test_registering_a_name_twice_is_already_exists(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    with pytest.raises(StageError, match="already in manager") as exc:
        shm.register("r", shm_key, 8, 8)
    assert _code(exc) == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("key", ["/no-such-stageserve-region", "", "/", "/a/b"])
def test_a_key_that_does_not_open_is_internal(key: str) -> None:
    with pytest.raises(StageError, match="Unable to open shared memory region") as exc:
        SharedMemory().register("r", key, 0, 8)
    assert _code(exc) == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    "offset, size", [(0, 3 * mmap.PAGESIZE + 1), (3 * mmap.PAGESIZE, 1), (8, 0)]
)
def test_a_window_outside_the_object_is_invalid(shm_key: str, offset: int, size: int) -> None:
    with pytest.raises(StageError, match="failed to register shared memory region 'r'") as exc:
        SharedMemory().register("r", shm_key, offset, size)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT


def test_status_of_an_unknown_region_is_not_found() -> None:
    with pytest.raises(StageError, match="Unable to find system shared memory region") as exc:
        SharedMemory().status("ghost")
    assert _code(exc) == grpc.StatusCode.NOT_FOUND


def test_using_an_unknown_region_is_not_found() -> None:
    with pytest.raises(StageError, match="Unable to find shared memory region: 'ghost'") as exc:
        SharedMemory().acquire("ghost")
    assert _code(exc) == grpc.StatusCode.NOT_FOUND


def test_reads_and_writes_stay_inside_the_region(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 16)
    region = shm.acquire("r")
    with pytest.raises(StageError, match="Invalid offset for") as exc:
        region.read(16, 1)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(StageError, match="Invalid offset \\+ byte size"):
        region.read(8, 9)
    with pytest.raises(StageError, match="Invalid offset \\+ byte size"):
        region.write(10, b"x" * 7)
    assert region.read(8, 8) == bytes(range(8, 16))


def test_unregister_of_unknown_is_fine_and_empty_name_means_all(shm_key: str) -> None:
    shm = SharedMemory()
    shm.unregister("ghost")
    shm.register("a", shm_key, 0, 8)
    shm.register("b", shm_key, 8, 8)
    shm.unregister()
    assert shm.status() == []


def test_a_region_in_use_is_unmapped_only_when_released(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    region = shm.acquire("r")
    shm.unregister("r")
    assert region.read(0, 2) == b"\x00\x01"  # the in-flight request still reads it
    with pytest.raises(StageError):
        shm.acquire("r")  # but no new request finds it
    shm.release(region)
    with pytest.raises(OSError):
        region.read(0, 1)  # closed now
    os.stat(SHM_ROOT / shm_key[1:])  # the client's object itself is untouched


def test_a_threads_copies_read_and_write_what_the_mapping_holds(shm_key: str) -> None:
    """read_in_thread / write_in_thread (pread / pwrite of the object) at an
    offset off the page, across a page boundary, as read / write see it."""
    shm = SharedMemory()
    shm.register("r", shm_key, mmap.PAGESIZE - 5, 64)
    region = shm.acquire("r")
    assert region.read_in_thread(0, 64) == region.read(0, 64)
    region.write_in_thread(3, b"\xff" * 10)
    assert region.read(0, 16) == region.read_in_thread(0, 16)
    assert region.read(3, 10) == b"\xff" * 10
    shm.release(region)
    with open(SHM_ROOT / shm_key[1:], "rb") as f:  # the client sees the write
        f.seek(mmap.PAGESIZE - 2)
        assert f.read(11) == b"\xff" * 10 + bytes([(mmap.PAGESIZE + 8) % 256])


def test_a_threads_copies_stay_inside_the_region(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 16)
    region = shm.acquire("r")
    with pytest.raises(StageError, match="Invalid offset for") as exc:
        region.read_in_thread(16, 1)
    assert _code(exc) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(StageError, match="Invalid offset \\+ byte size"):
        region.read_in_thread(8, 9)
    with pytest.raises(StageError, match="Invalid offset \\+ byte size"):
        region.write_in_thread(10, b"x" * 7)


def test_an_object_shrunk_since_register_reads_short_in_a_thread(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 2 * mmap.PAGESIZE)
    os.truncate(SHM_ROOT / shm_key[1:], mmap.PAGESIZE + 4)
    region = shm.acquire("r")
    assert region.read_in_thread(mmap.PAGESIZE, 16) == bytes(range(4))
    shm.release(region)


def test_closing_a_system_region_closes_its_descriptors(shm_key: str) -> None:
    before = set(os.listdir("/proc/self/fd"))
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    assert set(os.listdir("/proc/self/fd")) > before  # kept for the copies in a thread
    with pytest.raises(StageError, match="invalid args"):  # a refused register keeps none
        shm.register("big", shm_key, 0, 4 * mmap.PAGESIZE)
    shm.unregister("r")
    assert set(os.listdir("/proc/self/fd")) == before


# ------------------------------------------- one table for system and CUDA regions

HANDLE = bytes(range(64))  # a cudaIpcMemHandle_t's size; opens nowhere


def test_a_cuda_register_of_a_system_name_is_already_exists_before_any_cuda(
    shm_key: str,
) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    with pytest.raises(StageError, match="shared memory region 'r' already in manager") as exc:
        shm.register_cuda("r", HANDLE, 0, 8)
    assert _code(exc) == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.skipif(cuda_ipc.available(), reason="CUDA answers here")
def test_without_cuda_a_cuda_register_is_refused_and_leaves_nothing() -> None:
    shm = SharedMemory()
    with pytest.raises(StageError) as exc:
        shm.register_cuda("c", HANDLE, 0, 8)
    assert (_code(exc), exc.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "failed to register shared memory region: invalid args",
    )
    assert shm.status(kind=CUDA) == []
    shm.unregister(kind=CUDA)  # status and unregister still answer, as Triton's


def test_status_of_a_region_of_the_other_kind_says_which_it_is(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    assert shm.status(kind=CUDA) == []  # all of a kind lists that kind only
    with pytest.raises(StageError) as exc:
        shm.status("r", CUDA)
    assert (_code(exc), exc.value.message) == (
        grpc.StatusCode.NOT_FOUND,
        "The region named 'r' is registered as system shared memory, not CUDA shared memory",
    )
    with pytest.raises(StageError, match="Unable to find cuda shared memory region: 'x'"):
        shm.status("x", CUDA)


def test_unregistering_the_other_kind_leaves_a_region(shm_key: str) -> None:
    shm = SharedMemory()
    shm.register("r", shm_key, 0, 8)
    shm.unregister("r", CUDA)
    shm.unregister(kind=CUDA)
    assert [r.name for r in shm.status()] == ["r"]
    region = shm.acquire("r")  # a request finds a region whatever its kind
    assert region.kind == SYSTEM and region.read(0, 1) == b"\x00"
    shm.release(region)


# ------------------------------------ a CUDA handle whose close fails (Triton keeps it)


class _FailingClose(cuda_ipc.Runtime):
    """A runtime whose cudaIpcCloseMemHandle answers an error (no GPU here:
    nothing else of it is called by register, status and unregister)."""

    def __init__(self) -> None:
        self.path = "fake"
        self.closes = 0
        self.fail = True

    def close_handle(self, ptr: int, device: int) -> None:
        self.closes += 1
        if self.fail:
            raise cuda_ipc.CudaError("cudaIpcCloseMemHandle", 400, "invalid resource handle")


def _cuda_table(runtime: cuda_ipc.Runtime) -> SharedMemory:
    def opener(name: str, raw: bytes, device_id: int, byte_size: int) -> CudaWindow:
        return CudaWindow(runtime, 0x7F0000000000, device_id)

    return SharedMemory(open_cuda=opener)


def test_a_failing_close_keeps_the_region_and_answers_tritons_internal() -> None:
    runtime = _FailingClose()
    shm = _cuda_table(runtime)
    shm.register_cuda("c", HANDLE, 0, 64)
    with pytest.raises(StageError) as exc:
        shm.unregister("c", CUDA)
    assert (_code(exc), exc.value.message) == (
        grpc.StatusCode.INTERNAL,
        "failed to close CUDA IPC handle: invalid resource handle",
    )
    assert http_status(exc.value.reason) == 500  # the HTTP front's status for it
    assert [(r.name, r.byte_size) for r in shm.status(kind=CUDA)] == [("c", 64)]
    region = shm.acquire("c")  # still usable by requests
    shm.release(region)
    runtime.fail = False
    shm.unregister("c", CUDA)  # a close that succeeds later drops it
    assert shm.status(kind=CUDA) == [] and runtime.closes == 2


def test_unregister_all_drops_what_closes_and_lists_what_stays(shm_key: str) -> None:
    failing, fine = _FailingClose(), _FailingClose()
    fine.fail = False
    runtimes = iter([failing, fine, failing])

    def opener(name: str, raw: bytes, device_id: int, byte_size: int) -> CudaWindow:
        return CudaWindow(next(runtimes), 0x7F0000000000, device_id)

    shm = SharedMemory(open_cuda=opener)
    shm.register("sys", shm_key, 0, 8)
    for name in ("a", "b", "c"):
        shm.register_cuda(name, HANDLE, 0, 64)
    with pytest.raises(StageError) as exc:
        shm.unregister(kind=CUDA)
    assert (_code(exc), exc.value.message) == (
        grpc.StatusCode.INTERNAL,
        "Failed to unregister the following cuda shared memory regions: a ,c ,",
    )
    assert sorted(r.name for r in shm.status(kind=CUDA)) == ["a", "c"]
    assert [r.name for r in shm.status()] == ["sys"]  # the other kind untouched


def test_a_deferred_close_that_fails_is_logged_not_raised() -> None:
    shm = _cuda_table(_FailingClose())
    shm.register_cuda("c", HANDLE, 0, 64)
    region = shm.acquire("c")
    shm.unregister("c", CUDA)  # in use: leaves the table, closed at release
    assert shm.status(kind=CUDA) == []
    shm.release(region)  # the close fails: nobody to answer, so it is logged
