"""The CUDA in-place path's decisions, without a GPU: which models, instances,
regions and tensors take it (services/gateway/cuda_inplace.py), how a
reference travels (validation, the scheduler's ExecuteRequest), the resend
with bytes, and the worker's handle cache (services/worker/cuda_inplace.py)
over a runtime that opens nothing real."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from services.gateway import cuda_inplace as gw
from services.gateway.shared_memory import CUDA, SYSTEM, Region, SharedMemory
from services.scheduler.batch_strategy import Queued
from services.scheduler.execute_request import build_execute_request
from services.worker import cuda_inplace as wk
from stageserve import cuda_ipc, tensor_shm
from stageserve.config import ModelSpec, parse_config_text, to_spec
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import CUDA_SHM_COPIES
from stageserve.validation import SharedRef, validate_infer

HANDLE = bytes(range(64))
CONFIG = """
name: "m"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
SPEC = to_spec(parse_config_text(CONFIG))


def _spec(extra: str = "", platform: str = "pytorch_libtorch") -> ModelSpec:
    text = CONFIG.replace("pytorch_libtorch", platform) + extra
    return to_spec(parse_config_text(text))


# ------------------------------------------------------------- which models


def test_a_plain_torchscript_model_is_eligible() -> None:
    assert gw.model_eligible(SPEC)


def test_a_plain_onnx_runtime_model_is_eligible() -> None:
    assert gw.model_eligible(_spec(platform="onnxruntime_onnx"))
    assert gw.model_eligible(_spec(TENSORRT.replace("tensorrt", "cuda"), "onnxruntime_onnx"))


TENSORRT = (
    "optimization { execution_accelerators { gpu_execution_accelerator : "
    '[ { name : "tensorrt" } ] } }'
)
RAGGED = 'input [ { name: "R" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]'
BATCH_INPUT = (
    'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 '
    'source_input: "INPUT__0" } ]'
)


@pytest.mark.parametrize(
    "extra, platform",
    [
        (TENSORRT, "onnxruntime_onnx"),  # the in-place path is the CUDA EP's
        ("response_cache { enable: true }", "pytorch_libtorch"),
        ("response_cache { enable: true }", "onnxruntime_onnx"),
        ("sequence_batching { }", "pytorch_libtorch"),
        ("sequence_batching { }", "onnxruntime_onnx"),
        (RAGGED, "onnxruntime_onnx"),
        (BATCH_INPUT, "onnxruntime_onnx"),
    ],
)
def test_other_models_keep_the_copy_path(extra: str, platform: str) -> None:
    assert not gw.model_eligible(_spec(extra, platform))


def _instance(model: str, worker: str, kind: str, device: int) -> pb.InstanceInfo:
    return pb.InstanceInfo(model=model, worker_id=worker, kind=kind, device_id=device)


def test_a_model_all_on_one_device_of_this_host_gets_that_device() -> None:
    hosts = {"w0": "here", "w1": "here", "far": "there"}
    instances = [
        _instance("gpu0", "w0", "KIND_GPU", 0),
        _instance("gpu0", "w1", "KIND_GPU", 0),
        _instance("cpu", "w0", "KIND_CPU", -1),
        _instance("split", "w0", "KIND_GPU", 0),
        _instance("split", "w1", "KIND_GPU", 1),  # two devices: which one is unknown
        _instance("mixed", "w0", "KIND_GPU", 0),
        _instance("mixed", "w0", "KIND_CPU", -1),
        _instance("remote", "far", "KIND_GPU", 0),
        _instance("gpu1", "w1", "KIND_GPU", 1),
    ]
    assert gw.in_place_devices("here", instances, hosts) == {"gpu0": 0, "gpu1": 1}
    assert gw.in_place_devices("there", instances, hosts) == {"remote": 0}
    assert gw.in_place_devices("elsewhere", instances, hosts) == {}


# ------------------------------------------------------------- which regions


@dataclass
class _Memory:
    """A region's memory in host bytes (what a CUDA window reads and writes)."""

    data: bytearray = field(default_factory=lambda: bytearray(256))
    closed: bool = False

    def read(self, begin: int, byte_size: int) -> bytes:
        return bytes(self.data[begin : begin + byte_size])

    def write(self, begin: int, data: bytes) -> None:
        self.data[begin : begin + len(data)] = data

    read_in_thread = read
    write_in_thread = write

    def close(self) -> None:
        self.closed = True


def _region(kind: str = CUDA, device: int = 0) -> Region:
    return Region("r", kind, 256, _Memory(), device_id=device, raw_handle=HANDLE)  # type: ignore[arg-type]


def test_an_extent_of_a_cuda_region_on_the_models_device() -> None:
    ext = gw.extent(_region(), SharedRef("r", 16, 64), 0, "FP32")
    assert ext == pb.CudaExtent(raw_handle=HANDLE, offset=16, byte_size=64, device_id=0)


@pytest.mark.parametrize(
    "region, datatype",
    [
        (_region(device=1), "FP32"),  # another device than the model's
        (_region(kind=SYSTEM), "FP32"),  # system memory: the gateway reads it
        (_region(), "BYTES"),  # strings keep the copy path
    ],
)
def test_no_extent_where_the_copy_path_stays(region: Region, datatype: str) -> None:
    assert gw.extent(region, SharedRef("r", 0, 8), 0, datatype) is None


def test_an_extent_past_the_region_is_tritons_bounds_error() -> None:
    with pytest.raises(StageError, match="Invalid offset \\+ byte size") as exc:
        gw.extent(_region(), SharedRef("r", 200, 64), 0, "FP32")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _table(memory: _Memory) -> SharedMemory:
    def opener(name: str, raw: bytes, device_id: int, byte_size: int) -> _Memory:
        return memory

    return SharedMemory(open_cuda=opener)


def _infer_request(region: str, offset: int, nbytes: int) -> gs.ModelInferRequest:
    r = gs.ModelInferRequest(model_name="m")
    t = r.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4])
    t.parameters["shared_memory_region"].string_param = region
    t.parameters["shared_memory_offset"].int64_param = offset
    t.parameters["shared_memory_byte_size"].int64_param = nbytes
    out = r.outputs.add(name="OUTPUT__0")
    out.parameters["shared_memory_region"].string_param = region
    out.parameters["shared_memory_offset"].int64_param = 128
    out.parameters["shared_memory_byte_size"].int64_param = 16
    return r


def test_a_request_carries_references_and_holds_its_region_until_released() -> None:
    memory = _Memory()
    shm = _table(memory)
    shm.register_cuda("r", HANDLE, 0, 256)
    in_place = gw.InPlace(shm, 0)
    v = validate_infer(_infer_request("r", 32, 16), SPEC, in_place=in_place.input_part)
    (t,) = v.inputs
    assert t.raw == b"" and list(t.shape) == [1, 4]
    assert [p.cuda for p in t.parts] == [
        pb.CudaExtent(raw_handle=HANDLE, offset=32, byte_size=16, device_id=0)
    ]
    held = {"OUTPUT__0": shm.acquire("r")}
    (out,) = in_place.outputs(SPEC, v, held)
    assert out.name == "OUTPUT__0" and out.extent.offset == 128 and out.extent.byte_size == 16
    shm.unregister("r", CUDA)  # in use: closed only when the request lets it go
    shm.release(held["OUTPUT__0"])
    assert not memory.closed
    in_place.release()
    assert memory.closed


def test_the_inputs_taken_in_place_are_the_ones_input_part_takes(tmp_path) -> None:
    """InPlace.takes tells the gateway which inputs it need not read (shm_copies)."""
    (tmp_path / "sys").write_bytes(bytes(64))
    shm = SharedMemory(tmp_path, open_cuda=lambda *_: _Memory())
    shm.register_cuda("r", HANDLE, 0, 256)
    shm.register("sys", "/sys", 0, 64)
    in_place = gw.InPlace(shm, 0)
    assert in_place.takes(SharedRef("r", 0, 16), "FP32")
    assert not in_place.takes(SharedRef("r", 0, 16), "BYTES")
    assert not in_place.takes(SharedRef("sys", 0, 16), "FP32")
    assert not in_place.takes(SharedRef("ghost", 0, 16), "FP32")  # its read answers NOT_FOUND
    assert not gw.InPlace(shm, 1).takes(SharedRef("r", 0, 16), "FP32")
    assert [r.users for r in shm.status(kind=CUDA) + shm.status()] == [0, 0]  # none held
    shm.unregister()


def test_a_reference_of_the_wrong_size_is_tritons_byte_size_error() -> None:
    shm = _table(_Memory())
    shm.register_cuda("r", HANDLE, 0, 256)
    with pytest.raises(StageError, match="Expected 16, got 12"):
        validate_infer(_infer_request("r", 0, 12), SPEC, in_place=gw.InPlace(shm, 0).input_part)


def test_without_in_place_the_bytes_are_read_as_before() -> None:
    memory = _Memory()
    memory.write(0, np.arange(4, dtype=np.float32).tobytes())
    shm = _table(memory)
    shm.register_cuda("r", HANDLE, 0, 256)
    in_place = gw.InPlace(shm, 1)  # the model's device is not the region's

    def read(ref: SharedRef) -> bytes:
        return shm.acquire(ref.region).read(ref.offset, ref.byte_size)

    v = validate_infer(_infer_request("r", 0, 16), SPEC, read, in_place=in_place.input_part)
    assert v.inputs[0].raw == np.arange(4, dtype=np.float32).tobytes()
    assert not v.inputs[0].parts


def test_a_refused_request_is_resent_with_the_bytes() -> None:
    memory = _Memory()
    memory.write(32, b"0123456789abcdef")
    shm = _table(memory)
    shm.register_cuda("r", HANDLE, 0, 256)
    in_place = gw.InPlace(shm, 0)
    v = validate_infer(_infer_request("r", 32, 16), SPEC, in_place=in_place.input_part)
    request = pb.ScheduleRequest(model="m", inputs=v.inputs)
    request.cuda_outputs.add(name="OUTPUT__0")
    in_place.to_host(request)
    assert tensor_shm.tensor_bytes(request.inputs[0]) == b"0123456789abcdef"
    assert not request.cuda_outputs
    assert not any(p.HasField("cuda") for p in request.inputs[0].parts)


def test_the_gateway_counts_the_tensors_used_in_place() -> None:
    counter = CUDA_SHM_COPIES.labels("d2d")
    before = counter._value.get()
    request = pb.ScheduleRequest(inputs=[pb.Tensor(name="a", parts=[pb.TensorPart(length=4)])])
    request.inputs[0].parts[0].cuda.byte_size = 4
    outputs = [pb.Tensor(name="o", device_written=True), pb.Tensor(name="p", raw=b"x")]
    gw.count(request, outputs)
    assert counter._value.get() - before == 2


# ------------------------------------------------------------- on the way


def _queued(msg: pb.ScheduleRequest) -> Queued:
    return Queued(msg=msg, respond=lambda resp: None, enqueue_ns=0)


def test_the_scheduler_passes_each_requests_cuda_outputs_in_order() -> None:
    ext = pb.CudaExtent(raw_handle=HANDLE, offset=0, byte_size=16)
    first = pb.ScheduleRequest(inputs=[pb.Tensor(name="a", shape=[1, 4], raw=b"\0" * 16)])
    second = pb.ScheduleRequest(inputs=[pb.Tensor(name="a", shape=[1, 4], raw=b"\1" * 16)])
    second.cuda_outputs.add(name="o", extent=ext)
    req = build_execute_request("i", [_queued(first), _queued(second)], batching=True)
    assert [list(r.outputs) for r in req.cuda_outputs] == [
        [],
        [pb.CudaOutput(name="o", extent=ext)],
    ]
    plain = build_execute_request("i", [_queued(first)], batching=True)
    assert not plain.cuda_outputs  # a batch without them is as before


def test_only_the_in_place_path_reads_a_cuda_part() -> None:
    part = pb.TensorPart(length=16, cuda=pb.CudaExtent(raw_handle=HANDLE, byte_size=16))
    with pytest.raises(tensor_shm.RegionNotLocal):
        tensor_shm.tensor_bytes(pb.Tensor(name="a", parts=[part]))


def test_the_worker_sees_which_batches_want_the_in_place_path() -> None:
    plain = pb.ExecuteRequest(inputs=[pb.Tensor(name="a", raw=b"x")])
    assert not wk.wanted(plain)
    ref = pb.ExecuteRequest(inputs=[pb.Tensor(name="a", parts=[pb.TensorPart(raw=b"x")])])
    assert not wk.wanted(ref)
    ref.inputs[0].parts.add().cuda.byte_size = 4
    assert wk.wanted(ref)
    out = pb.ExecuteRequest()
    out.cuda_outputs.add()
    assert wk.wanted(out)


# ------------------------------------------------------------- the worker's handles


class _Runtime(cuda_ipc.Runtime):
    """Opens every handle at a made-up address; closes are recorded."""

    def __init__(self, fail_open: bool = False) -> None:
        self.path = "fake"
        self.opened: list[tuple[bytes, int]] = []
        self.closed: list[int] = []
        self.fail_open = fail_open

    def open_handle(self, raw: bytes, device: int) -> int:
        if self.fail_open:
            raise cuda_ipc.CudaError("cudaIpcOpenMemHandle", 201, "invalid device context")
        self.opened.append((raw, device))
        return 0x10000 * len(self.opened)

    def close_handle(self, ptr: int, device: int) -> None:
        self.closed.append(ptr)


def test_a_handle_is_opened_once_and_closed_when_unused() -> None:
    rt = _Runtime()
    now = [0.0]
    handles = wk.IpcHandles(lambda: rt, lambda: now[0], idle_s=10)
    a = pb.CudaExtent(raw_handle=HANDLE, offset=8, device_id=0)
    assert handles.pointer(a) == 0x10008
    a.offset = 64
    assert handles.pointer(a) == 0x10040  # the same opened handle
    other = pb.CudaExtent(raw_handle=bytes(64), offset=0, device_id=0)
    now[0] = 5
    assert handles.pointer(other) == 0x20000
    assert rt.opened == [(HANDLE, 0), (bytes(64), 0)]
    now[0] = 12  # `a` unused for 12 s: closed at the next use of any handle
    handles.pointer(other)
    assert rt.closed == [0x10000] and handles.open_count() == 1
    handles.close_all()
    assert rt.closed == [0x10000, 0x20000] and handles.open_count() == 0


def test_a_worker_that_cannot_open_the_handle_has_the_gateway_resend() -> None:
    ext = pb.CudaExtent(raw_handle=HANDLE, device_id=0)
    with pytest.raises(tensor_shm.RegionNotLocal, match="cannot open the CUDA IPC handle"):
        wk.IpcHandles(lambda: _Runtime(fail_open=True)).pointer(ext)
    with pytest.raises(tensor_shm.RegionNotLocal, match="CUDA is not available"):
        wk.IpcHandles(lambda: None).pointer(ext)
