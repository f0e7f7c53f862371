"""Model configuration: config.pbtxt -> ModelConfig proto -> ModelSpec.

The text is parsed by protobuf's own text-format parser into our ModelConfig
(protos/model_config.proto, Triton's field names and numbers). ModelSpec is
the validated, defaults-applied view every stage works from; it is derived
from the proto once, at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from stageserve.datatypes import DataType, from_config_enum
from stageserve.generated import model_config_pb2 as mc

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
DEFAULT_ONNX_FILENAME = "model.onnx"


class ConfigError(ValueError):
    """A config.pbtxt that Triton would refuse to load."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: DataType
    dims: tuple[int, ...]  # without the batch dimension; -1 is variable
    reshape: tuple[int, ...] | None = None  # shape the model sees, if different
    optional: bool = False

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.dims) and all(
            d == -1 or d == s for d, s in zip(self.dims, shape, strict=True)
        )


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False


@dataclass(frozen=True)
class InstanceGroup:
    name: str
    count: int
    kind: str  # KIND_CPU / KIND_GPU / KIND_AUTO
    gpus: tuple[int, ...] = ()


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

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


def parse_config_text(text: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"config.pbtxt does not parse: {exc}") from exc
    return config


def read_config(model_dir: Path) -> mc.ModelConfig:
    path = model_dir / "config.pbtxt"
    if not path.is_file():
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
        raise ConfigError(f"{where} '{t.name}' of model '{model}' has data_type {enum_name}") from None
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
    return TensorSpec(t.name, datatype, dims, reshape, optional)


def to_spec(config: mc.ModelConfig) -> ModelSpec:
    """Validate a ModelConfig and derive the ModelSpec with Triton's defaults."""
    name = config.name
    platform = config.platform or (ONNX_PLATFORM if config.backend == ONNX_BACKEND else "")
    if platform != ONNX_PLATFORM:
        raise ConfigError(
            f"model '{name}': platform '{config.platform}' / backend '{config.backend}' is not "
            f"supported (StageServe serves '{ONNX_PLATFORM}' models)"
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
        dynamic = DynamicBatching(
            preferred_batch_sizes=tuple(sorted(set(preferred))),
            max_queue_delay_us=int(db.max_queue_delay_microseconds),
            preserve_ordering=bool(db.preserve_ordering),
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
            InstanceGroup(g.name or f"{name}_{i}", g.count or 1, kind, tuple(int(x) for x in g.gpus))
        )
    if not groups:
        groups.append(InstanceGroup(f"{name}_0", 1, "KIND_AUTO"))

    return ModelSpec(
        name=name,
        platform=platform,
        max_batch_size=int(config.max_batch_size),
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=dynamic,
        instance_groups=tuple(groups),
        model_filename=config.default_model_filename or DEFAULT_ONNX_FILENAME,
        parameters={k: v.string_value for k, v in config.parameters.items()},
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
