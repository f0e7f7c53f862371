"""Create the tensor backend of one model instance from its ModelSpec.

ONNX Runtime for ``onnxruntime_onnx`` models, TorchScript for
``pytorch_libtorch`` ones; both answer ``run(feeds, output_names)`` on
StageServe's numpy tensors (see onnx_backend / torch_backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from services.worker.onnx_backend import BackendError, OnnxInstance
from stageserve.config import ONNX_PLATFORM, PYTORCH_PLATFORM, ModelSpec


class TensorBackend(Protocol):
    device: str

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]: ...


def input_types(spec: ModelSpec) -> dict[str, str]:
    """Declared inputs plus what no request carries (controls, states, batch inputs)."""
    return {**{t.name: t.datatype.triton for t in spec.inputs}, **spec.extra_inputs()}


def output_types(spec: ModelSpec) -> dict[str, str]:
    """Declared outputs plus implicit-state outputs (the scheduler reads those)."""
    out = {t.name: t.datatype.triton for t in spec.outputs}
    if spec.sequence is not None:
        out.update({s.output_name: s.datatype.triton for s in spec.sequence.states})
    return out


def create_backend(spec: ModelSpec, path: Path, device: str, threads: int) -> TensorBackend:
    """One instance's backend for the model file at `path` on `device`."""
    if spec.platform == ONNX_PLATFORM:
        return OnnxInstance(
            str(path),
            device=device,
            intra_op_threads=threads,
            input_types=input_types(spec),
            output_types=output_types(spec),
        )
    if spec.platform == PYTORCH_PLATFORM:
        try:
            from services.worker.torch_backend import TorchInstance
        except ImportError as exc:  # torch is the optional extra stageserve[torch]
            raise BackendError(
                f"model '{spec.name}' is a PyTorch model and this worker has no torch "
                f"({exc}); install it with: pip install 'stageserve[torch]'"
            ) from exc

        return TorchInstance(
            path,
            device=device,
            intra_op_threads=threads,
            input_types=input_types(spec),
            output_types=output_types(spec),
            parameters=spec.parameters,
            output_order=list(output_types(spec)),
        )
    raise BackendError(f"model '{spec.name}': no worker backend for platform '{spec.platform}'")
