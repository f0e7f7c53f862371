"""The GPU benchmark's CNN (`bench/cnn.py`) as TorchScript, same weights.

The torch module mirrors the ONNX graph layer for layer and takes its
weights from the ONNX initializers in creation order, so both backends
compute the same function (tests/unit/test_torch_cnn.py checks it). Written
with ``platform: "pytorch_libtorch"``; input ``INPUT`` (forward()'s argument
name) FP32 [batch, 3, size, size], output ``OUTPUT`` FP32 [batch, 10].
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from bench.cnn import CLASSES, SEED, cnn_model


class _Block(torch.nn.Module):
    def __init__(self, convs: Iterator[torch.nn.Conv2d], c_in: int, c_out: int, stride: int):
        super().__init__()
        self.a = next(convs)
        self.b = next(convs)
        self.project = stride != 1 or c_in != c_out
        self.skip = next(convs) if self.project else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return torch.relu(y + self.skip(x))


class TorchCnn(torch.nn.Module):
    def __init__(self, image_size: int = 64, width: int = 32, seed: int = SEED) -> None:
        super().__init__()
        model = cnn_model(image_size, width, seed)
        weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        convs = iter(_convs(model, weights))
        self.stem = next(convs)
        blocks, channels = [], width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for i in range(2):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(_Block(convs, channels, c_out, stride))
                channels = c_out
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(channels, CLASSES)
        with torch.no_grad():
            self.fc.weight.copy_(torch.from_numpy(weights["fc_w"].T.copy()))
            self.fc.bias.copy_(torch.from_numpy(weights["fc_b"]))

    def forward(self, INPUT: torch.Tensor) -> torch.Tensor:  # noqa: N803 (the config's name)
        x = self.blocks(torch.relu(self.stem(INPUT)))
        return self.fc(torch.flatten(torch.mean(x, dim=(2, 3), keepdim=True), 1))


def _convs(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> list[torch.nn.Conv2d]:
    """The ONNX Conv nodes as torch layers, in graph order (the order
    bench/cnn.py created them, which _Block consumes)."""
    out = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        w, b = weights[node.input[1]], weights[node.input[2]]
        attrs = {a.name: list(a.ints) for a in node.attribute}
        c_out, c_in, kernel, _ = w.shape
        conv = torch.nn.Conv2d(
            c_in, c_out, kernel, stride=attrs["strides"][0], padding=attrs["pads"][0]
        )
        assert conv.bias is not None  # Conv2d has a bias by default
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(w))
            conv.bias.copy_(torch.from_numpy(b))
        out.append(conv)
    return out


def write_torch_cnn(
    root: Path,
    name: str = "cnn",
    *,
    image_size: int = 64,
    width: int = 32,
    max_batch_size: int = 32,
    kind: str = "KIND_AUTO",
) -> Path:
    """TorchScript CNN plus a dynamic-batching config.pbtxt in a repository."""
    model_dir = Path(root) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch 2.13 marks torch.jit deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.script(TorchCnn(image_size, width).eval())
        torch.jit.save(module, str(model_dir / "1" / "model.pt"))
    (model_dir / "config.pbtxt").write_text(
        f"""name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 3, {image_size}, {image_size} ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]
instance_group [ {{ count: 1 kind: {kind} }} ]
dynamic_batching {{ max_queue_delay_microseconds: 0 }}
"""
    )
    return model_dir
