"""Triton's system shared-memory extension through the stack, driven by the real
tritonclient (its shared_memory utilities create the POSIX regions) and by
perf_analyzer --shared-memory system."""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from bench.perf_analyzer import find_perf_analyzer, run_perf
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import RunningStack

X = np.arange(16, dtype=np.int32).reshape(1, 16)
Y = np.full((1, 16), 3, dtype=np.int32)
NBYTES = X.nbytes


@pytest.fixture
def regions(stack: RunningStack) -> Iterator[dict[str, object]]:
    """Client-side regions 'in' (X then Y) and 'out' (two outputs), registered."""
    tag = uuid.uuid4().hex[:8]
    handles = {
        "in": shm.create_shared_memory_region(f"in-{tag}", f"/ss-in-{tag}", 2 * NBYTES),
        "out": shm.create_shared_memory_region(f"out-{tag}", f"/ss-out-{tag}", 2 * NBYTES),
    }
    shm.set_shared_memory_region(handles["in"], [X, Y])
    client = stack.client()
    client.register_system_shared_memory(f"in-{tag}", f"/ss-in-{tag}", 2 * NBYTES)
    client.register_system_shared_memory(f"out-{tag}", f"/ss-out-{tag}", 2 * NBYTES)
    yield {"tag": tag, **handles}
    client.unregister_system_shared_memory()
    for h in handles.values():
        shm.destroy_shared_memory_region(h)


def _inputs(tag: str, raw_second: bool = False) -> list[grpcclient.InferInput]:
    a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    a.set_shared_memory(f"in-{tag}", NBYTES)
    b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    if raw_second:
        b.set_data_from_numpy(Y)
    else:
        b.set_shared_memory(f"in-{tag}", NBYTES, offset=NBYTES)
    return [a, b]


def test_inputs_and_outputs_in_shared_memory(stack: RunningStack, regions) -> None:
    tag = regions["tag"]
    outs = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outs[0].set_shared_memory(f"out-{tag}", NBYTES)
    outs[1].set_shared_memory(f"out-{tag}", NBYTES, offset=NBYTES)
    r = stack.client().infer("simple", _inputs(tag), outputs=outs, client_timeout=RPC_TIMEOUT_S)
    # as in Triton: each output keeps its raw entry, empty, the bytes are in the region
    assert list(r.get_response().raw_output_contents) == [b"", b""]
    sum_ = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16])
    diff = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16], offset=NBYTES)
    np.testing.assert_array_equal(sum_, X + Y)
    np.testing.assert_array_equal(diff, X - Y)
    assert list(r.get_output("OUTPUT1").shape) == [1, 16]


def test_mixed_raw_and_shared_memory_keep_their_order(stack: RunningStack, regions) -> None:
    tag = regions["tag"]
    outs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    outs[0].set_shared_memory(f"out-{tag}", NBYTES)
    r = stack.client().infer(
        "simple", _inputs(tag, raw_second=True), outputs=outs, client_timeout=RPC_TIMEOUT_S
    )
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16]), X + Y
    )
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), X - Y)  # raw, right after the empty one


def test_status_lists_what_was_registered(stack: RunningStack, regions) -> None:
    tag = regions["tag"]
    status = stack.client().get_system_shared_memory_status(f"in-{tag}")
    region = status.regions[f"in-{tag}"]
    assert (region.key, region.offset, region.byte_size) == (f"/ss-in-{tag}", 0, 2 * NBYTES)
    names = set(stack.client().get_system_shared_memory_status().regions)
    assert {f"in-{tag}", f"out-{tag}"} <= names


def _status_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_errors_have_tritons_codes_and_the_server_keeps_serving(
    stack: RunningStack, regions
) -> None:
    tag, c = regions["tag"], stack.client()
    with pytest.raises(InferenceServerException, match="already in manager") as e:
        c.register_system_shared_memory(f"in-{tag}", f"/ss-in-{tag}", NBYTES)
    assert "ALREADY_EXISTS" in _status_of(e.value)
    with pytest.raises(InferenceServerException, match="Unable to open shared memory") as e:
        c.register_system_shared_memory("ghost", "/stageserve-no-such-key", NBYTES)
    assert "INTERNAL" in _status_of(e.value)
    with pytest.raises(InferenceServerException, match="invalid args") as e:
        c.register_system_shared_memory("big", f"/ss-in-{tag}", 4 * NBYTES)
    assert "INVALID_ARGUMENT" in _status_of(e.value)
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory") as e:
        c.get_system_shared_memory_status("ghost")
    assert "NOT_FOUND" in _status_of(e.value)

    missing = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    missing.set_shared_memory("ghost", NBYTES)
    second = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    second.set_data_from_numpy(Y)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region") as e:
        c.infer("simple", [missing, second], client_timeout=RPC_TIMEOUT_S)
    assert "NOT_FOUND" in _status_of(e.value)

    small = grpcclient.InferRequestedOutput("OUTPUT0")
    small.set_shared_memory(f"out-{tag}", NBYTES // 2)
    with pytest.raises(InferenceServerException, match="should be at least 64 bytes") as e:
        c.infer("simple", _inputs(tag), outputs=[small], client_timeout=RPC_TIMEOUT_S)
    assert "INTERNAL" in _status_of(e.value)

    past = grpcclient.InferRequestedOutput("OUTPUT0")
    past.set_shared_memory(f"out-{tag}", NBYTES, offset=2 * NBYTES)
    with pytest.raises(InferenceServerException, match="Invalid offset for shared memory") as e:
        c.infer("simple", _inputs(tag), outputs=[past], client_timeout=RPC_TIMEOUT_S)
    assert "INVALID_ARGUMENT" in _status_of(e.value)

    r = c.infer("simple", _inputs(tag, raw_second=True), client_timeout=RPC_TIMEOUT_S)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), X + Y)


def test_a_region_the_client_shrank_is_refused_and_the_gateway_lives(
    stack: RunningStack, regions
) -> None:
    """A client that truncates its shm object after registering it: a copy
    through the mapping would fault (SIGBUS) and take the gateway down; the
    gateway's reads come back short and the request is refused, its writes
    grow the object again, and the gateway keeps serving."""
    tag, c = regions["tag"], stack.client()
    os.truncate(f"/dev/shm/ss-in-{tag}", 0)
    with pytest.raises(InferenceServerException) as e:
        c.infer("simple", _inputs(tag), client_timeout=RPC_TIMEOUT_S)
    assert "INVALID_ARGUMENT" in _status_of(e.value)
    os.truncate(f"/dev/shm/ss-out-{tag}", 0)
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory(f"out-{tag}", NBYTES)
    c.infer("simple", _inputs(tag, raw_second=True)[1:] + [_raw_x()], outputs=[out],
            client_timeout=RPC_TIMEOUT_S)  # fmt: skip
    with open(f"/dev/shm/ss-out-{tag}", "rb") as f:
        np.testing.assert_array_equal(np.frombuffer(f.read(NBYTES), np.int32), (X + Y)[0])
    r = c.infer(
        "simple", [_raw_x(), _inputs(tag, raw_second=True)[1]], client_timeout=RPC_TIMEOUT_S
    )
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), X + Y)


def _raw_x() -> grpcclient.InferInput:
    a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    a.set_data_from_numpy(X)
    return a


def test_unregister_then_use_is_not_found(stack: RunningStack, regions) -> None:
    tag, c = regions["tag"], stack.client()
    c.unregister_system_shared_memory(f"in-{tag}")
    c.unregister_system_shared_memory("never-registered")  # no error, as in Triton
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        c.infer("simple", _inputs(tag), client_timeout=RPC_TIMEOUT_S)
    assert f"in-{tag}" not in c.get_system_shared_memory_status().regions


def test_system_and_cuda_regions_share_one_table(stack: RunningStack, regions) -> None:
    """As Triton's manager: a name is unique across kinds, the CUDA calls see a
    system region only to say so, and CUDA unregister leaves it alone."""
    tag, c = regions["tag"], stack.client()
    with pytest.raises(InferenceServerException, match="already in manager") as e:
        c.register_cuda_shared_memory(f"in-{tag}", base64.b64encode(bytes(64)), 0, NBYTES)
    assert "ALREADY_EXISTS" in _status_of(e.value)
    with pytest.raises(InferenceServerException) as e:
        c.get_cuda_shared_memory_status(f"in-{tag}")
    assert "NOT_FOUND" in _status_of(e.value)
    assert e.value.message() == (
        f"The region named 'in-{tag}' is registered as system shared memory, not CUDA shared memory"
    )
    c.unregister_cuda_shared_memory(f"in-{tag}")
    c.unregister_cuda_shared_memory()
    assert f"in-{tag}" in c.get_system_shared_memory_status().regions
    assert f"in-{tag}" not in c.get_cuda_shared_memory_status(as_json=True).get("regions", {})


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_a_large_tensor_through_regions_on_both_fronts(stack: RunningStack, front: str) -> None:
    """3 MiB in and out of regions: past the gateway's 1 MiB threshold, its
    copies run on its copy threads (pread / pwrite of the shm objects)."""
    data = np.random.default_rng(7).integers(0, 256, (1, 3 << 20), dtype=np.uint8)
    tag = uuid.uuid4().hex[:8]
    module: Any = grpcclient if front == "grpc" else httpclient
    client = (
        stack.client()
        if front == "grpc"
        else httpclient.InferenceServerClient(stack.gateway.http_address)
    )
    handles = [
        shm.create_shared_memory_region(f"{d}-{tag}", f"/ss-{d}-{tag}", data.nbytes)
        for d in ("big-in", "big-out")
    ]
    try:
        shm.set_shared_memory_region(handles[0], [data])
        for d in ("big-in", "big-out"):
            client.register_system_shared_memory(f"{d}-{tag}", f"/ss-{d}-{tag}", data.nbytes)
        inp = module.InferInput("INPUT0", list(data.shape), "UINT8")
        inp.set_shared_memory(f"big-in-{tag}", data.nbytes)
        out = module.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(f"big-out-{tag}", data.nbytes)
        client.infer("identity_uint8", [inp], outputs=[out])
        got = shm.get_contents_as_numpy(handles[1], np.uint8, list(data.shape))
        np.testing.assert_array_equal(got, data)
    finally:
        for d in ("big-in", "big-out"):
            client.unregister_system_shared_memory(f"{d}-{tag}")
        for h in handles:
            shm.destroy_shared_memory_region(h)


@pytest.mark.perf
def test_perf_analyzer_with_system_shared_memory(stack: RunningStack) -> None:
    analyzer = find_perf_analyzer()
    if analyzer is None:
        if os.environ.get("CI"):
            pytest.fail("perf_analyzer missing in CI: scripts/test.sh must install it")
        pytest.skip("perf_analyzer not installed (scripts/install_perf_analyzer.sh)")
    before = stack.client().get_inference_statistics("bench_identity").model_stats[0]
    result = run_perf(
        stack.url,
        "bench_identity",
        2,
        measurement_ms=1000,
        stability_pct=1000,  # a functional check, not a figure: any windows will do
        extra_args=["--max-trials", "3", "--shared-memory", "system"],
        analyzer=analyzer,
    )
    assert result.throughput > 0
    after = stack.client().get_inference_statistics("bench_identity").model_stats[0]
    assert after.inference_stats.success.count > before.inference_stats.success.count
