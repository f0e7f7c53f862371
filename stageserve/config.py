"""Model configuration: config.pbtxt -> ModelConfig proto -> ModelSpec.

The text is parsed by protobuf's own text-format parser into our ModelConfig
(protos/model_config.proto, Triton's field names and numbers). ModelSpec is
the validated, defaults-applied view every stage works from; it is derived
from the proto once, at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from google.protobuf import text_format

from stageserve.datatypes import DataType, from_config_enum, from_triton
from stageserve.generated import model_config_pb2 as mc
from stageserve.pad_policy import PadPolicy, PadPolicyError, pad_policy

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
DEFAULT_ONNX_FILENAME = "model.onnx"
PYTORCH_PLATFORM = "pytorch_libtorch"
PYTORCH_BACKEND = "pytorch"
DEFAULT_PYTORCH_FILENAME = "model.pt"
#: platform -> (backend, default model file name), for the platforms workers run
TENSOR_PLATFORMS = {
    ONNX_PLATFORM: (ONNX_BACKEND, DEFAULT_ONNX_FILENAME),
    PYTORCH_PLATFORM: (PYTORCH_BACKEND, DEFAULT_PYTORCH_FILENAME),
}
ENSEMBLE_PLATFORM = "ensemble"
PYTHON_BACKEND = "python"
DEFAULT_PYTHON_FILENAME = "model.py"


class ConfigError(ValueError):
    """A config.pbtxt that Triton would refuse to load."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: DataType
    dims: tuple[int, ...]  # without the batch dimension; -1 is variable
    reshape: tuple[int, ...] | None = None  # shape the model sees, if different
    optional: bool = False
    # Ragged: requests batch whatever this input's non-batch shape; the model
    # receives every request's elements concatenated into one 1-D tensor.
    allow_ragged_batch: bool = False

    def matches(self, shape: tuple[int, ...]) -> bool:
        if shape == self.dims:  # the common case, without the loop below
            return True
        return len(shape) == len(self.dims) and all(
            d == -1 or d == s for d, s in zip(self.dims, shape, strict=True)
        )


@dataclass(frozen=True)
class QueuePolicySpec:
    timeout_action: str = "REJECT"  # or "DELAY"
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicySpec = QueuePolicySpec()
    priority_queue_policy: tuple[tuple[int, QueuePolicySpec], ...] = ()


@dataclass(frozen=True)
class InstanceGroup:
    name: str
    count: int
    kind: str  # KIND_CPU / KIND_GPU / KIND_AUTO
    gpus: tuple[int, ...] = ()
    # rate_limiter: (name, count, global) per resource, and the priority
    rate_limiter_resources: tuple[tuple[str, int, bool], ...] = ()
    rate_limiter_priority: int = 0


@dataclass(frozen=True)
class ControlInput:
    """One sequence control tensor the scheduler fills (shape [batch, 1])."""

    name: str
    kind: str  # CONTROL_SEQUENCE_START / _READY / _END / _CORRID
    datatype: DataType
    false_value: float | bool = 0
    true_value: float | bool = 1


@dataclass(frozen=True)
class StateSpec:
    """Implicit state: fed back from output_name of one request to input_name of the next."""

    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]
    initial_file: str | None = None  # file under <model>/initial_state/; None: zeros
    initial_dims: tuple[int, ...] = ()  # the shape a sequence's state starts from

    @property
    def variable(self) -> bool:
        """Variable dims: the state may change shape (grow) from request to request."""
        return -1 in self.dims


@dataclass(frozen=True)
class SequenceBatching:
    strategy: str  # "direct" or "oldest"
    max_idle_us: int
    controls: tuple[ControlInput, ...]
    states: tuple[StateSpec, ...]
    max_queue_delay_us: int = 0
    # oldest: max_candidate_sequences per instance; 0 (unset): max_batch_size,
    # as Triton 2.51 does (sequence_strategy.py)
    max_candidates: int = 0

    def control(self, kind: str) -> ControlInput | None:
        return next((c for c in self.controls if c.kind == kind), None)


# Triton's default max_sequence_idle_microseconds.
DEFAULT_SEQUENCE_IDLE_US = 1_000_000


#: BatchInput kinds (model_config.proto); the worker computes each from the batch.
BATCH_INPUT_KINDS = (
    "BATCH_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE",
    "BATCH_ITEM_SHAPE_FLATTEN",
)


@dataclass(frozen=True)
class BatchInputSpec:
    """An extra model input generated from the formed batch (Triton's batch_input)."""

    kind: str  # one of BATCH_INPUT_KINDS
    target_names: tuple[str, ...]  # model inputs that receive it
    datatype: DataType  # INT32 or FP32
    source_input: str  # the request input it describes


@dataclass(frozen=True)
class BatchOutputSpec:
    """Outputs scattered back with each request's source-input shape (batch_output)."""

    kind: str  # BATCH_SCATTER_WITH_INPUT_SHAPE
    target_names: tuple[str, ...]
    source_input: str


@dataclass(frozen=True)
class WarmupInput:
    """One input of a warmup sample (model_config ModelWarmup.Input)."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]  # without the batch dimension, all fixed
    source: str  # "zero_data", "random_data" or "input_data_file"
    data_file: str = ""  # under <model>/warmup/, for input_data_file


@dataclass(frozen=True)
class WarmupSpec:
    """A synthetic request run on every instance before the model is READY."""

    name: str
    batch_size: int  # 1 or more; the tensors' batch dimension when the model batches
    inputs: tuple[WarmupInput, ...]
    count: int  # executions of this sample (Triton: 0 means once)


@dataclass(frozen=True)
class ExecutionAccelerator:
    """One ``optimization { execution_accelerators { ... } }`` entry: a name
    ("tensorrt", "cuda", "openvino") and its string parameters, as written."""

    name: str
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic_batching: DynamicBatching | None
    instance_groups: tuple[InstanceGroup, ...]
    model_filename: str
    parameters: dict[str, str] = field(default_factory=dict)
    sequence: SequenceBatching | None = None
    steps: tuple = ()  # ensemble steps (platform "ensemble")
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    batch_outputs: tuple[BatchOutputSpec, ...] = ()
    backend: str = ""  # "python" for Triton Python-backend models (model.py)
    decoupled: bool = False  # model_transaction_policy { decoupled: true }
    response_cache: bool = False  # response_cache { enable: true }
    warmups: tuple[WarmupSpec, ...] = ()
    # StageServe's batch padding (parameter pad_batch, stageserve/pad_policy.py)
    pad_batch: PadPolicy = PadPolicy()
    # optimization { execution_accelerators { gpu/cpu_execution_accelerator } }
    gpu_accelerators: tuple[ExecutionAccelerator, ...] = ()
    cpu_accelerators: tuple[ExecutionAccelerator, ...] = ()
    graph_level: int = 0  # optimization { graph { level } }: 0 is the backend's default

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    @cached_property  # read for every request the scheduler queues
    def ragged_inputs(self) -> frozenset[str]:
        """Inputs with allow_ragged_batch: left out of the batcher's shape check."""
        return frozenset(t.name for t in self.inputs if t.allow_ragged_batch)

    def batch_output(self, name: str) -> BatchOutputSpec | None:
        return next((b for b in self.batch_outputs if name in b.target_names), None)

    def output_tensor(self, name: str) -> TensorSpec | None:
        """A declared output or an implicit-state output."""
        out = self.output(name)
        if out is None and self.sequence is not None:
            for s in self.sequence.states:
                if s.output_name == name:
                    return TensorSpec(name, s.datatype, s.dims)
        return out

    def extra_inputs(self) -> dict[str, str]:
        """Model inputs no request carries: control and state tensors (the
        scheduler provides them) and batch inputs (the worker computes them)."""
        out = {t: b.datatype.triton for b in self.batch_inputs for t in b.target_names}
        if self.sequence is None:
            return out
        out.update({c.name: c.datatype.triton for c in self.sequence.controls})
        out.update({s.input_name: s.datatype.triton for s in self.sequence.states})
        return out

    @cached_property  # the gateway looks up every input and output of every request
    def _inputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs}

    @cached_property
    def _outputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.outputs}

    def input(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)

    def output(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)


def parse_config_text(text: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"config.pbtxt does not parse: {exc}") from exc
    return config


def config_path(model_dir: Path, config_name: str | None = None) -> Path:
    """The file a model's configuration is read from: with Triton's
    --model-config-name, `configs/<name>.pbtxt` when the model has one, else
    (and without the flag) `config.pbtxt`."""
    if config_name:
        custom = model_dir / "configs" / f"{config_name}.pbtxt"
        if custom.is_file():
            return custom
    return model_dir / "config.pbtxt"


def read_config(
    model_dir: Path, allow_missing: bool = False, config_name: str | None = None
) -> mc.ModelConfig:
    """The model's configuration (`config_path`); with allow_missing
    (auto-complete on, as in Triton) a missing file is an empty config named
    after the directory."""
    path = config_path(model_dir, config_name)
    if not path.is_file():
        if allow_missing:
            return mc.ModelConfig(name=model_dir.name)
        raise ConfigError(f"no config.pbtxt in {model_dir}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    config = parse_config_text(text)
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        raise ConfigError(
            f"config name '{config.name}' does not match the directory name '{model_dir.name}'"
        )
    return config


def _tensor_spec(t: mc.ModelInput | mc.ModelOutput, where: str, model: str) -> TensorSpec:
    try:
        enum_name = mc.DataType.Name(t.data_type)
    except ValueError:  # a number that names no DataType ("data_type: 99")
        enum_name = str(t.data_type)
    try:
        datatype = from_config_enum(enum_name)
    except KeyError:
        raise ConfigError(
            f"{where} '{t.name}' of model '{model}' has data_type {enum_name}"
        ) from None
    if not t.name:
        raise ConfigError(f"an {where} of model '{model}' has no name")
    dims = tuple(int(d) for d in t.dims)
    if any(d == 0 or d < -1 for d in dims):
        raise ConfigError(f"{where} '{t.name}' of model '{model}' has invalid dims {list(dims)}")
    reshape = None
    if t.HasField("reshape"):
        reshape = tuple(int(d) for d in t.reshape.shape)
        if -1 not in dims and -1 not in reshape and math.prod(dims) != math.prod(reshape):
            raise ConfigError(
                f"{where} '{t.name}' of model '{model}': reshape {list(reshape)} has a different "
                f"element count than dims {list(dims)}"
            )
    optional = bool(getattr(t, "optional", False))
    ragged = bool(getattr(t, "allow_ragged_batch", False))  # inputs only
    return TensorSpec(t.name, datatype, dims, reshape, optional, ragged)


def to_spec(config: mc.ModelConfig) -> ModelSpec:
    """Validate a ModelConfig and derive the ModelSpec with Triton's defaults."""
    name = config.name
    by_backend = {backend: p for p, (backend, _) in TENSOR_PLATFORMS.items()}
    platform = config.platform or by_backend.get(config.backend, "")
    python = config.backend == PYTHON_BACKEND and not config.platform
    if python:
        platform = PYTHON_BACKEND  # what ModelMetadata reports for a backend-only config
    if platform not in (*TENSOR_PLATFORMS, ENSEMBLE_PLATFORM) and not python:
        raise ConfigError(
            f"model '{name}': platform '{config.platform}' / backend '{config.backend}' is not "
            f"supported (StageServe serves {', '.join(repr(p) for p in TENSOR_PLATFORMS)}, "
            f"'{ENSEMBLE_PLATFORM}' and '{PYTHON_BACKEND}' backend models)"
        )
    decoupled = bool(config.model_transaction_policy.decoupled)
    if decoupled and not python:
        raise ConfigError(
            f"model '{name}': decoupled models are supported for the '{PYTHON_BACKEND}' backend"
        )
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{name}': max_batch_size must be >= 0")
    if not config.input:
        raise ConfigError(f"model '{name}' declares no inputs")
    if not config.output:
        raise ConfigError(f"model '{name}' declares no outputs")
    inputs = tuple(_tensor_spec(t, "input", name) for t in config.input)
    outputs = tuple(_tensor_spec(t, "output", name) for t in config.output)
    for kind, tensors in (("input", inputs), ("output", outputs)):
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ConfigError(f"model '{name}' declares an {kind} name twice: {names}")

    dynamic = None
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if config.max_batch_size == 0:
            raise ConfigError(f"model '{name}': dynamic batching needs max_batch_size > 0")
        preferred = tuple(int(p) for p in db.preferred_batch_size)
        bad = [p for p in preferred if p <= 0 or p > config.max_batch_size]
        if bad:
            raise ConfigError(
                f"model '{name}': preferred_batch_size {bad} outside 1..{config.max_batch_size}"
            )
        levels = int(db.priority_levels)
        if levels and not 1 <= db.default_priority_level <= levels:
            raise ConfigError(
                f"model '{name}': default_priority_level {db.default_priority_level} must be in "
                f"1..priority_levels ({levels})"
            )
        bad_levels = [lv for lv in db.priority_queue_policy if not 1 <= lv <= levels]
        if bad_levels:
            raise ConfigError(
                f"model '{name}': priority_queue_policy for levels {sorted(bad_levels)} outside "
                f"1..priority_levels ({levels})"
            )
        dynamic = DynamicBatching(
            preferred_batch_sizes=tuple(sorted(set(preferred))),
            max_queue_delay_us=int(db.max_queue_delay_microseconds),
            preserve_ordering=bool(db.preserve_ordering),
            priority_levels=levels,
            default_priority_level=int(db.default_priority_level),
            default_queue_policy=_queue_policy(db.default_queue_policy),
            priority_queue_policy=tuple(
                sorted((int(k), _queue_policy(v)) for k, v in db.priority_queue_policy.items())
            ),
        )

    groups = []
    for i, g in enumerate(config.instance_group) or ():
        try:
            kind = mc.ModelInstanceGroup.Kind.Name(g.kind)
        except ValueError:
            raise ConfigError(f"model '{name}': instance_group kind {g.kind} is unknown") from None
        if g.count < 0:
            raise ConfigError(f"model '{name}': instance_group count must be >= 0")
        groups.append(
            InstanceGroup(
                g.name or f"{name}_{i}",
                g.count or 1,
                kind,
                tuple(int(x) for x in g.gpus),
                _rate_limiter_resources(name, g.rate_limiter),
                int(g.rate_limiter.priority),
            )
        )
    if not groups:
        groups.append(InstanceGroup(f"{name}_0", 1, "KIND_AUTO"))

    sequence = _sequence_spec(config) if config.HasField("sequence_batching") else None
    if decoupled and sequence is not None and sequence.states:
        # A decoupled batch answers in parts; none carries the batch's state
        # outputs, so there is nothing to keep (a StageServe limit).
        raise ConfigError(
            f"model '{name}': sequence_batching state is not supported for decoupled models "
            f"by StageServe"
        )
    response_cache = bool(config.response_cache.enable)
    _check_response_cache(name, response_cache, decoupled, sequence)
    steps = _ensemble_steps(config, inputs, outputs) if platform == ENSEMBLE_PLATFORM else ()
    batch_inputs, batch_outputs = _ragged_spec(config, platform, inputs, outputs, sequence)
    return ModelSpec(
        name=name,
        platform=platform,
        max_batch_size=int(config.max_batch_size),
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=dynamic,
        instance_groups=tuple(groups),
        model_filename=config.default_model_filename
        or (
            DEFAULT_PYTHON_FILENAME
            if python
            else TENSOR_PLATFORMS.get(platform, ("", DEFAULT_ONNX_FILENAME))[1]
        ),
        parameters={k: v.string_value for k, v in config.parameters.items()},
        sequence=sequence,
        steps=steps,
        batch_inputs=batch_inputs,
        batch_outputs=batch_outputs,
        backend=PYTHON_BACKEND if python else (config.backend or ""),
        decoupled=decoupled,
        response_cache=response_cache,
        warmups=_warmup_specs(config, inputs, sequence),
        pad_batch=_pad_policy(
            config, platform, dynamic, inputs, batch_inputs, batch_outputs, sequence
        ),
        gpu_accelerators=_accelerators(
            config.optimization.execution_accelerators.gpu_execution_accelerator
        ),
        cpu_accelerators=_accelerators(
            config.optimization.execution_accelerators.cpu_execution_accelerator
        ),
        graph_level=int(config.optimization.graph.level),
    )


def _pad_policy(
    config: mc.ModelConfig,
    platform: str,
    dynamic: DynamicBatching | None,
    inputs: tuple[TensorSpec, ...],
    batch_inputs: tuple[BatchInputSpec, ...],
    batch_outputs: tuple[BatchOutputSpec, ...],
    sequence: SequenceBatching | None,
) -> PadPolicy:
    """The model's batch padding (stageserve/pad_policy.py), with what rules it out."""
    obstacles = []
    if platform not in TENSOR_PLATFORMS:
        obstacles.append(f"only ONNX Runtime and TorchScript models pad, this is '{platform}'")
    ragged = [t.name for t in inputs if t.allow_ragged_batch]
    if ragged:
        obstacles.append(f"ragged input(s) {ragged} are one 1-D tensor, not rows")
    if batch_inputs:
        obstacles.append("batch_input tensors are computed from the real requests' shapes")
    if batch_outputs:
        obstacles.append("batch_output scattering cuts outputs by the real requests' shapes")
    if sequence is not None and sequence.states:
        obstacles.append("a padded row's sequence state output has no sequence to go to")
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    preferred = dynamic.preferred_batch_sizes if dynamic is not None else ()
    try:
        return pad_policy(
            parameters,
            int(config.max_batch_size),
            preferred,
            obstacles,
            one_shape=platform == ONNX_PLATFORM,
        )
    except PadPolicyError as exc:
        raise ConfigError(f"model '{config.name}': {exc}") from None


def _accelerators(entries) -> tuple[ExecutionAccelerator, ...]:
    return tuple(ExecutionAccelerator(a.name, dict(a.parameters)) for a in entries)


def _check_response_cache(
    name: str, enabled: bool, decoupled: bool, sequence: SequenceBatching | None
) -> None:
    """Triton 2.51 refuses to load a model that enables the response cache and
    is decoupled or sequence-batched (with or without --cache-config), with
    these messages."""
    if enabled and decoupled:
        raise ConfigError(
            f"Response Cache does not currently support model {name} with 'decoupled' "
            "transaction policy. Please disable the response cache."
        )
    if enabled and sequence is not None:
        raise ConfigError(
            f"Response Cache does not currently support model {name} with sequence "
            "batching scheduler. Please disable the response cache."
        )


def _rate_limiter_resources(
    model: str, rl: mc.ModelRateLimiter
) -> tuple[tuple[str, int, bool], ...]:
    seen: set[str] = set()
    for r in rl.resources:
        if not r.name:
            raise ConfigError(f"model '{model}': a rate_limiter resource needs a name")
        if r.name in seen:
            raise ConfigError(
                f"model '{model}': rate_limiter resource '{r.name}' is listed more than once"
            )
        seen.add(r.name)
    return tuple((r.name, int(r.count), bool(getattr(r, "global"))) for r in rl.resources)


def _ragged_spec(
    config: mc.ModelConfig,
    platform: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    sequence: SequenceBatching | None,
) -> tuple[tuple[BatchInputSpec, ...], tuple[BatchOutputSpec, ...]]:
    """Check allow_ragged_batch, batch_input and batch_output (Triton's rules,
    plus where StageServe supports them: batching ONNX models that use the
    dynamic batcher or the default scheduler)."""
    name = config.name
    ragged = [t.name for t in inputs if t.allow_ragged_batch]
    features = [f"allow_ragged_batch (input(s) {ragged})"] if ragged else []
    features += ["batch_input"] if config.batch_input else []
    features += ["batch_output"] if config.batch_output else []
    if not features:
        return (), ()
    what = " and ".join(features)
    if config.max_batch_size == 0:
        raise ConfigError(f"model '{name}' uses {what}: ragged batching needs max_batch_size > 0")
    if sequence is not None or platform == ENSEMBLE_PLATFORM:
        raise ConfigError(
            f"model '{name}' uses {what}: ragged batching is supported for ONNX models with "
            f"dynamic_batching or the default scheduler, not with "
            f"{'sequence_batching' if sequence is not None else 'ensemble_scheduling'}"
        )
    input_names = {t.name for t in inputs}
    batch_inputs = tuple(_batch_input(name, bi, input_names) for bi in config.batch_input)
    targets = [t for b in batch_inputs for t in b.target_names]
    for target in targets:
        if target in input_names:
            raise ConfigError(
                f"model '{name}': batch_input target_name '{target}' is also a declared input"
            )
        if targets.count(target) > 1:
            raise ConfigError(
                f"model '{name}': batch_input target_name '{target}' is declared twice"
            )
    output_names = {t.name for t in outputs}
    batch_outputs = tuple(
        _batch_output(name, bo, input_names, output_names) for bo in config.batch_output
    )
    scattered = [t for b in batch_outputs for t in b.target_names]
    twice = sorted({t for t in scattered if scattered.count(t) > 1})
    if twice:
        raise ConfigError(
            f"model '{name}': batch_output target output(s) {twice} can only be given once"
        )
    return batch_inputs, batch_outputs


def _enum_name(enum, value: int) -> str | None:
    try:
        return enum.Name(value)
    except ValueError:  # a number that names no value ("kind: 9")
        return None


def _single_source(model: str, where: str, sources, input_names: set[str]) -> str:
    if len(sources) != 1:
        raise ConfigError(f"model '{model}': {where} expects 1 source_input, got {len(sources)}")
    source = sources[0]
    if source not in input_names:
        raise ConfigError(
            f"model '{model}': {where} has unknown source_input '{source}' (inputs are "
            f"{sorted(input_names)})"
        )
    return source


def _batch_input(model: str, bi: mc.BatchInput, input_names: set[str]) -> BatchInputSpec:
    kind = _enum_name(mc.BatchInput.Kind, bi.kind)
    if kind is None:
        raise ConfigError(f"model '{model}': unknown batch input kind {bi.kind}")
    where = f"batch_input {kind} {list(bi.target_name)}"
    if not bi.target_name or not all(bi.target_name):
        raise ConfigError(f"model '{model}': {where} needs a non-empty target_name")
    source = _single_source(model, where, bi.source_input, input_names)
    dtype = _enum_name(mc.DataType, bi.data_type)
    if dtype not in ("TYPE_INT32", "TYPE_FP32"):
        raise ConfigError(
            f"model '{model}': {where} data_type must be TYPE_INT32 or TYPE_FP32, got {dtype}"
        )
    return BatchInputSpec(kind, tuple(bi.target_name), from_config_enum(dtype), source)


def _batch_output(
    model: str, bo: mc.BatchOutput, input_names: set[str], output_names: set[str]
) -> BatchOutputSpec:
    kind = _enum_name(mc.BatchOutput.Kind, bo.kind)
    if kind is None:
        raise ConfigError(f"model '{model}': unknown batch output kind {bo.kind}")
    where = f"batch_output {kind} {list(bo.target_name)}"
    if not bo.target_name:
        raise ConfigError(f"model '{model}': {where} needs a target_name")
    unknown = [t for t in bo.target_name if t not in output_names]
    if unknown:
        raise ConfigError(
            f"model '{model}': {where} has unknown target output(s) {unknown} (outputs are "
            f"{sorted(output_names)})"
        )
    source = _single_source(model, where, bo.source_input, input_names)
    return BatchOutputSpec(kind, tuple(bo.target_name), source)


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    version: int  # -1: the latest ready version
    input_map: tuple[tuple[str, str], ...]  # (composing model input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (composing model output, ensemble tensor)


def _ensemble_steps(
    config: mc.ModelConfig, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
) -> tuple[EnsembleStep, ...]:
    """Steps of an ensemble, checked as a dataflow: every step input is produced
    by the ensemble's inputs or an earlier-or-later step, and every ensemble
    output by some step."""
    name = config.name
    if not config.ensemble_scheduling.step:
        raise ConfigError(f"ensemble '{name}' has no ensemble_scheduling steps")
    steps = tuple(
        EnsembleStep(
            s.model_name,
            int(s.model_version) if s.model_version else -1,
            tuple(sorted(s.input_map.items())),
            tuple(sorted(s.output_map.items())),
        )
        for s in config.ensemble_scheduling.step
    )
    produced = {t.name for t in inputs}
    for step in steps:
        produced.update(tensor for _, tensor in step.output_map)
    for step in steps:
        if not step.model:
            raise ConfigError(f"ensemble '{name}': a step has no model_name")
        missing = [tensor for _, tensor in step.input_map if tensor not in produced]
        if missing:
            raise ConfigError(
                f"ensemble '{name}': step '{step.model}' reads {missing}, which no input or "
                f"step produces"
            )
    unproduced = [t.name for t in outputs if t.name not in produced]
    if unproduced:
        raise ConfigError(f"ensemble '{name}': no step produces outputs {unproduced}")
    return steps


_CONTROL_KINDS = {
    "CONTROL_SEQUENCE_START",
    "CONTROL_SEQUENCE_READY",
    "CONTROL_SEQUENCE_END",
    "CONTROL_SEQUENCE_CORRID",
}


def _control(name: str, c: mc.ModelSequenceBatching.Control, model: str) -> ControlInput:
    kind = mc.ModelSequenceBatching.Control.Kind.Name(c.kind)
    if kind == "CONTROL_SEQUENCE_CORRID":
        try:
            datatype = from_config_enum(mc.DataType.Name(c.data_type))
        except (KeyError, ValueError):
            raise ConfigError(
                f"model '{model}': CORRID control '{name}' needs a data_type"
            ) from None
        if datatype.triton not in ("UINT64", "INT64", "UINT32", "INT32", "BYTES"):
            raise ConfigError(
                f"model '{model}': CORRID control '{name}' data_type must be an integer or string"
            )
        return ControlInput(name, kind, datatype)
    for field_name, triton, cast in (
        ("int32_false_true", "INT32", int),
        ("fp32_false_true", "FP32", float),
        ("bool_false_true", "BOOL", bool),
    ):
        values = list(getattr(c, field_name))
        if values:
            if len(values) != 2:
                raise ConfigError(
                    f"model '{model}': control '{name}' {field_name} needs exactly 2 values"
                )
            return ControlInput(name, kind, from_triton(triton), cast(values[0]), cast(values[1]))
    raise ConfigError(
        f"model '{model}': control '{name}' ({kind}) needs int32_false_true, fp32_false_true "
        f"or bool_false_true"
    )


def _initial_state(
    s: mc.ModelSequenceBatching.State, dims: tuple[int, ...], model: str
) -> tuple[str | None, tuple[int, ...]]:
    """A state's data file (None: zeros) and the shape its sequences start from.

    As in Triton, without initial_state every variable dim starts at 1; with
    one, its dims must be fixed and fit the state's dims."""
    if not s.initial_state:
        return None, tuple(1 if d == -1 else d for d in dims)
    if len(s.initial_state) > 1:
        raise ConfigError(
            f"model '{model}': state '{s.input_name}' has more than one initial_state"
        )
    init = s.initial_state[0]
    init_dims = tuple(int(d) for d in init.dims) or dims
    fits = len(init_dims) == len(dims) and all(
        d >= 0 and (want == -1 or d == want) for d, want in zip(init_dims, dims, strict=True)
    )
    if not fits:
        raise ConfigError(
            f"model '{model}': initial_state of state '{s.input_name}' needs fixed dims that "
            f"fit the state dims {list(dims)}, got {list(init_dims)}"
        )
    data_file = init.data_file if init.WhichOneof("state_data") == "data_file" else None
    return data_file, init_dims


def _sequence_spec(config: mc.ModelConfig) -> SequenceBatching:
    sb = config.sequence_batching
    name = config.name
    if config.HasField("dynamic_batching"):
        raise ConfigError(
            f"model '{name}': dynamic_batching and sequence_batching exclude each other"
        )
    controls = []
    for ci in sb.control_input:
        for c in ci.control:
            controls.append(_control(ci.name, c, name))
    kinds = [c.kind for c in controls]
    dupes = {k for k in kinds if kinds.count(k) > 1}
    if dupes:
        raise ConfigError(f"model '{name}': sequence control {sorted(dupes)} declared twice")
    states = []
    for s in sb.state:
        try:
            datatype = from_config_enum(mc.DataType.Name(s.data_type))
        except (KeyError, ValueError):
            raise ConfigError(
                f"model '{name}': state '{s.input_name}' has no valid data_type"
            ) from None
        if not s.input_name or not s.output_name:
            raise ConfigError(f"model '{name}': a state needs input_name and output_name")
        dims = tuple(int(d) for d in s.dims)
        if any(d < 1 and d != -1 for d in dims):
            raise ConfigError(
                f"model '{name}': state '{s.input_name}' dims must be positive or -1 "
                f"(variable), got {list(dims)}"
            )
        initial, initial_dims = _initial_state(s, dims, name)
        states.append(StateSpec(s.input_name, s.output_name, datatype, dims, initial, initial_dims))
    strategy = sb.WhichOneof("strategy_choice") or "direct"
    delay = getattr(sb, strategy).max_queue_delay_microseconds
    return SequenceBatching(
        strategy=strategy,
        max_idle_us=int(sb.max_sequence_idle_microseconds) or DEFAULT_SEQUENCE_IDLE_US,
        controls=tuple(controls),
        states=tuple(states),
        max_queue_delay_us=int(delay),
        max_candidates=int(sb.oldest.max_candidate_sequences) if strategy == "oldest" else 0,
    )


def _warmup_specs(
    config: mc.ModelConfig, inputs: tuple[TensorSpec, ...], sequence: SequenceBatching | None
) -> tuple[WarmupSpec, ...]:
    """model_warmup, checked as Triton checks it at load: a name, batch_size
    1..max_batch_size (1 for a model that does not batch), and for every
    model input (control and state tensors included, as Triton's warmup
    feeds the model directly) one entry with the input's data type, fixed
    dims and exactly one data source."""
    name = config.name
    model_inputs = {t.name: (t.datatype, t.dims) for t in inputs}
    if sequence is not None:
        model_inputs.update({c.name: (c.datatype, (1,)) for c in sequence.controls})
        model_inputs.update({s.input_name: (s.datatype, s.dims) for s in sequence.states})
    out = []
    for w in config.model_warmup:
        where = f"model '{name}': model_warmup '{w.name}'"
        if not w.name:
            raise ConfigError(f"model '{name}': a model_warmup has no name")
        batch = int(w.batch_size)
        top = max(int(config.max_batch_size), 1)
        if not 1 <= batch <= top:
            raise ConfigError(f"{where}: batch_size {batch} must be in 1..{top}")
        unknown = sorted(set(w.inputs) - set(model_inputs))
        if unknown:
            raise ConfigError(
                f"{where}: input(s) {unknown} are not model inputs ({sorted(model_inputs)})"
            )
        missing = sorted(set(model_inputs) - set(w.inputs))
        if missing:
            raise ConfigError(f"{where}: no warmup data for input(s) {missing}")
        warm_inputs = []
        for input_name, wi in sorted(w.inputs.items()):
            datatype, dims = model_inputs[input_name]
            given = _enum_name(mc.DataType, wi.data_type)
            if given != datatype.config_enum:
                raise ConfigError(
                    f"{where}: input '{input_name}' has data_type {given}, the model input is "
                    f"{datatype.config_enum}"
                )
            warm_dims = tuple(int(d) for d in wi.dims)
            fits = len(warm_dims) == len(dims) and all(
                d > 0 and want in (-1, d) for d, want in zip(warm_dims, dims, strict=True)
            )
            if not fits:
                raise ConfigError(
                    f"{where}: input '{input_name}' dims {list(warm_dims)} must be fixed and fit "
                    f"the input's dims {list(dims)}"
                )
            source = wi.WhichOneof("input_data_type")
            if source is None:
                raise ConfigError(
                    f"{where}: input '{input_name}' needs zero_data, random_data or input_data_file"
                )
            data_file = wi.input_data_file if source == "input_data_file" else ""
            if source == "input_data_file" and (
                not data_file or Path(data_file).is_absolute() or ".." in Path(data_file).parts
            ):
                raise ConfigError(
                    f"{where}: input '{input_name}' input_data_file must be a file name under "
                    f"the model's warmup/ folder, got {data_file!r}"
                )
            warm_inputs.append(WarmupInput(input_name, datatype, warm_dims, source, data_file))
        out.append(WarmupSpec(w.name, batch, tuple(warm_inputs), int(w.count) or 1))
    return tuple(out)


def _queue_policy(p: mc.ModelQueuePolicy) -> QueuePolicySpec:
    return QueuePolicySpec(
        timeout_action=mc.ModelQueuePolicy.TimeoutAction.Name(p.timeout_action),
        default_timeout_us=int(p.default_timeout_microseconds),
        allow_timeout_override=bool(p.allow_timeout_override),
        max_queue_size=int(p.max_queue_size),
    )


def select_versions(config: mc.ModelConfig, available: list[int]) -> list[int]:
    """Apply version_policy (default: latest 1) to the version folders found."""
    available = sorted(available)
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if which == "all":
        return available
    if which == "specific":
        wanted = {int(v) for v in policy.specific.versions}
        missing = sorted(wanted - set(available))
        if missing:
            raise ConfigError(f"version_policy asks for versions {missing} that have no folder")
        return sorted(wanted)
    num = policy.latest.num_versions if which == "latest" else 1
    return available[-max(num, 1) :]
