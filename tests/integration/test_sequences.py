"""The sequence batcher through tritonclient: controls, implicit state in Redis,
interleaved sequences, errors, and a scheduler restarted mid-sequence."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve.generated import grpc_service_pb2 as gs
from stageserve_tools.examples import write_accumulator
from tests.integration.helpers import two_paths
from tests.stack import RunningStack, running_stack, wait_until


@pytest.fixture(scope="module")
def seq_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("sequence_repository")
    write_accumulator(root, "acc_oldest", strategy="oldest")
    write_accumulator(root, "acc_direct", strategy="direct", max_batch_size=4)
    write_accumulator(root, "acc_string", corrid_type="BYTES")
    write_accumulator(root, "acc_idle", idle_us=300_000)
    write_accumulator(root, "acc_fp32", control_type="FP32")
    write_accumulator(root, "acc_bool", control_type="BOOL")
    with running_stack(root) as running:
        yield running


def send(client, model: str, value: int, seq, start=False, end=False):
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return client.infer(
        model, [inp], sequence_id=seq, sequence_start=start, sequence_end=end, client_timeout=30
    )


@pytest.mark.parametrize("model", ["acc_oldest", "acc_direct"])
def test_accumulates_per_sequence_and_fills_controls(seq_stack: RunningStack, model) -> None:
    client = seq_stack.client()
    values = [3, 4, 5]
    total = 0
    for i, v in enumerate(values):
        start, end = i == 0, i == len(values) - 1
        r = send(client, model, v, 1001, start, end)
        total += v
        assert r.as_numpy("OUTPUT")[0, 0] == total
        assert r.as_numpy("START_OUT")[0, 0] == int(start)
        assert r.as_numpy("END_OUT")[0, 0] == int(end)
        assert r.as_numpy("READY_OUT")[0, 0] == 1
        assert r.as_numpy("CORRID_OUT")[0, 0] == 1001
        names = {o.name for o in r.get_response().outputs}
        assert "ACC_OUT" not in names  # implicit state is not an output


def test_string_correlation_ids(seq_stack: RunningStack) -> None:
    client = seq_stack.client()
    send(client, "acc_string", 10, "user-a", start=True)
    send(client, "acc_string", 1, "user-b", start=True)
    r = send(client, "acc_string", 5, "user-a", end=True)
    assert r.as_numpy("OUTPUT")[0, 0] == 15
    assert r.as_numpy("CORRID_OUT")[0, 0] == b"user-a"
    r = send(client, "acc_string", 2, "user-b", end=True)
    assert r.as_numpy("OUTPUT")[0, 0] == 3


def test_non_start_request_for_unknown_sequence_is_rejected(seq_stack: RunningStack) -> None:
    client = seq_stack.client()
    with pytest.raises(InferenceServerException) as exc:
        send(client, "acc_oldest", 1, 777_777)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "START" in exc.value.message()


def test_missing_correlation_id_is_rejected(seq_stack: RunningStack) -> None:
    client = seq_stack.client()
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("acc_oldest", [inp])
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "correlation ID" in exc.value.message()


def test_start_on_active_sequence_starts_over(seq_stack: RunningStack) -> None:
    client = seq_stack.client()
    send(client, "acc_oldest", 50, 2002, start=True)
    send(client, "acc_oldest", 50, 2002)
    r = send(client, "acc_oldest", 7, 2002, start=True)
    assert r.as_numpy("OUTPUT")[0, 0] == 7


def test_idle_sequence_expires(seq_stack: RunningStack) -> None:

    client = seq_stack.client()
    send(client, "acc_idle", 1, 3003, start=True)
    time.sleep(0.6)  # max_sequence_idle_microseconds is 300 ms
    with pytest.raises(InferenceServerException) as exc:
        send(client, "acc_idle", 1, 3003)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"


@pytest.mark.parametrize("model", ["acc_oldest", "acc_direct"])
def test_interleaved_sequences_under_concurrency(seq_stack: RunningStack, model) -> None:
    n_seq, steps = 12, 8

    def run(seq: int) -> list[int]:
        client = grpcclient.InferenceServerClient(seq_stack.url)
        outs = []
        for step in range(steps):
            r = send(client, model, seq + step, 50_000 + seq, step == 0, step == steps - 1)
            outs.append(int(r.as_numpy("OUTPUT")[0, 0]))
        return outs

    with ThreadPoolExecutor(n_seq) as pool:
        results = list(pool.map(run, range(n_seq)))
    for seq, outs in enumerate(results):
        expected = np.cumsum([seq + step for step in range(steps)]).tolist()
        assert outs == expected, seq
    stats = seq_stack.client().get_inference_statistics(model).model_stats[0]
    assert stats.execution_count < stats.inference_count  # sequences shared batches


def test_sequence_over_a_stream(seq_stack: RunningStack) -> None:
    client = seq_stack.client()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for step, v in enumerate([1, 2, 3, 4]):
            inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[v]], dtype=np.int32))
            client.async_stream_infer(
                "acc_oldest",
                [inp],
                sequence_id=4004,
                sequence_start=step == 0,
                sequence_end=step == 3,
                request_id=str(step),
            )
        outs = {}
        for _ in range(4):
            result, error = results.get(timeout=30)
            assert error is None
            outs[result.get_response().id] = int(result.as_numpy("OUTPUT")[0, 0])
    finally:
        client.stop_stream()
    assert outs == {"0": 1, "1": 3, "2": 6, "3": 10}


def test_restarted_scheduler_continues_the_sequence(tmp_path: Path) -> None:
    # A long idle timeout: the restart itself takes a few seconds (the dead
    # scheduler's grant has to expire first).
    write_accumulator(tmp_path, "acc", strategy="oldest", idle_us=60_000_000)
    with running_stack(tmp_path) as running:
        client = running.client()
        send(client, "acc", 5, 9009, start=True)
        send(client, "acc", 6, 9009)
        old = running.scheduler
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait(10)
        # A new scheduler on the same address: the gateway reconnects to it.
        host, port = old.address.rsplit(":", 1)
        new = running.stack.start_service(
            "scheduler-2",
            [
                "scheduler",
                "--listen",
                f"127.0.0.1:{port}",
                "--redis-url",
                running.redis_url,
                "--ratelimiter",
                running.ratelimiter.address,
            ],
        )
        assert new.address.endswith(port)
        r = None
        for _ in range(20):  # the gateway's stream reconnects on the next request
            try:
                r = send(client, "acc", 7, 9009, end=True)
                break
            except InferenceServerException as exc:
                assert exc.status() == "StatusCode.UNAVAILABLE"
        assert r is not None and r.as_numpy("OUTPUT")[0, 0] == 18


def test_two_schedulers_share_sequences(tmp_path: Path) -> None:
    """A second gateway + scheduler on the same Redis: requests of one sequence
    alternate between the two paths and still accumulate in order."""
    write_accumulator(tmp_path, "acc", strategy="oldest", idle_us=60_000_000)
    with two_paths(tmp_path) as (running, _, client_b):
        clients = [running.client(), client_b]
        total = 0
        for step in range(10):
            r = send(clients[step % 2], "acc", step + 1, 7007, step == 0, step == 9)
            total += step + 1
            assert r.as_numpy("OUTPUT")[0, 0] == total
        # Both paths executed half of the sequence: each gateway's own share,
        # as published to Redis, is 5 (ModelStatistics answers the total, 10).
        r = redis.Redis.from_url(running.redis_url)
        # Gateways publish their shares every stats_publish_s (1 s): wait for it.
        assert wait_until(lambda: list(r.scan_iter("ss:stats:acc:*")))
        (key,) = list(r.scan_iter("ss:stats:acc:*"))

        def shares() -> list[int]:
            return [gs.ModelStatistics.FromString(v).inference_count for v in r.hvals(key)]

        assert wait_until(lambda: shares() == [5, 5]), shares()
        for c in clients:
            assert c.get_inference_statistics("acc").model_stats[0].inference_count == 10


def test_initial_state_from_data_file(tmp_path: Path) -> None:
    """initial_state { data_file } seeds a sequence's state at START."""
    import onnx
    from onnx import helper

    from stageserve_tools.examples import make_model, write_model

    i32 = onnx.TensorProto.INT32
    vi = [helper.make_tensor_value_info(n, i32, ["batch", 1]) for n in ("INPUT", "STATE_IN")]
    outs = [helper.make_tensor_value_info(n, i32, ["batch", 1]) for n in ("OUTPUT", "STATE_OUT")]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["STATE_IN", "INPUT"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        "seeded",
        vi,
        outs,
    )
    config = """name: "seeded"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  oldest { }
  state [ {
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" name: "seed" }
  } ]
}
"""
    model_dir = write_model(tmp_path, "seeded", make_model(graph), config)
    (model_dir / "initial_state").mkdir()
    (model_dir / "initial_state" / "hundred").write_bytes(np.array([100], np.int32).tobytes())
    with running_stack(tmp_path) as running:
        client = running.client()
        assert send(client, "seeded", 1, 42, start=True).as_numpy("OUTPUT")[0, 0] == 101
        assert send(client, "seeded", 2, 42).as_numpy("OUTPUT")[0, 0] == 103
        # A new sequence starts from the file's value again.
        assert send(client, "seeded", 5, 43, start=True).as_numpy("OUTPUT")[0, 0] == 105


@pytest.mark.parametrize(
    ("model", "false", "true"), [("acc_fp32", 0.0, 1.0), ("acc_bool", False, True)]
)
def test_control_forms_fp32_and_bool(seq_stack: RunningStack, model, false, true) -> None:
    client = seq_stack.client()
    r = send(client, model, 4, 6006, start=True)
    assert r.as_numpy("OUTPUT")[0, 0] == 4
    assert r.as_numpy("START_OUT")[0, 0] == true
    assert r.as_numpy("END_OUT")[0, 0] == false
    assert r.as_numpy("READY_OUT")[0, 0] == true
    r = send(client, model, 6, 6006, end=True)
    assert r.as_numpy("OUTPUT")[0, 0] == 10
    assert r.as_numpy("START_OUT")[0, 0] == false
    assert r.as_numpy("END_OUT")[0, 0] == true
