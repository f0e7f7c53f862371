"""Ensembles through tritonclient: dataflow between steps, concurrency, errors,
nesting, statistics per composing model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import (
    ensemble_config,
    mlp_reference,
    mlp_weights,
    write_ensemble_mlp,
    write_identity,
    write_mlp,
    write_preprocess,
)
from tests.stack import RunningStack, running_stack


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {ins} {outs} }}'


def _write_ensemble(root, name: str, steps: list[str], inputs: str, outputs: str) -> None:
    d = root / name
    (d / "1").mkdir(parents=True)
    text = ensemble_config(name, "  step [ " + ", ".join(steps) + " ]", inputs, outputs)
    (d / "config.pbtxt").write_text(text)


FP32_256 = '{ name: "RAW" data_type: TYPE_FP32 dims: [ 256 ] }'


@pytest.fixture(scope="module")
def ens_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("ensemble_repository")
    write_mlp(root, "mlp", instance_count=2)
    write_preprocess(root, "preprocess")
    write_identity(root, "ident", "FP32", dims=(256,), max_batch_size=64)
    write_ensemble_mlp(root, "ensemble_mlp")
    # Two independent branches from one input, joined in the outputs.
    _write_ensemble(
        root,
        "fanout",
        [
            _step("preprocess", {"INPUT0": "RAW"}, {"OUTPUT0": "SCALED"}),
            _step("ident", {"INPUT0": "RAW"}, {"OUTPUT0": "COPY"}),
        ],
        FP32_256,
        '{ name: "SCALED" data_type: TYPE_FP32 dims: [ 256 ] },'
        ' { name: "COPY" data_type: TYPE_FP32 dims: [ 256 ] }',
    )
    # An ensemble whose step is an ensemble.
    _write_ensemble(
        root,
        "nested",
        [
            _step("ident", {"INPUT0": "RAW"}, {"OUTPUT0": "X"}),
            _step("ensemble_mlp", {"RAW": "X"}, {"PROBS": "PROBS"}),
        ],
        FP32_256,
        '{ name: "PROBS" data_type: TYPE_FP32 dims: [ 10 ] }',
    )
    # A step whose model rejects the tensor it is given (INT32 into FP32).
    write_identity(root, "ident_int", "INT32", dims=(256,), max_batch_size=64)
    _write_ensemble(
        root,
        "broken_wiring",
        [_step("ident_int", {"INPUT0": "RAW"}, {"OUTPUT0": "OUT"})],
        FP32_256,
        '{ name: "OUT" data_type: TYPE_INT32 dims: [ 256 ] }',
    )
    with running_stack(root) as running:
        yield running


def _raw(x: np.ndarray, name: str = "RAW") -> grpcclient.InferInput:
    i = grpcclient.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def test_preprocess_then_classifier(ens_stack: RunningStack) -> None:
    x = np.random.default_rng(1).random((3, 256)).astype(np.float32)
    probs = ens_stack.client().infer("ensemble_mlp", [_raw(x)]).as_numpy("PROBS")
    expected = mlp_reference((x - 0.5) * 2.0, mlp_weights())
    np.testing.assert_allclose(probs, expected, rtol=1e-4, atol=1e-6)


def test_independent_steps_and_both_outputs(ens_stack: RunningStack) -> None:
    x = np.random.default_rng(2).random((2, 256)).astype(np.float32)
    r = ens_stack.client().infer("fanout", [_raw(x)])
    np.testing.assert_allclose(r.as_numpy("SCALED"), (x - 0.5) * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("COPY"), x)


def test_requested_output_subset(ens_stack: RunningStack) -> None:
    x = np.zeros((1, 256), np.float32)
    r = ens_stack.client().infer(
        "fanout", [_raw(x)], outputs=[grpcclient.InferRequestedOutput("COPY")]
    )
    assert [o.name for o in r.get_response().outputs] == ["COPY"]


def test_nested_ensemble(ens_stack: RunningStack) -> None:
    x = np.random.default_rng(3).random((1, 256)).astype(np.float32)
    probs = ens_stack.client().infer("nested", [_raw(x)]).as_numpy("PROBS")
    np.testing.assert_allclose(
        probs, mlp_reference((x - 0.5) * 2.0, mlp_weights()), rtol=1e-4, atol=1e-6
    )


def test_step_error_fails_the_request_with_the_step_message(ens_stack: RunningStack) -> None:
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(InferenceServerException) as exc:
        ens_stack.client().infer("broken_wiring", [_raw(x)])
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ident_int" in exc.value.message() and "INT32" in exc.value.message()
    # The server keeps serving.
    ens_stack.client().infer("ensemble_mlp", [_raw(x)])


def test_statistics_per_composing_model(ens_stack: RunningStack) -> None:
    client = ens_stack.client()

    def counts() -> dict[str, int]:
        return {
            m: client.get_inference_statistics(m).model_stats[0].inference_stats.success.count
            for m in ("ensemble_mlp", "preprocess", "mlp")
        }

    before = counts()
    x = np.zeros((1, 256), np.float32)
    for _ in range(4):
        client.infer("ensemble_mlp", [_raw(x)])
    after = counts()
    assert {m: after[m] - before[m] for m in after} == {
        "ensemble_mlp": 4,
        "preprocess": 4,
        "mlp": 4,
    }


def test_ensemble_under_concurrent_load(ens_stack: RunningStack) -> None:
    rng = np.random.default_rng(4)
    inputs = [rng.random((1, 256)).astype(np.float32) for _ in range(120)]

    def one(x: np.ndarray) -> np.ndarray:
        c = grpcclient.InferenceServerClient(ens_stack.url)
        return c.infer("ensemble_mlp", [_raw(x)], client_timeout=60).as_numpy("PROBS")

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, inputs))
    weights = mlp_weights()
    for x, probs in zip(inputs, outs, strict=True):
        np.testing.assert_allclose(
            probs, mlp_reference((x - 0.5) * 2.0, weights), rtol=1e-4, atol=1e-6
        )
    stats = ens_stack.client().get_inference_statistics("mlp").model_stats[0]
    assert stats.execution_count < stats.inference_count  # steps batched together
