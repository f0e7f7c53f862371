"""services/worker/device_batches.py's logic on the CPU: a batch assembled
from a client's region and inline bytes, padded, run through a real
TorchScript instance (run_device), and its outputs written into the region
or returned as bytes. The client's device memory is a CPU tensor here
(device_bytes replaced by a view of it): what a GPU run adds, opening the
handle and torch's view of the pointer, is in
tests/integration/test_cuda_shared_memory_gpu.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.worker import device_batches, device_torch
from services.worker.cuda_inplace import IpcHandles
from services.worker.tensor_batches import TensorBatches, _tensor
from services.worker.torch_backend import TorchInstance
from stageserve import tensor_shm
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb

HANDLE = bytes(range(64))
SPEC = to_spec(
    parse_config_text(
        """
name: "double"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
    )
)


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _Handles(IpcHandles):
    """Every handle opens at address 0 of the client's memory."""

    def pointer(self, ext: pb.CudaExtent) -> int:
        return int(ext.offset)


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The client's allocation (a CPU tensor), as device_bytes views it."""
    mem = torch.zeros(1024, dtype=torch.uint8)

    def view(_torch: Any, ptr: int, nbytes: int, device: str) -> torch.Tensor:
        return mem[ptr : ptr + nbytes]

    monkeypatch.setattr(device_torch, "device_bytes", view)
    return mem


def _double_session(tmp_path: Path) -> TorchInstance:
    """A CPU TorchInstance of _Double, saved as TorchScript under tmp_path."""
    path = tmp_path / "double.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_Double()), str(path))
    return TorchInstance(path, "cpu", 1, {"INPUT__0": "FP32"}, {"OUTPUT__0": "FP32"})


@pytest.fixture
def batches(tmp_path: Path) -> device_batches.DeviceBatches:
    session = _double_session(tmp_path)
    session.device = "cuda:0"  # what the path requires of an instance
    made = device_batches.DeviceBatches(SPEC, session, _tensor, _Handles())
    session.device = made.ops.device = "cpu"  # and where this test runs it
    assert isinstance(made.ops, device_torch.TorchDevice)
    return made


def _extent(offset: int, size: int) -> pb.CudaExtent:
    return pb.CudaExtent(raw_handle=HANDLE, offset=offset, byte_size=size, device_id=0)


def test_a_batch_from_the_region_and_bytes_written_back_in_place(
    memory: torch.Tensor, batches: device_batches.DeviceBatches
) -> None:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.full((1, 4), 5, dtype=np.float32)
    memory[0:16] = torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
    joined = pb.Tensor(name="INPUT__0", datatype="FP32", shape=[2, 4])
    joined.parts.add(length=16, cuda=_extent(0, 16))  # request 0: in the region
    joined.parts.add(raw=b.tobytes())  # request 1: bytes (the copy path)
    request = pb.ExecuteRequest(inputs=[joined], request_batch_sizes=[1, 1])
    request.requested.add()
    request.requested.add()
    request.cuda_outputs.add().outputs.add(name="OUTPUT__0", extent=_extent(256, 16))
    request.cuda_outputs.add()
    resp = batches.execute(request, (4,), ["OUTPUT__0"])  # padded to 4 rows on the device
    first, second = resp.results
    (written,) = first.outputs
    assert written.device_written and written.raw == b"" and list(written.shape) == [1, 4]
    got = memory[256:272].numpy().view(np.float32).reshape(1, 4)
    np.testing.assert_array_equal(got, a * 2)
    (inline,) = second.outputs
    assert not inline.device_written
    np.testing.assert_array_equal(np.frombuffer(inline.raw, np.float32).reshape(1, 4), b * 2)


def test_a_region_too_small_for_the_output_gets_the_bytes(
    memory: torch.Tensor, batches: device_batches.DeviceBatches
) -> None:
    t = pb.Tensor(name="INPUT__0", datatype="FP32", shape=[1, 4])
    t.parts.add(length=16, cuda=_extent(0, 16))
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    request.cuda_outputs.add().outputs.add(name="OUTPUT__0", extent=_extent(256, 8))
    (result,) = batches.execute(request, (), ["OUTPUT__0"]).results
    assert not result.outputs[0].device_written  # the gateway answers Triton's size error
    assert len(result.outputs[0].raw) == 16
    assert int(memory[256:272].sum()) == 0  # nothing written


def test_a_cpu_instance_refuses_a_cuda_reference(tmp_path: Path) -> None:
    session = _double_session(tmp_path)
    t = pb.Tensor(name="INPUT__0", datatype="FP32", shape=[1, 4])
    t.parts.add(length=16, cuda=_extent(0, 16))
    request = pb.ExecuteRequest(inputs=[t], request_batch_sizes=[1])
    request.requested.add()
    with pytest.raises(tensor_shm.RegionNotLocal, match="runs on cpu"):
        TensorBatches(SPEC, session).execute_batch(request, None)


def test_run_device_matches_run(tmp_path: Path) -> None:
    session = _double_session(tmp_path)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    on_device = session.run_device({"INPUT__0": torch.from_numpy(x.copy())})
    np.testing.assert_array_equal(
        on_device["OUTPUT__0"].numpy(), session.run({"INPUT__0": x})["OUTPUT__0"]
    )
