"""bench/cnn.py: the GPU benchmark's CNN is a valid, deterministic ONNX model
that the worker's backend serves with batching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from bench.cnn import CLASSES, cnn_model, write_cnn
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
