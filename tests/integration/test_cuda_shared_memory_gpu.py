"""Triton's CUDA shared-memory extension end to end on a GPU: the client's
tensors live in device memory (torch on cuda:0), their cudaIpcMemHandle_t
(taken through stageserve/cuda_ipc.py) is registered with the real
tritonclient over gRPC and HTTP, the models read their inputs from and write
their outputs to those allocations, and status and unregister list and drop
them. Marked gpu: skips without torch's CUDA or a CUDA runtime that answers.

The in-place path (services/gateway/cuda_inplace.py): a TorchScript model,
and an ONNX Runtime model (CUDA execution provider, IO binding), on a cuda:0
worker read and write the regions themselves (the gateway makes no d2h or
h2d copy, stageserve_cuda_shm_copies_total{direction="d2d"} counts the
tensors); the same models on CPU instances keep the gateway's copies.

Each tensor is 12 MiB so that torch's caching allocator gives it a cudaMalloc
of its own (allocations past 10 MiB are not carved from a shared segment):
one handle per region, as Triton's own client utilities make them.
"""

from __future__ import annotations

import base64
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from stageserve import cuda_ipc
from stageserve.net import free_port
from stageserve_tools.examples import write_simple
from stageserve_tools.torch_examples import two_io_module, write_torch_two_io
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import RunningStack, running_stack, wait_until

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

ALLOC = 12 << 20  # bytes per client allocation (see the module's docstring)
N = 256  # FP32 values the identity model passes through
REFUSED = "failed to register shared memory region: invalid args"


@dataclass
class DeviceRegion:
    """A client's device allocation, as a region is registered from it."""

    tensor: Any  # torch.uint8 on cuda:0, the whole allocation
    raw: bytes  # its cudaIpcMemHandle_t
    offset: int  # where `tensor` starts in the allocation the handle names

    @property
    def byte_size(self) -> int:
        return self.offset + ALLOC

    def put(self, at: int, array: np.ndarray) -> None:
        """`array`'s bytes at region offset `at` (the tensor starts at `offset`)."""
        data = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
        begin = at - self.offset
        self.tensor[begin : begin + data.numel()].copy_(data)
        torch.cuda.synchronize()

    def get(self, at: int, dtype: type, count: int) -> np.ndarray:
        """`count` values at region offset `at`."""
        begin, size = at - self.offset, np.dtype(dtype).itemsize * count
        return self.tensor[begin : begin + size].cpu().numpy().view(dtype)


def _device_region() -> DeviceRegion:
    t = torch.zeros(ALLOC, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    rt = cuda_ipc.runtime()
    rt.set_device(0)
    ptr = t.data_ptr()
    base, size = rt.address_range(ptr)
    assert ptr + ALLOC <= base + size
    return DeviceRegion(t, rt.get_handle(ptr), ptr - base)


@pytest.fixture(scope="module")
def gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if not cuda_ipc.available():
        pytest.skip(f"no CUDA runtime answers: {cuda_ipc.state().reason}")


@dataclass
class MetricsStack:
    running: RunningStack
    metrics_port: int

    def copies(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {
            s.labels["direction"]: s.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "stageserve_cuda_shm_copies"
            for s in fam.samples
            if s.name.endswith("_total")
        }


@pytest.fixture(scope="module")
def cstack(gpu: None, example_repository: Path) -> Iterator[MetricsStack]:
    port = free_port()
    with running_stack(
        example_repository,
        control_mode="explicit",
        load_models=("identity_fp32", "simple"),
        metrics_port=port,
    ) as running:
        yield MetricsStack(running, port)


@pytest.fixture
def regions(cstack: MetricsStack) -> Iterator[tuple[DeviceRegion, DeviceRegion]]:
    """An input and an output allocation; every CUDA region unregistered after."""
    yield _device_region(), _device_region()
    cstack.running.client().unregister_cuda_shared_memory()


def test_grpc_identity_in_and_out_of_device_memory(
    cstack: MetricsStack, regions: tuple[DeviceRegion, DeviceRegion]
) -> None:
    src, dst = regions
    c = cstack.running.client()
    x = np.arange(N, dtype=np.float32).reshape(1, N) * 0.5
    src.put(src.offset, x)
    c.register_cuda_shared_memory("in", base64.b64encode(src.raw), 0, src.byte_size)
    c.register_cuda_shared_memory("out", base64.b64encode(dst.raw), 0, dst.byte_size)
    assert "cuda_shared_memory" in c.get_server_metadata().extensions
    before = cstack.copies()

    inp = grpcclient.InferInput("INPUT0", [1, N], "FP32")
    inp.set_shared_memory("in", x.nbytes, offset=src.offset)
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("out", x.nbytes, offset=dst.offset)
    r = c.infer("identity_fp32", [inp], outputs=[out], client_timeout=RPC_TIMEOUT_S)

    assert list(r.get_response().raw_output_contents) == [b""]  # the bytes are in the region
    np.testing.assert_array_equal(dst.get(dst.offset, np.float32, N).reshape(1, N), x)
    after = cstack.copies()
    assert after["d2h"] - before.get("d2h", 0) == 1
    assert after["h2d"] - before.get("h2d", 0) == 1

    status = c.get_cuda_shared_memory_status()
    got = {n: (s.device_id, s.byte_size) for n, s in status.regions.items()}
    assert got == {"in": (0, src.byte_size), "out": (0, dst.byte_size)}
    c.unregister_cuda_shared_memory("in")
    assert set(c.get_cuda_shared_memory_status().regions) == {"out"}
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        c.infer("identity_fp32", [inp], client_timeout=RPC_TIMEOUT_S)


def test_http_identity_in_and_out_of_device_memory(
    cstack: MetricsStack, regions: tuple[DeviceRegion, DeviceRegion]
) -> None:
    # imported here: tritonclient.http needs gevent, which a GPU host may lack
    # (its __init__ then raises RuntimeError, not ImportError); the other tests
    # here run without it
    try:
        import tritonclient.http as httpclient
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"tritonclient.http does not import: {exc}")
    src, dst = regions
    hc = httpclient.InferenceServerClient(cstack.running.gateway.http_address)
    x = -np.arange(N, dtype=np.float32).reshape(1, N)
    src.put(src.offset + 128, x)  # an offset inside the allocation too
    hc.register_cuda_shared_memory("hin", base64.b64encode(src.raw).decode(), 0, src.byte_size)
    hc.register_cuda_shared_memory("hout", base64.b64encode(dst.raw).decode(), 0, dst.byte_size)
    inp = httpclient.InferInput("INPUT0", [1, N], "FP32")
    inp.set_shared_memory("hin", x.nbytes, offset=src.offset + 128)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    out.set_shared_memory("hout", x.nbytes, offset=dst.offset)
    r = hc.infer("identity_fp32", [inp], outputs=[out])
    assert r.get_output("OUTPUT0")["parameters"]["shared_memory_region"] == "hout"
    np.testing.assert_array_equal(dst.get(dst.offset, np.float32, N).reshape(1, N), x)
    status = {s["name"]: s for s in hc.get_cuda_shared_memory_status()}
    assert status["hin"] == {"name": "hin", "device_id": 0, "byte_size": src.byte_size}
    hc.unregister_cuda_shared_memory()
    assert hc.get_cuda_shared_memory_status() == []


def test_two_inputs_and_two_outputs_at_offsets_of_one_region(
    cstack: MetricsStack, regions: tuple[DeviceRegion, DeviceRegion]
) -> None:
    src, dst = regions
    c = cstack.running.client()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 7, dtype=np.int32)
    src.put(src.offset, a)
    src.put(src.offset + a.nbytes, b)
    c.register_cuda_shared_memory("ab", base64.b64encode(src.raw), 0, src.byte_size)
    c.register_cuda_shared_memory("sd", base64.b64encode(dst.raw), 0, dst.byte_size)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("ab", a.nbytes, offset=src.offset)
    inputs[1].set_shared_memory("ab", b.nbytes, offset=src.offset + a.nbytes)
    outs = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outs[0].set_shared_memory("sd", a.nbytes, offset=dst.offset)
    outs[1].set_shared_memory("sd", a.nbytes, offset=dst.offset + a.nbytes)
    c.infer("simple", inputs, outputs=outs, client_timeout=RPC_TIMEOUT_S)
    np.testing.assert_array_equal(dst.get(dst.offset, np.int32, 16), (a + b).reshape(-1))
    np.testing.assert_array_equal(dst.get(dst.offset + a.nbytes, np.int32, 16), (a - b)[0])

    small = grpcclient.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory("sd", a.nbytes // 2, offset=dst.offset)
    with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
        c.infer("simple", inputs, outputs=[small], client_timeout=RPC_TIMEOUT_S)


def test_register_refusals_with_tritons_answers(
    cstack: MetricsStack, regions: tuple[DeviceRegion, DeviceRegion]
) -> None:
    src, _ = regions
    c = cstack.running.client()
    handle = base64.b64encode(src.raw)
    with pytest.raises(InferenceServerException) as e:  # past the allocation's end
        c.register_cuda_shared_memory("big", handle, 0, src.byte_size + (64 << 20))
    assert "INVALID_ARGUMENT" in str(e.value.status())
    assert e.value.message() == "failed to register shared memory region 'big': invalid args"
    with pytest.raises(InferenceServerException) as e:  # a device this host lacks
        c.register_cuda_shared_memory("far", handle, torch.cuda.device_count(), 16)
    assert e.value.message() == REFUSED
    with pytest.raises(InferenceServerException) as e:  # a handle that opens nothing
        c.register_cuda_shared_memory("junk", base64.b64encode(bytes(range(64))), 0, 16)
    assert e.value.message() == REFUSED
    assert c.get_cuda_shared_memory_status(as_json=True) == {}  # nothing half-registered
    c.register_cuda_shared_memory("ok", handle, 0, src.byte_size)
    with pytest.raises(InferenceServerException, match="'ok' already in manager"):
        c.register_cuda_shared_memory("ok", handle, 0, src.byte_size)
    with pytest.raises(InferenceServerException, match="registered as CUDA shared memory"):
        c.get_system_shared_memory_status("ok")


# ------------------------------------------------------------- in place

TWO_IO = 16  # torch_two_io's FP32 elements per input and output


@pytest.fixture(scope="module")
def torch_stack(gpu: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsStack]:
    """torch_two_io and the ONNX Runtime `simple` (a + b, a - b) twice each,
    on a cuda:0 worker: one KIND_GPU instance, one KIND_CPU."""
    root = tmp_path_factory.mktemp("cuda_inplace_repository")
    for name, kind in (("two_io_gpu", "KIND_GPU"), ("two_io_cpu", "KIND_CPU")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            model_dir = write_torch_two_io(root, name)
        config = model_dir / "config.pbtxt"
        config.write_text(config.read_text().replace("KIND_CPU", kind))
    write_simple(root, "simple_gpu", kind="KIND_GPU")
    write_simple(root, "simple_cpu", kind="KIND_CPU")
    port = free_port()
    with running_stack(root, metrics_port=port, device="cuda:0") as running:
        yield MetricsStack(running, port)


def _through_regions(
    stack: MetricsStack,
    model: str,
    regions: tuple[DeviceRegion, DeviceRegion, str, str],
    inputs: dict[str, np.ndarray],
    outputs: tuple[str, str],
    datatype: str,
) -> dict[str, float]:
    """One request whose inputs (name -> value) lie one after the other in the
    input region and whose two outputs, each the first input's size, go one
    after the other to the output region (`regions`: the input and output
    allocations and the names they are registered under): the copies it cost
    (the counters' change)."""
    src, dst, src_name, dst_name = regions
    at, tensors = src.offset, []
    for name, value in inputs.items():
        src.put(at, value)
        tensors.append(grpcclient.InferInput(name, list(value.shape), datatype))
        tensors[-1].set_shared_memory(src_name, value.nbytes, offset=at)
        at += value.nbytes
    size = next(iter(inputs.values())).nbytes
    outs = [grpcclient.InferRequestedOutput(n) for n in outputs]
    for i, out in enumerate(outs):
        out.set_shared_memory(dst_name, size, offset=dst.offset + i * size)
    before = stack.copies()
    r = stack.running.client().infer(model, tensors, outputs=outs, client_timeout=RPC_TIMEOUT_S)
    after = stack.copies()
    assert list(r.get_response().raw_output_contents) == [b"", b""]
    return {d: after.get(d, 0) - before.get(d, 0) for d in ("d2h", "h2d", "d2d")}


def _two_io(
    stack: MetricsStack, model: str, src: DeviceRegion, dst: DeviceRegion
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """One torch_two_io request through CUDA regions: its inputs, and its copies."""
    rng = np.random.default_rng(len(model))
    x, y = (rng.standard_normal((1, TWO_IO), dtype=np.float32) for _ in range(2))
    regions = (src, dst, "tin", "tout")
    outputs = ("OUTPUT__0", "OUTPUT__1")
    return x, y, _through_regions(stack, model, regions, {"x": x, "y": y}, outputs, "FP32")


def _expected(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    module = two_io_module()
    with torch.no_grad():
        a, b = module(torch.from_numpy(x), torch.from_numpy(y))
    return a.numpy(), b.numpy()


Answer = tuple[np.ndarray, np.ndarray, dict[str, float]]


def _answered(request: Callable[[], Answer], in_place: bool) -> tuple[np.ndarray, np.ndarray]:
    """The inputs of one two-input, two-output `request` through the regions,
    checked for its copies: in place (once the gateway knows where the
    instances run, within a second of the load) none by the gateway and four
    d2d; else the gateway's two d2h and two h2d."""
    if not in_place:
        x, y, delta = request()
        assert delta == {"d2h": 2, "h2d": 2, "d2d": 0}
        return x, y
    got: list[Answer] = []

    def answered_in_place() -> bool:
        got.append(request())
        return got[-1][2]["d2d"] > 0

    assert wait_until(answered_in_place, timeout_s=10, interval_s=0.5), got[-1][2]
    x, y, delta = got[-1]
    assert delta == {"d2h": 0, "h2d": 0, "d2d": 4}
    return x, y


@pytest.mark.parametrize("model", ["two_io_gpu", "two_io_cpu"])
def test_a_torch_model_on_the_regions_device_uses_them_in_place(
    torch_stack: MetricsStack, model: str
) -> None:
    src, dst = _device_region(), _device_region()
    c = torch_stack.running.client()
    c.register_cuda_shared_memory("tin", base64.b64encode(src.raw), 0, src.byte_size)
    c.register_cuda_shared_memory("tout", base64.b64encode(dst.raw), 0, dst.byte_size)
    try:
        on_gpu = model == "two_io_gpu"
        x, y = _answered(lambda: _two_io(torch_stack, model, src, dst), on_gpu)
        atol = 1e-2 if on_gpu else 1e-5  # TF32 on the GPU (docs/gpu.md)
        want0, want1 = _expected(x, y)
        np.testing.assert_allclose(dst.get(dst.offset, np.float32, TWO_IO), want0[0], atol=atol)
        np.testing.assert_allclose(
            dst.get(dst.offset + x.nbytes, np.float32, TWO_IO), want1[0], atol=atol
        )
    finally:
        c.unregister_cuda_shared_memory()


def _simple(
    stack: MetricsStack, model: str, src: DeviceRegion, dst: DeviceRegion
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """One `simple` request through CUDA regions: its inputs, and its copies."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16) * 3
    b = np.full((1, 16), len(model), dtype=np.int32)
    regions = (src, dst, "oin", "oout")
    outputs = ("OUTPUT0", "OUTPUT1")
    feeds = {"INPUT0": a, "INPUT1": b}
    return a, b, _through_regions(stack, model, regions, feeds, outputs, "INT32")


@pytest.mark.parametrize("model", ["simple_gpu", "simple_cpu"])
def test_an_onnx_runtime_model_on_the_regions_device_uses_them_in_place(
    torch_stack: MetricsStack, model: str
) -> None:
    src, dst = _device_region(), _device_region()
    c = torch_stack.running.client()
    c.register_cuda_shared_memory("oin", base64.b64encode(src.raw), 0, src.byte_size)
    c.register_cuda_shared_memory("oout", base64.b64encode(dst.raw), 0, dst.byte_size)
    try:
        a, b = _answered(lambda: _simple(torch_stack, model, src, dst), model == "simple_gpu")
        np.testing.assert_array_equal(dst.get(dst.offset, np.int32, 16), (a + b)[0])
        np.testing.assert_array_equal(dst.get(dst.offset + a.nbytes, np.int32, 16), (a - b)[0])

        # an output region too small: the worker answers the bytes, the gateway
        # Triton's error, as on the copy path
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("oin", a.nbytes, offset=src.offset)
        inputs[1].set_shared_memory("oin", b.nbytes, offset=src.offset + a.nbytes)
        small = grpcclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory("oout", a.nbytes // 2, offset=dst.offset)
        with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
            c.infer(model, inputs, outputs=[small], client_timeout=RPC_TIMEOUT_S)
    finally:
        c.unregister_cuda_shared_memory()
