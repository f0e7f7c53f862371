"""services/worker/device_onnx.py on the CPU: a batch of an ONNX Runtime
model assembled from a client's region and inline bytes, padded, run through
a real OnnxInstance with IO binding, and its outputs written into the region
or returned as bytes. ORT allocates on "cpu" here and the CUDA runtime's
cudaMemcpy is ctypes.memmove between host buffers (the client's "device"
memory is a numpy array): what a GPU run adds, ORT's CUDA allocations and
the IPC-mapped pointer, is in tests/integration/test_cuda_shared_memory_gpu.py."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from services.worker import device_batches, device_onnx
from services.worker.backends import BackendError
from services.worker.cuda_inplace import IpcHandles
from services.worker.onnx_backend import OnnxInstance
from services.worker.tensor_batches import TensorBatches, _tensor
from stageserve import cuda_ipc, tensor_shm
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve_tools import examples

HANDLE = bytes(range(64))
CONFIG = """
name: "addsub"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "DIFF" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
SPEC = to_spec(parse_config_text(CONFIG))
ROW = 16  # bytes of one row (4 FP32)


class _HostRuntime:
    """cuda_ipc.Runtime's copies between host buffers; records each copy's kind."""

    def __init__(self) -> None:
        self.kinds: list[int] = []
        self.syncs = 0
        self.fail = False

    def copy(self, dst: int, src: int, nbytes: int, kind: int, device: int) -> None:
        if self.fail:
            raise cuda_ipc.CudaError("cudaMemcpy", 1, "invalid argument")
        self.kinds.append(kind)
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self, device: int) -> None:
        self.syncs += 1


class _Handles(IpcHandles):
    """Every handle opens at the start of the client's memory."""

    def __init__(self, memory: np.ndarray) -> None:
        super().__init__()
        self.memory = memory

    def pointer(self, ext: pb.CudaExtent) -> int:
        return int(self.memory.ctypes.data) + int(ext.offset)


def _addsub(tmp_path: Path, shape: tuple[int | str, ...] = ("batch", 4)) -> OnnxInstance:
    """A CPU session of SUM = A + B, DIFF = A - B (FP32 of `shape`)."""
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "AB"]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("SUM", "DIFF")]
    nodes = [
        helper.make_node("Add", ["A", "B"], ["SUM"]),
        helper.make_node("Sub", ["A", "B"], ["DIFF"]),
    ]
    path = tmp_path / "model.onnx"
    path.write_bytes(
        examples.make_model(helper.make_graph(nodes, "addsub", vi, out)).SerializeToString()
    )
    return OnnxInstance(path, "cpu", 1)


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> OnnxInstance:
    made = _addsub(tmp_path)
    monkeypatch.setattr(made, "in_place_device", lambda: 0)  # what a CUDA-EP session says
    return made


@pytest.fixture
def memory() -> np.ndarray:
    return np.zeros(1024, dtype=np.uint8)


def _batches(
    session: OnnxInstance, memory: np.ndarray, rt: _HostRuntime
) -> device_batches.DeviceBatches:
    ops = device_onnx.OnnxDevice(session, lambda: rt, ort_device="cpu")
    return device_batches.DeviceBatches(SPEC, session, _tensor, _Handles(memory), ops)


def _extent(offset: int, size: int, device: int = 0) -> pb.CudaExtent:
    return pb.CudaExtent(raw_handle=HANDLE, offset=offset, byte_size=size, device_id=device)


def _put(memory: np.ndarray, at: int, arr: np.ndarray) -> None:
    raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    memory[at : at + raw.size] = raw


def _get(memory: np.ndarray, at: int, rows: int) -> np.ndarray:
    return memory[at : at + rows * ROW].view(np.float32).reshape(rows, 4)


def test_a_batch_from_the_region_and_bytes_padded_run_and_written_back(
    session: OnnxInstance, memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4), dtype=np.float32)  # request 0: 2 rows, request 1: 1
    b = rng.standard_normal((3, 4), dtype=np.float32)
    _put(memory, 0, a[:2])
    _put(memory, 64, b[:2])
    inputs = []
    for name, arr, at in (("A", a, 0), ("B", b, 64)):
        t = pb.Tensor(name=name, datatype="FP32", shape=[3, 4])
        t.parts.add(length=2 * ROW, cuda=_extent(at, 2 * ROW))  # request 0: in the region
        t.parts.add(raw=arr[2:].tobytes())  # request 1: bytes (the copy path)
        inputs.append(t)
    request = pb.ExecuteRequest(inputs=inputs, request_batch_sizes=[2, 1])
    request.requested.add()  # request 0: every output
    request.requested.add(names=["SUM"])
    r0 = request.cuda_outputs.add()
    r0.outputs.add(name="SUM", extent=_extent(256, 2 * ROW))
    r0.outputs.add(name="DIFF", extent=_extent(512, ROW))  # too small: the bytes
    request.cuda_outputs.add()

    seen: dict[str, np.ndarray] = {}
    run_on_device = session.run_on_device

    def spy(feeds: dict[str, Any], *args: Any) -> dict[str, Any]:
        seen.update({n: v.numpy() for n, v in feeds.items()})
        return run_on_device(feeds, *args)

    monkeypatch.setattr(session, "run_on_device", spy)
    rt = _HostRuntime()
    resp = _batches(session, memory, rt).execute(request, (4,), ["SUM", "DIFF"])

    # padded on the "device" to 4 rows, the last real row repeated
    np.testing.assert_array_equal(seen["A"], np.concatenate([a, a[2:]]))
    np.testing.assert_array_equal(seen["B"], np.concatenate([b, b[2:]]))
    first, second = resp.results
    total, diff = first.outputs
    assert total.device_written and total.raw == b"" and list(total.shape) == [2, 4]
    np.testing.assert_allclose(_get(memory, 256, 2), a[:2] + b[:2])
    assert not diff.device_written and list(diff.shape) == [2, 4]
    np.testing.assert_allclose(np.frombuffer(diff.raw, np.float32).reshape(2, 4), a[:2] - b[:2])
    assert not memory[512:].any()  # nothing written where it did not fit
    (inline,) = second.outputs
    assert not inline.device_written
    np.testing.assert_allclose(np.frombuffer(inline.raw, np.float32).reshape(1, 4), a[2:] + b[2:])
    d2d, h2d, d2h = (
        rt.kinds.count(cuda_ipc.D2D),
        rt.kinds.count(cuda_ipc.H2D),
        rt.kinds.count(cuda_ipc.D2H),
    )
    # per input: one D2D from the region, one H2D of the bytes, one D2D pad
    # copy; out: SUM into the region (D2D), DIFF and request 1's SUM to host
    assert (d2d, h2d, d2h) == (2 + 2 + 1, 2, 2)
    assert rt.syncs == 3  # after the inputs, after the run, after the outputs


def test_bytes_inputs_alone_and_a_model_without_batching(tmp_path: Path) -> None:
    session = _addsub(tmp_path, (4,))
    session.in_place_device = lambda: 0  # type: ignore[method-assign]
    spec = to_spec(parse_config_text(CONFIG.replace("max_batch_size: 4", "max_batch_size: 0")))
    memory = np.zeros(256, dtype=np.uint8)
    a, b = np.arange(4, dtype=np.float32), np.full(4, 3, dtype=np.float32)
    inputs = [
        pb.Tensor(name=n, datatype="FP32", shape=[4], raw=x.tobytes())
        for n, x in (("A", a), ("B", b))
    ]
    request = pb.ExecuteRequest(inputs=inputs, request_batch_sizes=[1])
    request.requested.add(names=["DIFF"])
    request.cuda_outputs.add().outputs.add(name="DIFF", extent=_extent(32, 16))
    ops = device_onnx.OnnxDevice(session, _HostRuntime, ort_device="cpu")
    made = device_batches.DeviceBatches(spec, session, _tensor, _Handles(memory), ops)
    (result,) = made.execute(request, (), ["DIFF"]).results
    (written,) = result.outputs
    assert written.device_written and list(written.shape) == [4]
    np.testing.assert_array_equal(memory[32:48].view(np.float32), a - b)


def test_a_failed_copy_before_the_run_is_a_refusal(
    session: OnnxInstance, memory: np.ndarray
) -> None:
    t = pb.Tensor(name="A", datatype="FP32", shape=[1, 4])
    t.parts.add(length=ROW, cuda=_extent(0, ROW))
    u = pb.Tensor(name="B", datatype="FP32", shape=[1, 4], raw=bytes(ROW))
    request = pb.ExecuteRequest(inputs=[t, u], request_batch_sizes=[1])
    request.requested.add()
    rt = _HostRuntime()
    rt.fail = True
    with pytest.raises(tensor_shm.RegionNotLocal, match="not built"):
        _batches(session, memory, rt).execute(request, (), ["SUM"])


def test_a_region_on_another_device_is_a_refusal(session: OnnxInstance, memory: np.ndarray) -> None:
    t = pb.Tensor(name="A", datatype="FP32", shape=[1, 4])
    t.parts.add(length=ROW, cuda=_extent(0, ROW, device=1))
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    with pytest.raises(tensor_shm.RegionNotLocal, match="device 1"):
        _batches(session, memory, _HostRuntime()).execute(request, (), ["SUM"])


def test_no_cuda_runtime_is_a_refusal(session: OnnxInstance) -> None:
    with pytest.raises(tensor_shm.RegionNotLocal, match="CUDA is not available"):
        device_onnx.OnnxDevice(session, lambda: None)


def test_a_cpu_session_refuses_a_cuda_reference(tmp_path: Path) -> None:
    session = _addsub(tmp_path)
    assert session.in_place_device() is None  # CPU: no in-place path
    t = pb.Tensor(name="A", datatype="FP32", shape=[1, 4])
    t.parts.add(length=ROW, cuda=_extent(0, ROW))
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    with pytest.raises(tensor_shm.RegionNotLocal, match="no in-place path"):
        TensorBatches(SPEC, session).execute_batch(request, None)


def test_run_on_device_matches_run(tmp_path: Path) -> None:
    import onnxruntime as ort

    session = _addsub(tmp_path)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    feeds = {"A": ort.OrtValue.ortvalue_from_numpy(a), "B": ort.OrtValue.ortvalue_from_numpy(b)}
    got = session.run_on_device(feeds, ["DIFF", "SUM"], "cpu", 0)
    want = session.run({"A": a, "B": b}, ["DIFF", "SUM"])
    for name in ("DIFF", "SUM"):
        np.testing.assert_array_equal(np.asarray(got[name].numpy()), want[name])
    with pytest.raises(BackendError, match="unknown output"):
        session.run_on_device(feeds, ["NOPE"], "cpu", 0)


def test_only_a_cuda_ep_first_session_on_a_cuda_device_takes_the_path(tmp_path: Path) -> None:
    s = _addsub(tmp_path)
    s.device = "cuda:1"  # what a session on a GPU would say
    s._desc = replace(s._desc, providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert s.in_place_device() == 1
    s.options = replace(s.options, tensorrt={"device_id": "1"})  # TensorRT asked for
    assert s.in_place_device() is None
    s.options = replace(s.options, tensorrt=None)
    s._desc = replace(s._desc, providers=("CPUExecutionProvider",))  # ORT fell back
    assert s.in_place_device() is None


def _identity(tmp_path: Path, datatype: str) -> tuple[OnnxInstance, Any]:
    model_dir = examples.write_identity(tmp_path, "id", datatype, dims=(4,), max_batch_size=4)
    spec = to_spec(parse_config_text((model_dir / "config.pbtxt").read_text()))
    session = OnnxInstance(model_dir / "1" / "model.onnx", "cpu", 1)
    session.in_place_device = lambda: 0  # type: ignore[method-assign]
    return session, spec


def test_bf16_tensors_travel_as_their_raw_words(tmp_path: Path) -> None:
    session, spec = _identity(tmp_path, "BF16")
    words = np.array([[0x3F80, 0x4000, 0xC040, 0x0001]], dtype=np.uint16)  # 1, 2, -3, tiny
    t = pb.Tensor(name="INPUT0", datatype="BF16", shape=[1, 4], raw=words.tobytes())
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    request.cuda_outputs.add().outputs.add(name="OUTPUT0", extent=_extent(0, 8))
    memory = np.zeros(64, dtype=np.uint8)
    ops = device_onnx.OnnxDevice(session, _HostRuntime, ort_device="cpu")
    made = device_batches.DeviceBatches(spec, session, _tensor, _Handles(memory), ops)
    (result,) = made.execute(request, (2,), ["OUTPUT0"]).results
    assert result.outputs[0].device_written
    np.testing.assert_array_equal(memory[:8].view(np.uint16), words[0])


def test_a_bytes_tensor_is_a_refusal(tmp_path: Path) -> None:
    session, spec = _identity(tmp_path, "BYTES")
    t = pb.Tensor(name="INPUT0", datatype="BYTES", shape=[1, 1], raw=b"\x01\x00\x00\x00x")
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    request.cuda_outputs.add().outputs.add(name="OUTPUT0", extent=_extent(0, 8))
    ops = device_onnx.OnnxDevice(session, _HostRuntime, ort_device="cpu")
    made = device_batches.DeviceBatches(
        spec, session, _tensor, _Handles(np.zeros(8, np.uint8)), ops
    )
    with pytest.raises(tensor_shm.RegionNotLocal, match="BYTES"):
        made.execute(request, (), ["OUTPUT0"])
