"""Ragged batching through the real stack and tritonclient.

The `ragged_sum` example takes a ragged INPUT (allow_ragged_batch), two batch
inputs the worker computes (BATCH_ITEM_SHAPE_FLATTEN and
BATCH_ACCUMULATED_ELEMENT_COUNT) and scatters RUNNING_SUM back with each
request's INPUT shape (BATCH_SCATTER_WITH_INPUT_SHAPE). SUM is right only if
the item lengths were, RUNNING_SUM only if the request boundaries were, so
every answer checks the batch the server formed. Models with invalid ragged
configs are UNAVAILABLE with the reason while the rest serves.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from stageserve_tools.examples import (
    ragged_sum_config,
    ragged_sum_model,
    write_model,
    write_ragged_sum,
)
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    expect_error,
    index_states,
    model_grants,
    model_stats,
    sole_request_in_a_batch,
    stack_retrying,
    tensor_input,
)
from tests.stack import RunningStack, wait_until

INVALID = "StatusCode.INVALID_ARGUMENT"
UNAVAILABLE = "StatusCode.UNAVAILABLE"
DELAY_MS = 300

_GOOD = ragged_sum_config("NAME")
_ENDS = """,
  {
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "REQUEST_ENDS"
    data_type: TYPE_INT32
    source_input: "INPUT"
  }"""
assert _ENDS in _GOOD

#: broken model -> (its config.pbtxt, fragments the load error must name)
BROKEN: dict[str, tuple[str, tuple[str, ...]]] = {
    "bad_ragged_nobatch": (
        _GOOD.replace("max_batch_size: 8", "max_batch_size: 0").replace(
            "dynamic_batching { max_queue_delay_microseconds: 0 }", ""
        ),
        ("allow_ragged_batch", "INPUT", "max_batch_size > 0"),
    ),
    "bad_batch_input_source": (
        _GOOD.replace('source_input: "INPUT"', 'source_input: "NOPE"', 1),
        ("BATCH_ITEM_SHAPE_FLATTEN", "unknown source_input 'NOPE'"),
    ),
    "bad_batch_input_kind": (
        _GOOD.replace("kind: BATCH_ITEM_SHAPE_FLATTEN", "kind: 42"),
        ("unknown batch input kind 42",),
    ),
    "bad_batch_input_type": (
        _GOOD.replace("data_type: TYPE_INT32", "data_type: TYPE_INT64", 1),
        ("TYPE_INT32 or TYPE_FP32", "TYPE_INT64"),
    ),
    "bad_batch_input_sources": (
        _GOOD.replace('source_input: "INPUT"', 'source_input: [ "INPUT", "INPUT" ]', 1),
        ("expects 1 source_input, got 2",),
    ),
    "bad_batch_input_target": (
        _GOOD.replace('target_name: "ITEM_LENGTHS"', 'target_name: "INPUT"'),
        ("target_name 'INPUT' is also a declared input",),
    ),
    "bad_batch_output_target": (
        _GOOD.replace('target_name: "RUNNING_SUM"', 'target_name: "NOPE"'),
        ("batch_output", "unknown target output(s) ['NOPE']"),
    ),
    "bad_batch_output_source": (
        _GOOD.replace(
            'kind: BATCH_SCATTER_WITH_INPUT_SHAPE\n    source_input: "INPUT"',
            'kind: BATCH_SCATTER_WITH_INPUT_SHAPE\n    source_input: "NOPE"',
        ),
        ("batch_output", "unknown source_input 'NOPE'"),
    ),
    # valid config, but the model file needs the batch input it no longer declares
    "bad_missing_batch_input": (_GOOD.replace(_ENDS, ""), ("REQUEST_ENDS",)),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ragged_repository")
    write_ragged_sum(root, "ragged_sum")
    slow = f'parameters {{ key: "execute_delay_ms" value: {{ string_value: "{DELAY_MS}" }} }}'
    write_ragged_sum(root, "ragged_slow", extra=slow)
    model = ragged_sum_model()
    for name, (text, _) in BROKEN.items():
        assert text != _GOOD, name
        write_model(root, name, model, text.replace('"NAME"', f'"{name}"'))
    return root


@pytest.fixture(scope="module")
def stack(repo: Path) -> Iterator[RunningStack]:
    # stage_metrics: the scheduler's queue depth says when a batch has left it
    with stack_retrying(repo, stage_metrics=True) as s:
        yield s


def _infer(c: grpcclient.InferenceServerClient, model: str, x: np.ndarray, **kwargs):
    return c.infer(
        model, [tensor_input("INPUT", x, "FP32")], client_timeout=RPC_TIMEOUT_S, **kwargs
    )


def _check(x: np.ndarray, result: grpcclient.InferResult) -> None:
    np.testing.assert_array_equal(result.as_numpy("SUM"), x.sum(axis=1, keepdims=True))
    running = result.as_numpy("RUNNING_SUM")
    assert running.shape == x.shape
    np.testing.assert_array_equal(running, np.cumsum(x.reshape(-1)).reshape(x.shape))


def _values(rows: int, length: int, seed: int) -> np.ndarray:
    # small integers: float32 sums are exact
    return np.random.default_rng(seed).integers(-9, 10, (rows, length)).astype(np.float32)


def test_single_ragged_requests(stack: RunningStack) -> None:
    c = stack.client()
    for seed, (rows, length) in enumerate([(1, 1), (1, 7), (3, 4), (8, 2)]):
        x = _values(rows, length, seed)
        _check(x, _infer(c, "ragged_sum", x))


def test_metadata_lists_only_request_inputs(stack: RunningStack) -> None:
    md = stack.client().get_model_metadata("ragged_sum", client_timeout=RPC_TIMEOUT_S)
    assert [(t.name, list(t.shape)) for t in md.inputs] == [("INPUT", [-1, -1])]
    assert [(t.name, list(t.shape)) for t in md.outputs] == [
        ("SUM", [-1, 1]),
        ("RUNNING_SUM", [-1, -1]),
    ]


def test_requests_of_different_lengths_share_a_batch(stack: RunningStack) -> None:
    """While the one instance runs a first request, requests of six different
    shapes queue up; the dynamic batcher sends them as one batch, and each
    still gets its own answer."""
    c = stack.client()
    before = model_stats(c, "ragged_slow")
    results: queue.Queue = queue.Queue()

    def send(k: int, x: np.ndarray) -> None:
        c.async_infer(
            "ragged_slow",
            [tensor_input("INPUT", x, "FP32")],
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error, k=k: results.put((k, result, error)),
        )

    shapes = [(1, 5), (1, 1), (1, 9), (2, 3), (1, 4), (1, 2), (1, 6)]  # 7 requests, 8 items
    xs = [_values(rows, length, 100 + k) for k, (rows, length) in enumerate(shapes)]
    assert wait_until(lambda: model_grants(stack, "ragged_slow") == 0, RPC_TIMEOUT_S)
    send(0, xs[0])
    # the first one is executing (DELAY_MS from its grant) when the others come
    assert wait_until(lambda: sole_request_in_a_batch(stack, "ragged_slow"), RPC_TIMEOUT_S, 0.005)
    for k in range(1, len(xs)):
        send(k, xs[k])
    for _ in xs:
        k, result, error = results.get(timeout=RPC_TIMEOUT_S)
        assert error is None, error
        _check(xs[k], result)

    after = model_stats(c, "ragged_slow")
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == sum(rows for rows, _ in shapes)
    assert executions < len(xs), "requests of different lengths should share executions"
    # the six requests (7 items) that queued behind the first ran as one batch
    sizes = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    assert sizes.get(7, 0) >= 1, sizes


def test_ragged_input_still_has_to_match_its_dims(stack: RunningStack) -> None:
    c = stack.client()
    expect_error(
        _infer,
        c,
        "ragged_sum",
        np.zeros((1, 2, 3), np.float32),
        status=INVALID,
        contains=("unexpected shape for input 'INPUT'", "[-1,-1]"),
    )
    expect_error(
        c.infer,
        "ragged_sum",
        [tensor_input("ITEM_LENGTHS", np.ones((1, 1), np.int32), "INT32")],
        client_timeout=RPC_TIMEOUT_S,
        status=INVALID,
        contains=("ITEM_LENGTHS",),
    )


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_invalid_ragged_configs_fail_to_load_with_the_reason(
    stack: RunningStack, name: str
) -> None:
    c = stack.client()
    states = index_states(c)
    assert name in states, sorted(states)
    fragments = BROKEN[name][1]
    for version, (state, reason) in states[name].items():
        assert state == "UNAVAILABLE", (name, version, state)
        for fragment in fragments:
            assert fragment in reason, (fragment, reason)
    assert not c.is_model_ready(name, client_timeout=RPC_TIMEOUT_S)
    expect_error(
        _infer,
        c,
        name,
        np.ones((1, 3), np.float32),
        status=(UNAVAILABLE, "StatusCode.NOT_FOUND"),  # Triton: NOT_FOUND "no available versions"
        contains=(name,),
    )
    # the valid ragged model keeps serving
    x = _values(1, 3, 7)
    _check(x, _infer(c, "ragged_sum", x))
