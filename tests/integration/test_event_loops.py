"""Every stage on uvloop's event loop (the default) and on asyncio's
(STAGESERVE_STACK_EVENT_LOOP=asyncio): each stage process runs on the loop
asked for, and a client gets the same answers from either stack: a 49 KB
tensor through the gRPC and the HTTP fronts (the shared-memory path), a
sequence's state across requests, and a decoupled Python model's stream.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from stageserve_tools.examples import write_accumulator, write_identity, write_py_stream
from tests.stack import RunningStack, running_stack

DIMS = (3, 64, 64)  # 49,152 bytes of FP32: through the tensor regions


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp(f"loop_{request.param}")
    write_identity(root, "identity_49k", "FP32", DIMS, max_batch_size=32)
    write_accumulator(root, "acc")
    write_py_stream(root)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGESERVE_STACK_EVENT_LOOP", request.param)
        with running_stack(root) as running:
            yield running


def maps_uvloop(pid: int) -> bool:
    """Whether the process has uvloop's compiled loop mapped (uvloop imported)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any("/uvloop/loop." in line for line in maps.splitlines())


def test_every_stage_runs_on_the_loop_asked_for(
    stack: RunningStack, request: pytest.FixtureRequest
) -> None:
    on_uvloop = request.node.callspec.params["stack"] == "uvloop"
    stages = [stack.gateway, stack.scheduler, stack.ratelimiter, *stack.workers]
    assert {c.name: maps_uvloop(c.proc.pid) for c in stages} == {c.name: on_uvloop for c in stages}


def test_a_49k_tensor_comes_back_byte_exact_on_both_fronts(stack: RunningStack) -> None:
    x = np.random.default_rng(5).standard_normal((2, *DIMS), dtype=np.float32)
    g = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    g.set_data_from_numpy(x)
    with stack.client() as client:
        out = client.infer("identity_49k", [g], client_timeout=30).as_numpy("OUTPUT0")
    assert out.tobytes() == x.tobytes()
    h = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    h.set_data_from_numpy(x, binary_data=True)
    client_h = httpclient.InferenceServerClient(stack.gateway.http_address, network_timeout=30)
    try:
        out = client_h.infer("identity_49k", [h]).as_numpy("OUTPUT0")
    finally:
        client_h.close()
    assert out.tobytes() == x.tobytes()


def test_a_sequence_keeps_its_state(stack: RunningStack) -> None:
    totals = []
    with stack.client() as client:
        for i, value in enumerate((3, 4, 5)):
            inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            result = client.infer(
                "acc",
                [inp],
                sequence_id=4242,
                sequence_start=i == 0,
                sequence_end=i == 2,
                client_timeout=30,
            )
            totals.append(int(result.as_numpy("OUTPUT")[0, 0]))
    assert totals == [3, 7, 12]


def test_a_decoupled_model_streams_every_response(stack: RunningStack) -> None:
    answers: queue.Queue = queue.Queue()
    with stack.client() as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            inp = grpcclient.InferInput("IN", [2], "INT32")
            inp.set_data_from_numpy(np.array([3, 10], dtype=np.int32))
            client.async_stream_infer("py_stream", [inp], request_id="s1")
            got = []
            for _ in range(3):
                result, error = answers.get(timeout=30)
                assert error is None, error
                got.append(int(result.as_numpy("OUT")[0]))
        finally:
            client.stop_stream()
    assert got == [0, 1, 2]
