"""bench/torch_cnn.py: the TorchScript CNN computes what the ONNX CNN computes,
and its repository serves through the worker's PyTorch backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.cnn import CLASSES, write_cnn
from bench.torch_cnn import write_torch_cnn
from services.worker.onnx_backend import OnnxInstance
from services.worker.torch_backend import TorchInstance
from stageserve.repository import read_model


def test_torchscript_cnn_matches_the_onnx_cnn(tmp_path: Path) -> None:
    onnx_dir = write_cnn(tmp_path / "onnx", image_size=16, width=8, max_batch_size=4)
    torch_dir = write_torch_cnn(tmp_path / "torch", image_size=16, width=8, max_batch_size=4)
    loaded = read_model(tmp_path / "torch", "cnn")
    assert loaded.ok and loaded.spec is not None and loaded.spec.platform == "pytorch_libtorch"
    io = ({"INPUT": "FP32"}, {"OUTPUT": "FP32"})
    ort = OnnxInstance(onnx_dir / "1" / "model.onnx", "cpu", 1, *io)
    pt = TorchInstance(torch_dir / "1" / "model.pt", "cpu", 1, *io)
    x = np.random.default_rng(3).random((3, 3, 16, 16), dtype=np.float32)
    want = ort.run({"INPUT": x}, ["OUTPUT"])["OUTPUT"]
    got = pt.run({"INPUT": x}, ["OUTPUT"])["OUTPUT"]
    assert got.shape == (3, CLASSES)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
