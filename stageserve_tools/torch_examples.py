"""TorchScript example models, built with ``torch.jit.script`` (nothing downloaded).

Written as ``<root>/<model>/config.pbtxt`` + ``<root>/<model>/1/model.pt``
with ``platform: "pytorch_libtorch"``:

* ``torch_mlp``: the ``mlp`` example's classifier (same seed and weights,
  256 -> 1024 -> 1024 -> 10, ReLU, softmax) with Triton's index naming
  (``INPUT__0`` -> ``OUTPUT__0``), 2 instances, dynamic batching and a
  ``model_warmup`` (random data, batch 4, twice per instance);
* ``torch_two_io``: two inputs named after forward()'s arguments (``x``,
  ``y``, FP32 [16]) and two outputs ``OUTPUT__0 = x @ W + y`` (W a fixed
  16x16 matrix) and ``OUTPUT__1 = tanh(x) * y``.

Imported only where torch is installed (the ``torch`` extra).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from stageserve_tools.examples import MLP_SEED, mlp_weights

TWO_IO_SEED = 20240611


class _Mlp(torch.nn.Module):
    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList()
        for w, b in layers:
            linear = torch.nn.Linear(w.shape[0], w.shape[1])
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(w.T.copy()))
                linear.bias.copy_(torch.from_numpy(b))
            self.linears.append(linear)

    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803 (Triton's name)
        h = INPUT__0
        last = len(self.linears) - 1
        for i, linear in enumerate(self.linears):
            h = linear(h)
            if i < last:
                h = torch.relu(h)
        return torch.softmax(h, dim=-1)


class _TwoIO(torch.nn.Module):
    if TYPE_CHECKING:
        # The buffer registered below. For type checkers only: TorchScript
        # reads class annotations, and cannot resolve this one as a string
        # (`from __future__ import annotations`).
        weight: torch.Tensor

    def __init__(self, weight: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("weight", torch.from_numpy(weight))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight + y, torch.tanh(x) * y


def mlp_module(sizes: Sequence[int] = (256, 1024, 1024, 10), seed: int = MLP_SEED):
    return torch.jit.script(_Mlp(mlp_weights(sizes, seed)).eval())


def two_io_module(size: int = 16, seed: int = TWO_IO_SEED):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    return torch.jit.script(_TwoIO(weight).eval())


def _write(root: Path, name: str, module, config: str) -> Path:
    model_dir = Path(root) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    torch.jit.save(module, str(model_dir / "1" / "model.pt"))
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def write_torch_mlp(root: Path, name: str = "torch_mlp", instance_count: int = 2) -> Path:
    config = f"""name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 10 ] }} ]
instance_group [ {{ count: {instance_count} kind: KIND_CPU }} ]
dynamic_batching {{ }}
model_warmup [
  {{
    name: "random_batch_4"
    batch_size: 4
    count: 2
    inputs {{
      key: "INPUT__0"
      value: {{ data_type: TYPE_FP32 dims: [ 256 ] random_data: true }}
    }}
  }}
]
"""
    return _write(root, name, mlp_module(), config)


def write_torch_two_io(root: Path, name: str = "torch_two_io") -> Path:
    config = f"""name: "{name}"
backend: "pytorch"
max_batch_size: 32
input [
  {{ name: "x" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "y" data_type: TYPE_FP32 dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 16 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ }}
"""
    return _write(root, name, two_io_module(), config)


def build_torch_examples(root: Path) -> list[str]:
    # torch 2.13 marks torch.jit deprecated; TorchScript is still what
    # Triton's pytorch_libtorch platform loads, so these files are made with it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        write_torch_mlp(root)
        write_torch_two_io(root)
    return ["torch_mlp", "torch_two_io"]
