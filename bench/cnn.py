"""A small ResNet-style CNN as ONNX, for the GPU benchmark (`bench/gpu.py`).

Built with onnx.helper from seeded random weights (no download, no torch):
a 3x3 stem, three stages of two residual blocks (the 2nd and 3rd stage halve
the resolution and double the channels, with a 1x1 projection on the skip),
global average pooling and a linear classifier. Input ``INPUT`` FP32
[batch, 3, size, size], output ``OUTPUT`` FP32 [batch, 10]. About 0.45 GMAC
per 64x64 image at the default width: enough work per image that, on a
GPU, the server's per-request cost is small next to the model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from stageserve.datatypes import from_triton
from stageserve_tools.examples import _value_info, config_text, make_model, write_model

CLASSES = 10
SEED = 7


class _Graph:
    """Accumulates nodes and He-initialised weights under unique names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"{kind}{self._n}"

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int) -> str:
        name = self._name("conv")
        fan_in = c_in * kernel * kernel
        w = self.rng.normal(0, np.sqrt(2.0 / fan_in), (c_out, c_in, kernel, kernel))
        self.weights.append(numpy_helper.from_array(w.astype(np.float32), name + "_w"))
        self.weights.append(numpy_helper.from_array(np.zeros(c_out, np.float32), name + "_b"))
        pad = kernel // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, name + "_w", name + "_b"],
                [name],
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad] * 4,
            )
        )
        return name

    def op(self, kind: str, *inputs: str, **attrs) -> str:
        name = self._name(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [name], **attrs))
        return name

    def block(self, x: str, c_in: int, c_out: int, stride: int) -> str:
        y = self.op("Relu", self.conv(x, c_in, c_out, 3, stride))
        y = self.conv(y, c_out, c_out, 3, 1)
        skip = x if stride == 1 and c_in == c_out else self.conv(x, c_in, c_out, 1, stride)
        return self.op("Relu", self.op("Add", y, skip))


def cnn_model(image_size: int = 64, width: int = 32, seed: int = SEED) -> onnx.ModelProto:
    g = _Graph(seed)
    x = g.op("Relu", g.conv("INPUT", 3, width, 3, 1))
    channels = width
    for stage, c_out in enumerate((width, 2 * width, 4 * width)):
        for i in range(2):
            x = g.block(x, channels, c_out, 2 if stage > 0 and i == 0 else 1)
            channels = c_out
    x = g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)
    w = g.rng.normal(0, np.sqrt(1.0 / channels), (channels, CLASSES)).astype(np.float32)
    g.weights.append(numpy_helper.from_array(w, "fc_w"))
    g.weights.append(numpy_helper.from_array(np.zeros(CLASSES, np.float32), "fc_b"))
    g.nodes.append(helper.make_node("Gemm", [x, "fc_w", "fc_b"], ["OUTPUT"]))
    dt = from_triton("FP32")
    graph = helper.make_graph(
        g.nodes,
        "cnn",
        [_value_info("INPUT", dt, ["batch", 3, image_size, image_size])],
        [_value_info("OUTPUT", dt, ["batch", CLASSES])],
        initializer=g.weights,
    )
    return make_model(graph)


def write_cnn(
    root: Path,
    name: str = "cnn",
    *,
    image_size: int = 64,
    width: int = 32,
    max_batch_size: int = 32,
    max_queue_delay_us: int = 0,
    kind: str = "KIND_AUTO",
) -> Path:
    """The model plus a dynamic-batching config.pbtxt in a repository."""
    text = config_text(
        name,
        [("INPUT", "FP32", (3, image_size, image_size))],
        [("OUTPUT", "FP32", (CLASSES,))],
        max_batch_size=max_batch_size,
        dynamic_batching=True,
        max_queue_delay_microseconds=max_queue_delay_us,
        kind=kind,
    )
    return write_model(root, name, cnn_model(image_size, width), text)


# --------------------------------------------------------------------------- reference


def _conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int) -> np.ndarray:
    """NCHW convolution in the dtype of ``x`` (im2col + one matmul per layer)."""
    k = w.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (k, k), axis=(2, 3))
    win = win[:, :, ::stride, ::stride]  # (n, c_in, h_out, w_out, k, k)
    y = np.einsum("nchwij,ocij->nohw", win, w.astype(x.dtype), optimize=True)
    return y + b.astype(x.dtype)[None, :, None, None]


def reference_forward(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's output computed by numpy in float64, straight from its graph.

    Independent of ONNX Runtime (the engine every server runs), for checking
    what servers answer. Knows exactly the ops :func:`cnn_model` emits.
    """
    values: dict[str, np.ndarray] = {
        t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer
    }
    values[model.graph.input[0].name] = np.asarray(x, dtype=np.float64)
    for node in model.graph.node:
        args = [values[name] for name in node.input]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv":
            out = _conv2d(
                args[0], args[1], args[2], stride=attrs["strides"][0], pad=attrs["pads"][0]
            )
        elif node.op_type == "Relu":
            out = np.maximum(args[0], 0.0)
        elif node.op_type == "Add":
            out = args[0] + args[1]
        elif node.op_type == "GlobalAveragePool":
            out = args[0].mean(axis=(2, 3), keepdims=True)
        elif node.op_type == "Flatten":
            out = args[0].reshape(args[0].shape[0], -1)
        elif node.op_type == "Gemm":
            out = args[0] @ args[1] + args[2]
        else:
            raise ValueError(f"reference_forward: unsupported op {node.op_type}")
        values[node.output[0]] = out
    return values[model.graph.output[0].name]
