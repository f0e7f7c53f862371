"""DataPlane.infer's shared-memory copies: a request's large ones run on the
copy threads while the event loop goes on, small ones stay on the loop, a
region stays open while a thread copies it (unregister, a cancelled request),
and the answers are those of the copies on the loop.

The scheduler is the one stand-in (it answers as an identity model would);
the regions are the gateway's own table, over real shm objects in /dev/shm or,
to see which thread copies and to hold a copy in flight, a window injected as
a CUDA region's (SharedMemory's opener)."""

from __future__ import annotations

import asyncio
import mmap
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from services.gateway.dataplane import DataPlane
from services.gateway.model_table import READY, ModelEntry, ModelTable
from services.gateway.shared_memory import CUDA, SHM_ROOT, SharedMemory
from stageserve.config import parse_config_text, to_spec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc
from stageserve.generated import stageserve_pb2 as pb

SPEC = to_spec(
    parse_config_text(
        """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_UINT8 dims: [ -1 ] } ]
"""
    )
)
THRESHOLD = 1 << 20
LARGE = 2 * THRESHOLD
HANDLE = bytes(64)
WAIT_S = 30  # only how long a broken build takes to fail, never a figure the test checks


class _Identity:
    """The scheduler's answer for an identity model: OUTPUT0 is INPUT0."""

    async def schedule(self, request: pb.ScheduleRequest, on_more: Any = None) -> Any:
        (t,) = request.inputs
        return pb.ScheduleResponse(
            outputs=[pb.Tensor(name="OUTPUT0", datatype=t.datatype, shape=t.shape, raw=t.raw)]
        )


@pytest.fixture
def dataplane() -> Iterator[Callable[..., DataPlane]]:
    """DataPlane(threshold, regions, copy threads) for the identity model "m",
    each closed at the end."""
    made: list[DataPlane] = []

    def make(
        threshold: int = THRESHOLD, shm: SharedMemory | None = None, threads: int = 4
    ) -> DataPlane:
        models = ModelTable()
        config = mc.ModelConfig(name="m")
        models.entries["m"] = ModelEntry("m", {1: READY}, config=config, spec=SPEC)
        dp = DataPlane(
            models,
            cast(Any, None),
            cast(Any, _Identity()),
            shm_copy_thread_bytes=threshold,
            shm_copy_threads=threads,
        )
        if shm is not None:
            dp.shm = shm
        made.append(dp)
        return dp

    yield make
    for dp in made:
        dp.overrides.close()


def _request(nbytes: int, region: str = "in", offset: int = 0) -> gs.ModelInferRequest:
    r = gs.ModelInferRequest(model_name="m", id="r1")
    t = r.inputs.add(name="INPUT0", datatype="UINT8", shape=[nbytes])
    t.parameters["shared_memory_region"].string_param = region
    t.parameters["shared_memory_offset"].int64_param = offset
    t.parameters["shared_memory_byte_size"].int64_param = nbytes
    return r


def _output_into(r: gs.ModelInferRequest, region: str, nbytes: int, offset: int = 0) -> None:
    out = r.outputs.add(name="OUTPUT0")
    out.parameters["shared_memory_region"].string_param = region
    out.parameters["shared_memory_offset"].int64_param = offset
    out.parameters["shared_memory_byte_size"].int64_param = nbytes


# ------------------------------------------------------- which thread copies


@dataclass
class _Memory:
    """A region's memory in host bytes that records the thread of each copy;
    with `hold`, a copy made in a thread waits until `go` is set."""

    data: bytearray
    hold: bool = False
    copies: list[tuple[str, str]] = field(default_factory=list)  # (copy, thread name)
    copying: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)

    def read(self, begin: int, byte_size: int) -> bytes:
        self._record("read")
        return bytes(self.data[begin : begin + byte_size])

    def write(self, begin: int, data: bytes) -> None:
        self._record("write")
        self.data[begin : begin + len(data)] = data

    def read_in_thread(self, begin: int, byte_size: int) -> bytes:
        self._record("read_in_thread")
        self._wait_for_go()
        return bytes(self.data[begin : begin + byte_size])

    def write_in_thread(self, begin: int, data: bytes) -> None:
        self._record("write_in_thread")
        self._wait_for_go()
        self.data[begin : begin + len(data)] = data

    def close(self) -> None:
        self.closed.set()

    def _record(self, copy: str) -> None:
        self.copies.append((copy, threading.current_thread().name))

    def _wait_for_go(self) -> None:
        if self.hold:
            self.copying.set()
            if not self.go.wait(WAIT_S):
                raise RuntimeError("the event loop did not run while a copy was in flight")


def _table(**memories: _Memory) -> SharedMemory:
    def opener(name: str, raw: bytes, device_id: int, byte_size: int) -> _Memory:
        return memories[name]

    shm = SharedMemory(open_cuda=opener)
    for name, memory in memories.items():
        shm.register_cuda(name, HANDLE, 0, len(memory.data))
    return shm


def _pattern(nbytes: int) -> bytearray:
    return bytearray(np.arange(nbytes, dtype=np.uint32).astype(np.uint8).tobytes())


async def _while_copying(memory: _Memory, infer: Any, during: Any = None) -> Any:
    """Run `infer`; once its copy is in flight, `during()` on the loop, then
    let the copy finish. A copy made on the loop never lets this run: it then
    fails (RuntimeError) instead of waiting on its own."""
    task = asyncio.ensure_future(infer)
    await asyncio.to_thread(memory.copying.wait, WAIT_S)
    assert memory.copying.is_set()
    if during is not None:
        during()
    memory.go.set()
    return await task


def test_a_large_input_is_read_on_a_copy_thread_while_the_loop_runs(
    dataplane: Callable[..., DataPlane],
) -> None:
    memory = _Memory(_pattern(LARGE), hold=True)
    dp = dataplane(shm=_table(gpu=memory))
    loop_thread: list[str] = []

    async def run() -> gs.ModelInferResponse:
        loop_thread.append(threading.current_thread().name)
        return await _while_copying(memory, dp.infer(_request(LARGE, "gpu")))

    response = asyncio.run(run())
    assert response.raw_output_contents[0] == memory.data
    ((copy, thread),) = memory.copies
    assert copy == "read_in_thread" and thread.startswith("shm-copy")
    assert thread != loop_thread[0]


def test_a_large_output_is_written_on_a_copy_thread_while_the_loop_runs(
    dataplane: Callable[..., DataPlane],
) -> None:
    source = _Memory(_pattern(LARGE))
    target = _Memory(bytearray(LARGE), hold=True)
    dp = dataplane(shm=_table(gpu=source, out=target))
    r = _request(LARGE, "gpu")
    _output_into(r, "out", LARGE)

    response = asyncio.run(_while_copying(target, dp.infer(r)))
    assert list(response.raw_output_contents) == [b""]  # as Triton: the bytes are in the region
    assert target.data == source.data
    assert [copy for copy, _ in source.copies + target.copies] == [
        "read_in_thread",
        "write_in_thread",
    ]
    assert all(thread.startswith("shm-copy") for _, thread in source.copies + target.copies)


def test_small_copies_stay_on_the_loop(dataplane: Callable[..., DataPlane]) -> None:
    source = _Memory(_pattern(64))
    target = _Memory(bytearray(64))
    dp = dataplane(shm=_table(gpu=source, out=target))
    r = _request(64, "gpu")
    _output_into(r, "out", 64)
    loop_thread: list[str] = []

    async def run() -> gs.ModelInferResponse:
        loop_thread.append(threading.current_thread().name)
        return await dp.infer(r)

    asyncio.run(run())
    assert target.data == source.data
    assert source.copies + target.copies == [("read", loop_thread[0]), ("write", loop_thread[0])]


def test_a_region_unregistered_while_a_thread_reads_it_closes_after_the_read(
    dataplane: Callable[..., DataPlane],
) -> None:
    memory = _Memory(_pattern(LARGE), hold=True)
    dp = dataplane(shm=_table(gpu=memory))

    def unregister() -> None:
        dp.shm.unregister("gpu", CUDA)
        assert not memory.closed.is_set()  # the copy thread holds it

    response = asyncio.run(_while_copying(memory, dp.infer(_request(LARGE, "gpu")), unregister))
    assert response.raw_output_contents[0] == memory.data
    assert memory.closed.is_set()
    assert dp.shm.status(kind=CUDA) == []


def test_a_request_cancelled_while_its_output_is_written_leaves_the_region_open_until_done(
    dataplane: Callable[..., DataPlane],
) -> None:
    source = _Memory(_pattern(LARGE))
    target = _Memory(bytearray(LARGE), hold=True)
    dp = dataplane(shm=_table(gpu=source, out=target))
    r = _request(LARGE, "gpu")
    _output_into(r, "out", LARGE)

    async def run() -> None:
        task = asyncio.ensure_future(dp.infer(r))
        await asyncio.to_thread(target.copying.wait, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        dp.shm.unregister("out", CUDA)  # the request's own hold is gone, the copy's is not
        assert not target.closed.is_set()
        target.go.set()
        assert await asyncio.to_thread(target.closed.wait, WAIT_S)

    asyncio.run(run())
    assert target.data == source.data  # the copy ran to its end


def test_a_request_cancelled_before_its_copy_starts_still_has_the_copy_release_the_region(
    dataplane: Callable[..., DataPlane],
) -> None:
    blocker = _Memory(_pattern(LARGE), hold=True)
    target = _Memory(bytearray(LARGE))
    dp = dataplane(shm=_table(gpu=blocker, out=target), threads=1)
    raw_in = gs.ModelInferRequest(model_name="m")
    raw_in.inputs.add(name="INPUT0", datatype="UINT8", shape=[LARGE])
    raw_in.raw_input_contents.append(bytes(_pattern(LARGE)))
    _output_into(raw_in, "out", LARGE)
    (out,) = dp.shm.status("out", CUDA)

    async def run() -> None:
        first = asyncio.ensure_future(dp.infer(_request(LARGE, "gpu")))
        await asyncio.to_thread(blocker.copying.wait, WAIT_S)  # the one copy thread is busy
        second = asyncio.ensure_future(dp.infer(raw_in))
        for _ in range(10_000):  # until its write is queued: the request's hold and the copy's
            await asyncio.sleep(0)
            if out.users == 2:
                break
        assert out.users == 2
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        dp.shm.unregister("out", CUDA)
        assert not target.closed.is_set()
        blocker.go.set()
        await first
        assert await asyncio.to_thread(target.closed.wait, WAIT_S)

    asyncio.run(run())
    assert target.data == _pattern(LARGE)  # the queued copy ran, then released the region


# ------------------------------------------------- real system regions, same answers


@pytest.fixture
def regions() -> Iterator[SharedMemory]:
    """System regions 'in' (bytes 0..255 repeated, LARGE + a page) and 'out'
    (zeros, LARGE) on real shm objects."""
    keys = [f"/stageserve-test-{uuid.uuid4().hex}" for _ in range(2)]
    size = LARGE + mmap.PAGESIZE
    (SHM_ROOT / keys[0][1:]).write_bytes(bytes(range(256)) * (size // 256))
    (SHM_ROOT / keys[1][1:]).write_bytes(bytes(LARGE))
    shm = SharedMemory()
    shm.register("in", keys[0], 0, size)
    shm.register("out", keys[1], 0, LARGE)
    yield shm
    shm.unregister()
    for key in keys:
        (SHM_ROOT / key[1:]).unlink(missing_ok=True)


@pytest.mark.parametrize("threshold", [THRESHOLD, 1 << 40], ids=["in a thread", "on the loop"])
def test_large_tensors_through_system_regions(
    dataplane: Callable[..., DataPlane], regions: SharedMemory, threshold: int
) -> None:
    dp = dataplane(threshold, regions)
    r = _request(LARGE, offset=3)  # an offset off the page: pread and the slice agree
    _output_into(r, "out", LARGE)
    response = asyncio.run(dp.infer(r))
    assert list(response.raw_output_contents) == [b""]
    (out,) = regions.status("out")
    written = out.read(0, LARGE)
    assert written == (bytes(range(3, 256)) + bytes(range(256)) * (LARGE // 256))[:LARGE]


def _failing_requests() -> dict[str, gs.ModelInferRequest]:
    past_the_end = _request(LARGE, offset=LARGE + mmap.PAGESIZE)
    window_past = _request(LARGE, offset=mmap.PAGESIZE + 1)
    small_output = _request(LARGE)
    _output_into(small_output, "out", LARGE - 1)
    output_past = _request(LARGE)
    _output_into(output_past, "out", LARGE, offset=1)
    return {
        "unknown region": _request(LARGE, region="gone"),
        "offset past the region": past_the_end,
        "window past the region": window_past,
        "output larger than its window": small_output,
        "output window past the region": output_past,
    }


@pytest.mark.parametrize("case", list(_failing_requests()))
def test_copies_in_a_thread_fail_as_copies_on_the_loop(
    dataplane: Callable[..., DataPlane], regions: SharedMemory, case: str
) -> None:
    answers = []
    for threshold in (THRESHOLD, 1 << 40):
        dp = dataplane(threshold, regions)
        with pytest.raises(StageError) as exc:
            asyncio.run(dp.infer(_failing_requests()[case]))
        answers.append((exc.value.code, exc.value.message))
    assert answers[0] == answers[1]
