"""bench/cnn.py: the GPU benchmark's CNN is a valid, deterministic ONNX model
that the worker's backend serves with batching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from bench.cnn import CLASSES, cnn_model, reference_forward, write_cnn
from services.worker.onnx_backend import OnnxInstance
from stageserve.repository import read_model


def test_cnn_is_deterministic_and_checks() -> None:
    a, b = cnn_model(16, 8), cnn_model(16, 8)
    onnx.checker.check_model(a)
    assert a.SerializeToString() == b.SerializeToString()
    convs = [n for n in a.graph.node if n.op_type == "Conv"]
    assert len(convs) == 1 + 6 * 2 + 2  # stem, two per block, two projections


def test_written_repository_serves_batches_row_by_row(tmp_path: Path) -> None:
    model_dir = write_cnn(tmp_path, image_size=16, width=8, max_batch_size=4)
    loaded = read_model(tmp_path, "cnn")
    assert loaded.ok and loaded.spec is not None
    assert loaded.spec.max_batch_size == 4 and loaded.spec.dynamic_batching is not None
    backend = OnnxInstance(
        model_dir / "1" / "model.onnx",
        input_types={"INPUT": "FP32"},
        output_types={"OUTPUT": "FP32"},
    )
    x = np.random.default_rng(1).random((3, 3, 16, 16), dtype=np.float32)
    batched = backend.run({"INPUT": x}, ["OUTPUT"])["OUTPUT"]
    assert batched.shape == (3, CLASSES) and np.isfinite(batched).all()
    alone = backend.run({"INPUT": x[1:2]}, ["OUTPUT"])["OUTPUT"]
    np.testing.assert_allclose(alone[0], batched[1], rtol=1e-4, atol=1e-5)
    assert np.abs(batched[0] - batched[2]).max() > 0  # different images, different answers


def test_numpy_reference_matches_onnxruntime() -> None:
    """reference_forward (float64 numpy, im2col) computes what ONNX Runtime does."""
    ort = pytest.importorskip("onnxruntime")
    model = cnn_model(12, 4, seed=3)  # an even and an odd stride-2 output size: 12 -> 6 -> 3
    x = np.random.default_rng(2).standard_normal((2, 3, 12, 12), dtype=np.float32)
    want = reference_forward(model, x)
    assert want.shape == (2, CLASSES) and want.dtype == np.float64
    got = ort.InferenceSession(model.SerializeToString()).run(["OUTPUT"], {"INPUT": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_numpy_reference_refuses_unknown_ops() -> None:
    model = cnn_model(8, 4)
    model.graph.node.append(helper.make_node("Softmax", ["OUTPUT"], ["PROBS"]))
    with pytest.raises(ValueError, match="unsupported op Softmax"):
        reference_forward(model, np.zeros((1, 3, 8, 8), np.float32))
