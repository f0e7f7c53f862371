"""Batch padding and shape warm-up through the whole stack (ONNX Runtime on
the CPU, padding asked for with the pad_batch parameter).

The model answers INPUT + the number of rows its session ran, so each
answer shows whether the formed batch was padded. Three concurrent requests
form one batch of 3 (preferred sizes [4, 8] are not reached before the
queue delay ends): padded, the session sees 4 and each request still gets
exactly its own rows; unpadded, it sees 3. The statistics count the real
requests and the configured model_warmup sample, never the padded rows nor
the automatic shape warm-ups (sizes 4 and 8), whose log line the worker
writes before the model is READY.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import batch_size_model, write_model, write_ragged_sum
from tests.integration.helpers import RPC_TIMEOUT_S, model_stats, tensor_input
from tests.stack import RunningStack

QUEUE_DELAY_US = 1_000_000  # long enough for three async requests to join one batch

CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: {delay} }}
parameters {{ key: "pad_batch" value {{ string_value: "{pad}" }} }}
"""

WARMUP = """model_warmup [ { name: "configured" batch_size: 2
  inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
"""

PAD = 'parameters { key: "pad_batch" value { string_value: "true" } }\n'


@pytest.fixture(scope="module")
def padded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningStack, Path]]:
    root = tmp_path_factory.mktemp("batch_padding")
    repo, log_file = root / "repo", root / "stack.log"
    model = batch_size_model(2)
    for name, pad, extra in (("padded", "true", WARMUP), ("unpadded", "false", "")):
        text = CONFIG.format(name=name, delay=QUEUE_DELAY_US, pad=pad) + extra
        write_model(repo, name, model, text)
    write_ragged_sum(repo, "padded_ragged", extra=PAD)
    stack = Stack(log_argv=["--log-file", str(log_file)])
    try:
        s = start_services(stack, repo, device="cpu")
        running = RunningStack(
            stack, s.redis_url, s.ratelimiter, s.scheduler, s.gateway, s.workers, repo
        )
        yield running, log_file
    finally:
        stack.stop()


def _three_at_once(s: RunningStack, model: str) -> list[np.ndarray]:
    """Three concurrent requests of one row each; their OUTPUTs in send order."""
    c = s.client()
    results: queue.Queue = queue.Queue()
    xs = [np.full((1, 2), 100 * (k + 1), np.float32) for k in range(3)]
    for k, x in enumerate(xs):
        c.async_infer(
            model,
            [tensor_input("INPUT", x, "FP32")],
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error, k=k: results.put((k, result, error)),
        )
    out: dict[int, np.ndarray] = {}
    for _ in xs:
        k, result, error = results.get(timeout=RPC_TIMEOUT_S)
        assert error is None, error
        out[k] = result.as_numpy("OUTPUT")
    return [out[k] - xs[k] for k in range(3)]  # what each saw added: the session's rows


def _log_entries(log_file: Path, message: str) -> list[dict]:
    """The structured fields of every `message` line (JSON or text format)."""
    entries = []
    for line in log_file.read_text().splitlines():
        if message not in line:
            continue
        if line.startswith("{"):
            entries.append(json.loads(line))
        else:
            entries.append(json.loads(line[line.index("{", line.index(message)) :]))
    return entries


def test_a_padded_batch_runs_at_the_allowed_size_and_answers_only_real_rows(
    padded_stack: tuple[RunningStack, Path],
) -> None:
    s, _ = padded_stack
    c = s.client()
    before = model_stats(c, "padded")
    seen = _three_at_once(s, "padded")
    # every request got exactly its own row back, computed in a batch of 4
    assert [a.tolist() for a in seen] == [[[4.0, 4.0]]] * 3
    after = model_stats(c, "padded")
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 1
    sizes = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    assert sizes.get(3) == 1 and 4 not in sizes  # the real batch size, never the padded one


def test_without_padding_the_session_sees_the_formed_batch(
    padded_stack: tuple[RunningStack, Path],
) -> None:
    s, _ = padded_stack
    assert [a.tolist() for a in _three_at_once(s, "unpadded")] == [[[3.0, 3.0]]] * 3


def test_shape_warmups_run_before_ready_and_do_not_count(
    padded_stack: tuple[RunningStack, Path],
) -> None:
    s, log_file = padded_stack
    c = s.client()
    assert c.is_model_ready("padded")
    (done,) = [e for e in _log_entries(log_file, "shape warm-up done") if e["model"] == "padded"]
    assert done["shapes"] == [4, 8] and done["instances"] == 1 and done["seconds"] >= 0
    # a CPU model that does not pad is not warmed up by shape
    assert not [e for e in _log_entries(log_file, "shape warm-up done") if e["model"] != "padded"]
    # the worker registers the model (its "model loaded" line) only after the shape warm-ups
    lines = log_file.read_text().splitlines()
    warmed = [i for i, line in enumerate(lines) if "shape warm-up done" in line]
    loaded = [i for i, line in enumerate(lines) if "model loaded" in line and '"padded"' in line]
    assert len(warmed) == 1 and len(loaded) == 1 and warmed[0] < loaded[0]
    # only the configured model_warmup sample (batch 2) is counted, as Triton counts it
    st = model_stats(c, "padded")
    configured = {b.batch_size: b.compute_infer.count for b in st.batch_stats}
    assert configured.get(2) == 1 and 4 not in configured and 8 not in configured


def test_padding_asked_for_where_it_cannot_be_right_fails_the_load(
    padded_stack: tuple[RunningStack, Path],
) -> None:
    s, _ = padded_stack
    c = s.client()
    (row,) = [m for m in c.get_model_repository_index().models if m.name == "padded_ragged"]
    assert row.state == "UNAVAILABLE"
    assert "parameter pad_batch='true' cannot be honoured" in row.reason
    assert "ragged input(s) ['INPUT']" in row.reason
