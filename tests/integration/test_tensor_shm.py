"""Tensor bytes through shared memory between gateway and worker (issue 26 item 3).

One stack with the stack's `tensor_shm` on: the 49 KB identity (FP32
[3, 64, 64]) answers byte-exact on both fronts and through the dynamic
batcher, client system shared memory still works, and every slot of every
region is free again after requests, after a request refused once its first
input was in the gateway's region, after a client gives up mid-request and
after kill -9 of the worker.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from bench.chaos_audit import tensor_slots_in_use
from stageserve.tensor_region import SHM_DIR, slots_in_use
from stageserve.tensor_shm import stack_id
from stageserve_tools.examples import config_text, make_model, write_identity, write_model
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import RunningStack, running_stack, wait_until

DIMS = (3, 64, 64)
SLOW_MS = 800


def write_small_and_large(root: Path) -> None:
    """`small_and_large`: INPUT0 FP32 [16] -> OUTPUT0 and INPUT1 FP32
    [3, 64, 64] -> OUTPUT1, each unchanged: an answer with a small output
    beside a large one (the large one's bytes go apart from protobuf)."""
    f = onnx.TensorProto.FLOAT
    small: list[str | int] = ["b", 16]
    large: list[str | int] = ["b", *DIMS]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"]),
            onnx.helper.make_node("Identity", ["INPUT1"], ["OUTPUT1"]),
        ],
        "small_and_large",
        [
            onnx.helper.make_tensor_value_info("INPUT0", f, small),
            onnx.helper.make_tensor_value_info("INPUT1", f, large),
        ],
        [
            onnx.helper.make_tensor_value_info("OUTPUT0", f, small),
            onnx.helper.make_tensor_value_info("OUTPUT1", f, large),
        ],
    )
    text = config_text(
        "small_and_large",
        [("INPUT0", "FP32", (16,)), ("INPUT1", "FP32", DIMS)],
        [("OUTPUT0", "FP32", (16,)), ("OUTPUT1", "FP32", DIMS)],
        max_batch_size=8,
        dynamic_batching=True,
    )
    write_model(root, "small_and_large", make_model(graph), text)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("shm_repo")
    write_identity(root, "identity_49k", "FP32", DIMS, max_batch_size=32)
    write_small_and_large(root)
    slow = write_identity(root, "identity_49k_slow", "FP32", DIMS, max_batch_size=32)
    with open(slow / "config.pbtxt", "a") as config:
        config.write(
            f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{SLOW_MS}" }} }}\n'
        )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGESERVE_STACK_TENSOR_SHM", "1")  # every stage, restarts too
        with running_stack(root) as s:
            yield s


def in_use(stack: RunningStack) -> dict[str, int]:
    return slots_in_use(stack_id(stack.redis_url))


def all_free(stack: RunningStack) -> bool:
    return tensor_slots_in_use(stack.redis_url) == 0  # the chaos audit's count


def data(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *DIMS), dtype=np.float32)


def grpc_infer(stack: RunningStack, x: np.ndarray, model: str = "identity_49k", **kw):
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return stack.client().infer(model, [inp], **kw)


def test_regions_exist_one_per_gateway_and_worker(stack: RunningStack) -> None:
    roles = sorted(name.split("-")[2] for name in in_use(stack))
    assert roles == ["gateway", "worker"]


def held_while_running(stack: RunningStack) -> bool:
    """A request to the slow model held slots while it ran (its input waits
    in the gateway's region): the gateway sends its models' tensors through
    shared memory (it sees the worker on its host within its refresh period)."""
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(grpc_infer, stack, data(2), "identity_49k_slow")
        held = wait_until(lambda: any(in_use(stack).values()), SLOW_MS / 1000 / 2)
        assert call.result(RPC_TIMEOUT_S).as_numpy("OUTPUT0").tobytes() == data(2).tobytes()
    return held


def test_a_request_holds_slots_while_it_runs(stack: RunningStack) -> None:
    assert wait_until(lambda: held_while_running(stack), 10, 0)
    assert wait_until(lambda: all_free(stack), 5)


def test_49k_identity_is_byte_exact_on_grpc_and_http(stack: RunningStack) -> None:
    x = data(1)
    out = grpc_infer(stack, x, client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
    assert out.tobytes() == x.tobytes()
    http_url = stack.gateway.http_address
    with httpclient.InferenceServerClient(http_url) as client:
        for binary in (True, False):
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("identity_49k", [inp])
            assert result.as_numpy("OUTPUT0").tobytes() == x.tobytes()
    assert wait_until(lambda: all_free(stack), 5)


@pytest.mark.parametrize("order", [("OUTPUT0", "OUTPUT1"), ("OUTPUT1", "OUTPUT0")])
def test_a_small_output_beside_a_large_one_on_both_fronts(
    stack: RunningStack, order: tuple[str, str]
) -> None:
    """Each output in its place whichever comes first: on gRPC the outputs
    from the first large one on go out apart from the message, on HTTP
    they are encoded from beside it."""
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    large = data(3)
    g = [
        grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
        grpcclient.InferInput("INPUT1", list(large.shape), "FP32"),
    ]
    g[0].set_data_from_numpy(small)
    g[1].set_data_from_numpy(large)
    wanted = [grpcclient.InferRequestedOutput(name) for name in order]
    result = stack.client().infer(
        "small_and_large", g, outputs=wanted, client_timeout=RPC_TIMEOUT_S
    )
    assert [o.name for o in result.get_response().outputs] == list(order)
    assert result.as_numpy("OUTPUT0").tobytes() == small.tobytes()
    assert result.as_numpy("OUTPUT1").tobytes() == large.tobytes()
    h = [
        httpclient.InferInput("INPUT0", [1, 16], "FP32"),
        httpclient.InferInput("INPUT1", list(large.shape), "FP32"),
    ]
    h[0].set_data_from_numpy(small, binary_data=True)
    h[1].set_data_from_numpy(large, binary_data=True)
    client = httpclient.InferenceServerClient(stack.gateway.http_address, network_timeout=30)
    try:
        answer = client.infer(
            "small_and_large",
            h,
            outputs=[httpclient.InferRequestedOutput(name, binary_data=True) for name in order],
        )
    finally:
        client.close()
    assert answer.as_numpy("OUTPUT0").tobytes() == small.tobytes()
    assert answer.as_numpy("OUTPUT1").tobytes() == large.tobytes()
    assert wait_until(lambda: all_free(stack), 5)


def test_slots_free_after_a_request_refused_past_a_placed_input(stack: RunningStack) -> None:
    # The gateway puts INPUT0's 49 KB in its region as validation passes it;
    # the unknown input after it then refuses the request.
    assert wait_until(lambda: held_while_running(stack), 10, 0)
    x = data(9)
    inputs = []
    for name in ("INPUT0", "EXTRA"):
        inp = grpcclient.InferInput(name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        inputs.append(inp)
    with pytest.raises(InferenceServerException, match="unexpected inference input 'EXTRA'"):
        stack.client().infer("identity_49k", inputs, client_timeout=RPC_TIMEOUT_S)
    assert wait_until(lambda: all_free(stack), 5)


def test_dynamic_batch_of_many_requests_is_right(stack: RunningStack) -> None:
    xs = [data(100 + i, batch=1 + i % 3) for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        outs = list(
            pool.map(
                lambda x: grpc_infer(stack, x, client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0"),
                xs,
            )
        )
    for x, out in zip(xs, outs, strict=True):
        assert out.tobytes() == x.tobytes()
    stats = stack.client().get_inference_statistics("identity_49k", as_json=True)
    model = stats["model_stats"][0]
    assert int(model["execution_count"]) < int(model["inference_count"])  # batched
    assert wait_until(lambda: all_free(stack), 5)


def test_client_system_shared_memory_in_and_out(stack: RunningStack) -> None:
    x = data(7)
    tag = uuid.uuid4().hex[:8]
    nbytes = x.nbytes
    region_in = shm.create_shared_memory_region(f"in-{tag}", f"/ssts-in-{tag}", nbytes)
    region_out = shm.create_shared_memory_region(f"out-{tag}", f"/ssts-out-{tag}", nbytes)
    client = stack.client()
    try:
        shm.set_shared_memory_region(region_in, [x])
        client.register_system_shared_memory(f"in-{tag}", f"/ssts-in-{tag}", nbytes)
        client.register_system_shared_memory(f"out-{tag}", f"/ssts-out-{tag}", nbytes)
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory(f"in-{tag}", nbytes)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(f"out-{tag}", nbytes)
        result = client.infer("identity_49k", [inp], outputs=[out])
        assert result.get_output("OUTPUT0") is not None
        got = shm.get_contents_as_numpy(region_out, np.float32, list(x.shape))
        assert got.tobytes() == x.tobytes()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)
    assert wait_until(lambda: all_free(stack), 5)


def test_slots_free_after_client_gives_up_mid_request(stack: RunningStack) -> None:
    with pytest.raises(InferenceServerException, match="Deadline"):
        grpc_infer(stack, data(3), "identity_49k_slow", client_timeout=0.3)
    # One instance: this request runs after the abandoned one, whose answer
    # (outputs in the worker's region, for a request that is gone) reached
    # the gateway first.
    x = data(4)
    out = grpc_infer(stack, x, "identity_49k_slow", client_timeout=RPC_TIMEOUT_S)
    assert out.as_numpy("OUTPUT0").tobytes() == x.tobytes()
    assert wait_until(lambda: all_free(stack), 5)


def test_slots_free_after_worker_kill_9(stack: RunningStack) -> None:
    worker = stack.workers[0]
    worker_region = next(n for n in in_use(stack) if "-worker-" in n)
    with ThreadPoolExecutor(4) as pool:
        calls = [
            pool.submit(grpc_infer, stack, data(50 + i), "identity_49k_slow", client_timeout=30)
            for i in range(4)
        ]
        assert wait_until(lambda: any(in_use(stack).values()), 5)
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        for call in calls:
            with pytest.raises(InferenceServerException):
                call.result(30)
    assert wait_until(lambda: all_free(stack), 10)
    assert not (SHM_DIR / worker_region).exists()  # the dead worker's region is swept
    stack.start_worker("worker-after-kill")
    x = data(9)
    assert wait_until(lambda: _answers(stack, x), 60)
    assert wait_until(lambda: all_free(stack), 5)


def _answers(stack: RunningStack, x: np.ndarray) -> bool:
    try:
        out = grpc_infer(stack, x, client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
    except InferenceServerException:
        return False
    return out.tobytes() == x.tobytes()
