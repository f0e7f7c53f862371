"""The gateway's gRPC front on its own HTTP/2 server (stageserve/h2grpc, the default) and
on grpc.aio's (STAGESERVE_GATEWAY_GRPC_SERVER=grpcio): a client sees the same answers.
The internal stages' ports follow the same choice (STAGESERVE_SCHEDULER_GRPC_SERVER,
STAGESERVE_RATELIMITER_GRPC_SERVER, STAGESERVE_WORKER_GRPC_SERVER), so every internal
stream crosses both servers too, dialled by the stages' own HTTP/2 client (the default;
tests/unit/test_transport.py runs the streams on grpc.aio's client).

Two stacks on one repository, one per server; each check makes the same calls to both with
tritonclient and compares what comes back: results, status codes and messages, streamed
responses and errors. Where the two differ (an unknown method), real Triton 2.51 is the
referee.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import write_identity
from tests.integration.helpers import RPC_TIMEOUT_S, skip_if_triton_crashed, triton_grpc
from tests.stack import RunningStack, running_stack

SERVERS = ("h2", "grpcio")
STAGES = ("GATEWAY", "SCHEDULER", "RATELIMITER", "WORKER")
DIMS = (3, 64, 64)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    root = tmp_path_factory.mktemp("front_servers_repo")
    write_identity(root, "identity_fp32", "FP32", (-1,), max_batch_size=64)
    write_identity(root, "identity_49k", "FP32", DIMS, max_batch_size=32)
    with pytest.MonkeyPatch.context() as env:
        for stage in STAGES:
            env.setenv(f"STAGESERVE_{stage}_GRPC_SERVER", "h2")
        with running_stack(root) as own:
            for stage in STAGES:
                env.setenv(f"STAGESERVE_{stage}_GRPC_SERVER", "grpcio")
            with running_stack(root) as grpcio:
                yield {"h2": own, "grpcio": grpcio}


def infer(stack: RunningStack, model: str, x: np.ndarray, **kwargs: Any) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with stack.client() as client:
        result = client.infer(model, [inp], client_timeout=RPC_TIMEOUT_S, **kwargs)
    return result.as_numpy("OUTPUT0")


def error_of(call: Any) -> tuple[str | None, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def test_inference_is_byte_exact_on_both(stacks: dict[str, RunningStack]) -> None:
    rng = np.random.default_rng(3)
    small = rng.standard_normal((4, 100), dtype=np.float32)
    large = rng.standard_normal((2, *DIMS), dtype=np.float32)
    for name in SERVERS:
        stack = stacks[name]
        assert infer(stack, "identity_fp32", small).tobytes() == small.tobytes(), name
        assert infer(stack, "identity_49k", large).tobytes() == large.tobytes(), name
        for algorithm in ("gzip", "deflate"):
            out = infer(stack, "identity_49k", large, compression_algorithm=algorithm)
            assert out.tobytes() == large.tobytes(), (name, algorithm)


def test_many_concurrent_requests_each_get_their_own_answer(
    stacks: dict[str, RunningStack],
) -> None:
    def one(args: tuple[str, int]) -> bool:
        name, seed = args
        x = np.random.default_rng(seed).standard_normal((1, 16), dtype=np.float32)
        return infer(stacks[name], "identity_fp32", x).tobytes() == x.tobytes()

    jobs = [(name, seed) for name in SERVERS for seed in range(64)]
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, jobs))


def test_errors_carry_the_same_status_and_message(stacks: dict[str, RunningStack]) -> None:
    x = np.zeros((1, 8), dtype=np.float32)
    wrong = np.zeros((1, 3, 64, 65), dtype=np.float32)
    seen = {}
    for name in SERVERS:
        stack = stacks[name]
        seen[name] = (
            error_of(lambda s=stack: infer(s, "no_such_model", x)),
            error_of(lambda s=stack: infer(s, "identity_49k", wrong)),
            error_of(lambda s=stack: s.client().get_model_metadata("no_such_model")),
        )
    assert seen["h2"] == seen["grpcio"]
    assert seen["h2"][0][0] == "StatusCode.NOT_FOUND"
    assert seen["h2"][1][0] == "StatusCode.INVALID_ARGUMENT"


def unknown_method(url: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=RPC_TIMEOUT_S)
    return info.value.code(), info.value.details()


def test_an_unknown_method_is_unimplemented_as_on_triton(
    stacks: dict[str, RunningStack], tmp_path: Path
) -> None:
    """Triton's C++ server answers UNIMPLEMENTED with no message; the own server
    does the same, grpc.aio's adds "Method not found!"."""
    stack = stacks["h2"]
    empty = tmp_path / "repository"  # the Triton here has no ONNX Runtime backend
    empty.mkdir()
    with (
        triton_grpc(empty, tmp_path, []) as url,
        skip_if_triton_crashed(url),
    ):
        triton = unknown_method(url)
    assert triton == (grpc.StatusCode.UNIMPLEMENTED, "")
    assert unknown_method(stack.url) == triton
    assert unknown_method(stacks["grpcio"].url) == (
        grpc.StatusCode.UNIMPLEMENTED,
        "Method not found!",
    )


def test_stream_infer_answers_the_same_on_both(stacks: dict[str, RunningStack]) -> None:
    answers = {}
    for name in SERVERS:
        results: queue.Queue[Any] = queue.Queue()
        with stacks[name].client() as client:
            client.start_stream(callback=lambda result, error, q=results: q.put((result, error)))
            for i in range(5):
                x = np.full((1, 4), i, dtype=np.float32)
                inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                client.async_stream_infer("identity_fp32", [inp], request_id=str(i))
            client.async_stream_infer("no_such_model", [inp], request_id="bad")
            got = [results.get(timeout=RPC_TIMEOUT_S) for _ in range(6)]
            client.stop_stream()
        ok = sorted(
            (r.get_response().id, r.as_numpy("OUTPUT0").tolist()) for r, e in got if e is None
        )
        errors = [str(e) for _, e in got if e is not None]
        answers[name] = (ok, errors)
        assert len(ok) == 5 and len(errors) == 1, name
    assert answers["h2"] == answers["grpcio"]
