"""A HostedInstance of the example `simple` model (ONNX add/sub, max_batch_size
8, one CPU instance) in this process, for unit tests of the worker's execution
path without a worker service."""

from __future__ import annotations

from pathlib import Path

from services.worker.instances import HostedInstance, Placement
from services.worker.onnx_backend import OnnxInstance
from services.worker.tensor_batches import TensorBatches
from stageserve.config import read_config, to_spec
from stageserve_tools import examples

CPU = Placement("KIND_CPU", -1)


def hosted_simple(root: Path, extra: str = "", placement: Placement = CPU) -> HostedInstance:
    """`simple` written under `root` (with `extra` appended to its
    config.pbtxt) and hosted as instance w/simple/1/g1/0 on `placement`
    (its ONNX session runs on the CPU whatever the placement says)."""
    examples.write_simple(root, "simple", max_batch_size=8)
    config = root / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + extra)
    spec = to_spec(read_config(root / "simple"))
    backend = OnnxInstance(
        root / "simple" / "1" / "model.onnx",
        "cpu",
        1,
        {t.name: t.datatype.triton for t in spec.inputs},
        {t.name: t.datatype.triton for t in spec.outputs},
    )
    return HostedInstance(
        "w/simple/1/g1/0",
        "simple",
        1,
        1,
        placement,
        spec,
        TensorBatches(spec, backend),
    )
