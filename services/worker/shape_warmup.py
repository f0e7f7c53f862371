"""Automatic shape warm-up (beyond Triton): every batch shape an instance can
be handed runs once before the model is READY.

On a GPU, ONNX Runtime (cuDNN's convolution algorithm search) and
TorchScript (kernel selection) pay for each new input shape on its first
run, so the first request of each batch size would wait for it. An instance
that pads (batch_padding.py) is warmed with its padded sizes; any other
instance running on a GPU with every size 1..max_batch_size the batcher can
form. CPU instances that do not pad are not warmed (no per-shape cost worth
a slower load). The model parameter ``shape_warmup`` turns it off ("false")
or on for every instance ("true").

Only the batch dimension is covered. A model with a variable (-1)
non-batch dimension is not warmed unless ``shape_warmup`` is "true" (there
the dimension takes 1): its shapes do not follow from the batch size, and a
size-1 image may not pass a stack of strided convolutions. The data is
zeros, as Triton's ``zero_data``. A warm-up the model asked for
(``shape_warmup`` "true") that fails fails the load, as a model_warmup
sample does; an automatic one that fails is logged and the model loads (it
is no worse off than without it). The runs go through the instance's own
thread and the same path as real batches (warmup.py's `run_warmup`), but
unlike configured model_warmup samples, which Triton counts, they are
StageServe's and leave the model's statistics untouched. Models with ragged
inputs are not warmed (their shapes are not rows).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from services.worker.instances import HostedInstance
from services.worker.tensor_batches import TensorBatches
from services.worker.warmup import WarmupError, run_warmup, warmup_requests
from stageserve.config import TENSOR_PLATFORMS, ModelSpec, WarmupInput, WarmupSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.pad_policy import FALSE_WORDS, TRUE_WORDS

log = logging.getLogger(__name__)

SHAPE_WARMUP_PARAMETER = "shape_warmup"


def warmup_shapes(spec: ModelSpec, on_gpu: bool, pad_sizes: Sequence[int]) -> tuple[int, ...]:
    """The batch sizes one instance runs before READY (empty: none)."""
    text = spec.parameters.get(SHAPE_WARMUP_PARAMETER, "").strip().lower()
    if text in FALSE_WORDS:
        return ()
    if spec.platform not in TENSOR_PLATFORMS or not spec.batching or spec.ragged_inputs:
        return ()
    if text not in TRUE_WORDS and _variable_dims(spec):
        return ()
    if pad_sizes:
        return tuple(pad_sizes)
    if on_gpu or text in TRUE_WORDS:
        return tuple(range(1, spec.max_batch_size + 1))
    return ()


def required(spec: ModelSpec) -> bool:
    """Whether the model asked for the shape warm-up (a failure fails its load)."""
    return spec.parameters.get(SHAPE_WARMUP_PARAMETER, "").strip().lower() in TRUE_WORDS


def _variable_dims(spec: ModelSpec) -> bool:
    dims = [t.dims for t in spec.inputs]
    if spec.sequence is not None:
        dims += [s.dims for s in spec.sequence.states]
    return any(d < 0 for shape in dims for d in shape)


def instance_shapes(instance: HostedInstance) -> tuple[int, ...]:
    """`warmup_shapes` of a hosted instance (only tensor sessions have any)."""
    backend = instance.backend
    if not isinstance(backend, TensorBatches):
        return ()
    return warmup_shapes(instance.spec, backend.session.device != "cpu", backend.pad_sizes)


def shape_samples(spec: ModelSpec, shapes: Sequence[int]) -> tuple[WarmupSpec, ...]:
    """One zero_data sample per batch size, feeding every model input
    (sequence controls and states included, as warmup.py feeds the model)."""
    model_inputs = [(t.name, t.datatype, t.dims) for t in spec.inputs]
    if spec.sequence is not None:
        model_inputs += [(c.name, c.datatype, (1,)) for c in spec.sequence.controls]
        model_inputs += [(s.input_name, s.datatype, s.dims) for s in spec.sequence.states]
    inputs = tuple(
        WarmupInput(name, datatype, tuple(1 if d < 0 else d for d in dims), "zero_data")
        for name, datatype, dims in model_inputs
    )
    return tuple(WarmupSpec(f"shape {n}", n, inputs, 1) for n in shapes)


async def warm_up_shapes(instance: HostedInstance, shapes: Sequence[int], model_dir: Path) -> float:
    """Run each batch size once on the instance's own thread; the seconds it
    took. A failed run raises WarmupError (the load fails) where the model
    asked for the warm-up, else it is logged and the warm-up ends there."""
    spec = dataclasses.replace(instance.spec, warmups=shape_samples(instance.spec, shapes))
    requests = warmup_requests(spec, model_dir)
    execute = cast("Callable[[pb.ExecuteRequest], pb.ExecuteResponse]", instance.execute)
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    try:
        # the statistics run_warmup returns are dropped: see the module docstring
        await loop.run_in_executor(instance.executor, run_warmup, execute, requests)
    except WarmupError as exc:
        if required(instance.spec):
            raise WarmupError(f"shape warm-up ({SHAPE_WARMUP_PARAMETER}): {exc}") from exc
        log.warning(
            "shape warm-up failed",
            extra={"instance": instance.instance_id, "error": str(exc)},
        )
    return time.monotonic() - t0
