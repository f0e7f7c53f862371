"""Triton's auto-generated model configuration, for ONNX models.

PyTorch models get only their platform/backend from a ``model.pt`` file:
Triton's PyTorch backend does not complete inputs or outputs (TorchScript
carries no tensor types), so such a model needs a config.pbtxt that
declares them; without one it is UNAVAILABLE with that reason.

Triton fills in what a config.pbtxt leaves out (unless started with
`--disable-auto-complete-config`), so repositories that rely on it work
unchanged here:

- no config.pbtxt at all: the name is the directory's;
- neither platform nor backend, and the version folder holds `model.onnx`
  (or `default_model_filename`): platform `onnxruntime_onnx`, backend
  `onnxruntime`;
- inputs or outputs missing (a config that declares both is taken as it
  is): read from the ONNX file. The model can batch when every input and
  output has a variable first dimension; then max_batch_size 0 becomes the
  default (4, Triton's `default-max-batch-size`) and, above 1, an empty
  `dynamic_batching {}` is added unless a scheduler is configured. A model
  that cannot batch with a non-zero max_batch_size is an error. Generated
  dims leave out the batch dimension; a tensor left with no dims gets
  `dims: [1]` (and `reshape: { shape: [] }` when batching).

The completed config is what the gateway publishes and what ModelConfig
answers, as Triton's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stageserve.config import (
    DEFAULT_ONNX_FILENAME,
    DEFAULT_PYTORCH_FILENAME,
    ENSEMBLE_PLATFORM,
    ONNX_BACKEND,
    ONNX_PLATFORM,
    PYTORCH_BACKEND,
    PYTORCH_PLATFORM,
    ConfigError,
)
from stageserve.datatypes import BY_ONNX
from stageserve.generated import model_config_pb2 as mc


@dataclass(frozen=True)
class _Tensor:
    name: str
    data_type: mc.DataType  # model_config DataType enum value
    dims: tuple[int, ...]  # -1 for a variable dimension


def complete_platform(config: mc.ModelConfig, model_file: Path | None) -> None:
    """Neither platform nor backend: the model file's name says which backend
    (model.onnx: ONNX Runtime, model.pt: PyTorch), as Triton's core decides.
    A PyTorch model gets the platform from its backend and the other way round."""
    if config.backend == PYTORCH_BACKEND or config.platform == PYTORCH_PLATFORM:
        config.platform, config.backend = PYTORCH_PLATFORM, PYTORCH_BACKEND
    if config.platform or config.backend or model_file is None or not model_file.is_file():
        return
    if model_file.name == DEFAULT_PYTORCH_FILENAME:
        config.platform, config.backend = PYTORCH_PLATFORM, PYTORCH_BACKEND
    else:
        config.platform, config.backend = ONNX_PLATFORM, ONNX_BACKEND


def needs_io(config: mc.ModelConfig) -> bool:
    if config.platform == ENSEMBLE_PLATFORM:
        return False
    has_io = len(config.input) + len(config.batch_input) > 0 and len(config.output) > 0
    if (config.platform == PYTORCH_PLATFORM or config.backend == PYTORCH_BACKEND) and not has_io:
        raise ConfigError(
            f"model '{config.name}': Triton's PyTorch backend does not auto-complete inputs and "
            f"outputs (a TorchScript file carries no tensor types): declare them in config.pbtxt"
        )
    onnx_model = config.platform == ONNX_PLATFORM or config.backend == ONNX_BACKEND
    return onnx_model and not has_io


def complete_io(config: mc.ModelConfig, model_file: Path, default_max_batch_size: int) -> None:
    """Inputs, outputs, max_batch_size and dynamic batching from the ONNX file."""
    inputs, outputs = read_onnx_io(model_file)
    name = config.name
    can_batch = all(t.dims and t.dims[0] == -1 for t in (*inputs, *outputs))
    if can_batch:
        if config.max_batch_size == 0:
            config.max_batch_size = max(default_max_batch_size, 0)
        scheduled = config.HasField("dynamic_batching") or config.HasField("sequence_batching")
        if config.max_batch_size > 1 and not scheduled:
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size != 0:
        raise ConfigError(
            f"autofill failed for model '{name}': model does not support batching while "
            f"non-zero max_batch_size is specified"
        )
    batching = config.max_batch_size > 0
    if not len(config.input) + len(config.batch_input):
        for t in inputs:
            _fill(config.input.add(), t, batching)
    if not config.output:
        for t in outputs:
            _fill(config.output.add(), t, batching)


def _fill(target: mc.ModelInput | mc.ModelOutput, t: _Tensor, batching: bool) -> None:
    target.name = t.name
    target.data_type = t.data_type
    dims = t.dims[1:] if batching else t.dims
    if dims:
        target.dims.extend(dims)
        return
    target.dims.append(1)  # Triton's dims must not be empty
    if batching:
        target.reshape.SetInParent()  # shape [] per request: a scalar


def read_onnx_io(model_file: Path) -> tuple[list[_Tensor], list[_Tensor]]:
    import onnx  # only the gateway completes configs; the other stages never load it

    try:
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise ConfigError(f"cannot read {model_file} to complete its configuration: {exc}") from exc
    graph = model.graph
    weights = {init.name for init in graph.initializer}
    inputs = [_tensor(v, model_file) for v in graph.input if v.name not in weights]
    outputs = [_tensor(v, model_file) for v in graph.output]
    return inputs, outputs


def _tensor(value, model_file: Path) -> _Tensor:  # value: onnx.ValueInfoProto
    tensor_type = value.type.tensor_type
    datatype = BY_ONNX.get(tensor_type.elem_type)
    if datatype is None:
        raise ConfigError(
            f"{model_file}: tensor '{value.name}' has an ONNX element type "
            f"({tensor_type.elem_type}) StageServe cannot serve"
        )
    dims = tuple(
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
        for d in tensor_type.shape.dim
    )
    return _Tensor(value.name, mc.DataType.Value(datatype.config_enum), dims)


def model_file_for(config: mc.ModelConfig, model_dir: Path, versions: list[int]) -> Path | None:
    """The newest version's model file (what Triton's backend reads to complete);
    with no platform, backend or file name set, model.onnx or else model.pt."""
    if config.default_model_filename:
        names = [config.default_model_filename]
    elif config.platform == PYTORCH_PLATFORM or config.backend == PYTORCH_BACKEND:
        names = [DEFAULT_PYTORCH_FILENAME]
    elif config.platform or config.backend:
        names = [DEFAULT_ONNX_FILENAME]
    else:
        names = [DEFAULT_ONNX_FILENAME, DEFAULT_PYTORCH_FILENAME]
    for version in sorted(versions, reverse=True):
        for filename in names:
            candidate = model_dir / str(version) / filename
            if candidate.is_file():
                return candidate
    return None
