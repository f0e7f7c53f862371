"""Our protos/*.proto must be wire-compatible with NVIDIA Triton's.

The reference is the pair of descriptors that ship inside ``tritonclient``
(``tritonclient.grpc.service_pb2`` / ``model_config_pb2``). Our files are
compiled with ``grpc_tools.protoc`` into a descriptor set and compared as
``FileDescriptorProto`` data: every message, nested message, map entry,
enum, enum value, field and service method Triton declares must exist in
ours with the same name, number, type, label, type name, oneof and
streaming flags.

Our generated modules are never imported here: tritonclient already
registers the same ``inference.*`` symbols in protobuf's default descriptor
pool, so ours are loaded into a private ``DescriptorPool`` instead.
"""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
from tritonclient.grpc import service_pb2 as triton_service_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS_DIR = REPO_ROOT / "protos"
PROTO_FILES = ("model_config.proto", "grpc_service.proto")

FDP = descriptor_pb2.FieldDescriptorProto
TYPE_NAMES = {v: k for k, v in FDP.Type.items()}
LABEL_NAMES = {v: k for k, v in FDP.Label.items()}

# Parts of Triton's schema that are newer than the oldest tritonclient we
# test against (2.41); taken from the descriptors of tritonclient 2.73.
# Ours carries them; when the installed tritonclient already has them, the
# generic comparison covers them as well.
# (full field name, number, label, type, type_name)
_STATS = ".inference.StatisticDuration"
_METRIC_CONTROL = ".inference.ModelMetrics.MetricControl"
NEWER_FIELDS_TABLE = [
    ("inference.ModelInput.is_non_linear_format_io", 9, "optional", "bool", ""),
    ("inference.ModelOutput.is_non_linear_format_io", 7, "optional", "bool", ""),
    ("inference.ModelEnsembling.max_inflight_requests", 2, "optional", "uint32", ""),
    ("inference.ModelConfig.runtime", 25, "optional", "string", ""),
    ("inference.ModelConfig.model_metrics", 26, "optional", "message", ".inference.ModelMetrics"),
    ("inference.ModelMetrics.metric_control", 1, "repeated", "message", _METRIC_CONTROL),
    (
        "inference.ModelMetrics.MetricControl.metric_identifier",
        1,
        "optional",
        "message",
        _METRIC_CONTROL + ".MetricIdentifier",
    ),
    (
        "inference.ModelMetrics.MetricControl.histogram_options",
        2,
        "optional",
        "message",
        _METRIC_CONTROL + ".HistogramOptions",
    ),
    ("inference.ModelMetrics.MetricControl.MetricIdentifier.family", 1, "optional", "string", ""),
    ("inference.ModelMetrics.MetricControl.HistogramOptions.buckets", 1, "repeated", "double", ""),
    (
        "inference.ModelStatistics.response_stats",
        9,
        "repeated",
        "message",
        ".inference.ModelStatistics.ResponseStatsEntry",
    ),
    ("inference.ModelStatistics.ResponseStatsEntry.key", 1, "optional", "string", ""),
    (
        "inference.ModelStatistics.ResponseStatsEntry.value",
        2,
        "optional",
        "message",
        ".inference.InferResponseStatistics",
    ),
    ("inference.InferResponseStatistics.compute_infer", 1, "optional", "message", _STATS),
    ("inference.InferResponseStatistics.compute_output", 2, "optional", "message", _STATS),
    ("inference.InferResponseStatistics.success", 3, "optional", "message", _STATS),
    ("inference.InferResponseStatistics.fail", 4, "optional", "message", _STATS),
    ("inference.InferResponseStatistics.empty_response", 5, "optional", "message", _STATS),
    ("inference.InferResponseStatistics.cancel", 6, "optional", "message", _STATS),
]
NEWER_FIELDS = {row[0]: row[1:] for row in NEWER_FIELDS_TABLE}
NEWER_MESSAGES = {
    "inference.ModelMetrics",
    "inference.ModelMetrics.MetricControl",
    "inference.ModelMetrics.MetricControl.MetricIdentifier",
    "inference.ModelMetrics.MetricControl.HistogramOptions",
    "inference.ModelStatistics.ResponseStatsEntry",
    "inference.InferResponseStatistics",
}
NEWER_ONEOFS = {"inference.ModelMetrics.MetricControl.metric_options"}


# --------------------------------------------------------------------------
# Loading descriptors
# --------------------------------------------------------------------------


def _grpc_tools_include_dir() -> str:
    """grpc_tools' bundled include dir (google/protobuf/*.proto)."""
    include = importlib.resources.files("grpc_tools") / "_proto"
    assert include.joinpath("google", "protobuf", "descriptor.proto").is_file(), include
    return str(include)


@pytest.fixture(scope="module")
def our_descriptor_set(tmp_path_factory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("protos") / "stageserve.protoset"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTOS_DIR}",
        f"-I{_grpc_tools_include_dir()}",
        "--include_imports",
        f"--descriptor_set_out={out}",
        *(str(PROTOS_DIR / name) for name in PROTO_FILES),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"protoc failed:\n{proc.stdout}\n{proc.stderr}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def ours(our_descriptor_set) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    return {f.name: f for f in our_descriptor_set.file}


@pytest.fixture(scope="module")
def triton() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    files = {}
    for module in (triton_model_config_pb2, triton_service_pb2):
        fdp = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        files[fdp.name] = fdp
    return files


class Index:
    """Every message, enum and service of a set of files, by full name."""

    def __init__(self, files):
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
        self.services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
        for fdp in files:
            prefix = fdp.package
            for enum in fdp.enum_type:
                self.enums[f"{prefix}.{enum.name}"] = enum
            for msg in fdp.message_type:
                self._add_message(prefix, msg)
            for svc in fdp.service:
                self.services[f"{prefix}.{svc.name}"] = svc

    def _add_message(self, prefix: str, msg: descriptor_pb2.DescriptorProto) -> None:
        full = f"{prefix}.{msg.name}"
        self.messages[full] = msg
        for enum in msg.enum_type:
            self.enums[f"{full}.{enum.name}"] = enum
        for nested in msg.nested_type:
            self._add_message(full, nested)

    def is_map(self, field: descriptor_pb2.FieldDescriptorProto) -> bool:
        if field.type != FDP.TYPE_MESSAGE or field.label != FDP.LABEL_REPEATED:
            return False
        target = self.messages.get(field.type_name.lstrip("."))
        return bool(target and target.options.map_entry)


def _field_signature(index: Index, msg: descriptor_pb2.DescriptorProto, field) -> dict:
    return {
        "number": field.number,
        "type": TYPE_NAMES[field.type],
        "label": LABEL_NAMES[field.label],
        "type_name": field.type_name,
        "oneof": (
            msg.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
        ),
        "proto3_optional": field.proto3_optional,
        "json_name": field.json_name or None,
        "default_value": field.default_value or None,
        "options": field.options.SerializeToString(deterministic=True),
        "map": index.is_map(field),
    }


# --------------------------------------------------------------------------
# Structural comparison against tritonclient's descriptors
# --------------------------------------------------------------------------


def test_files_package_and_imports(ours, triton):
    assert set(PROTO_FILES) <= set(ours)
    for name, theirs in triton.items():
        mine = ours[name]
        assert mine.package == theirs.package == "inference"
        assert mine.syntax == theirs.syntax == "proto3"
        assert list(mine.dependency) == list(theirs.dependency), name
    assert list(ours["grpc_service.proto"].dependency) == ["model_config.proto"]


def test_every_triton_message_and_field_matches(ours, triton):
    mine, theirs = Index(ours.values()), Index(triton.values())
    problems: list[str] = []
    for full, their_msg in sorted(theirs.messages.items()):
        my_msg = mine.messages.get(full)
        if my_msg is None:
            problems.append(f"missing message {full}")
            continue
        if my_msg.options.map_entry != their_msg.options.map_entry:
            problems.append(f"{full}: map_entry {my_msg.options.map_entry}")
        their_oneofs = [o.name for o in their_msg.oneof_decl]
        my_oneofs = [o.name for o in my_msg.oneof_decl]
        if not set(their_oneofs) <= set(my_oneofs):
            problems.append(f"{full}: oneofs {my_oneofs} != {their_oneofs}")
        for rng in their_msg.reserved_range:
            if rng not in my_msg.reserved_range:
                problems.append(f"{full}: reserved range {rng.start}-{rng.end} missing")
        if not set(their_msg.reserved_name) <= set(my_msg.reserved_name):
            problems.append(f"{full}: reserved names differ")
        my_fields = {f.name: f for f in my_msg.field}
        for their_field in their_msg.field:
            my_field = my_fields.get(their_field.name)
            if my_field is None:
                problems.append(f"missing field {full}.{their_field.name}")
                continue
            want = _field_signature(theirs, their_msg, their_field)
            got = _field_signature(mine, my_msg, my_field)
            if want["json_name"] is None:  # older protoc builds leave it out
                del want["json_name"]
            for key in want:
                if got[key] != want[key]:
                    problems.append(
                        f"{full}.{their_field.name}: {key} is {got[key]!r}, "
                        f"Triton has {want[key]!r}"
                    )
    assert not problems, "\n".join(problems)


def test_every_triton_enum_matches(ours, triton):
    mine, theirs = Index(ours.values()), Index(triton.values())
    problems: list[str] = []
    for full, their_enum in sorted(theirs.enums.items()):
        my_enum = mine.enums.get(full)
        if my_enum is None:
            problems.append(f"missing enum {full}")
            continue
        want = [(v.name, v.number) for v in their_enum.value]
        got = [(v.name, v.number) for v in my_enum.value]
        if got != want:
            problems.append(f"enum {full}: {got} != Triton {want}")
    assert not problems, "\n".join(problems)


def test_service_methods_match(ours, triton):
    mine, theirs = Index(ours.values()), Index(triton.values())
    assert set(theirs.services) == {"inference.GRPCInferenceService"}
    problems: list[str] = []
    for full, their_svc in theirs.services.items():
        my_svc = mine.services.get(full)
        if my_svc is None:
            problems.append(f"missing service {full}")
            continue
        my_methods = {m.name: m for m in my_svc.method}
        for their_m in their_svc.method:
            my_m = my_methods.get(their_m.name)
            if my_m is None:
                problems.append(f"missing rpc {full}.{their_m.name}")
                continue
            for attr in ("input_type", "output_type", "client_streaming", "server_streaming"):
                if getattr(my_m, attr) != getattr(their_m, attr):
                    problems.append(
                        f"rpc {their_m.name}: {attr} is {getattr(my_m, attr)!r}, "
                        f"Triton has {getattr(their_m, attr)!r}"
                    )
        extra = set(my_methods) - {m.name for m in their_svc.method}
        if extra:
            problems.append(f"{full}: rpcs Triton does not have: {sorted(extra)}")
    assert not problems, "\n".join(problems)


def test_only_known_newer_additions_beyond_tritonclient(ours, triton):
    """Whatever ours has beyond tritonclient must be a known newer Triton addition."""
    mine, theirs = Index(ours.values()), Index(triton.values())
    unexplained: list[str] = []
    for full, my_msg in mine.messages.items():
        their_msg = theirs.messages.get(full)
        if their_msg is None and full not in NEWER_MESSAGES:
            unexplained.append(f"message {full}")
        their_fields = {f.name for f in their_msg.field} if their_msg else set()
        their_oneofs = {o.name for o in their_msg.oneof_decl} if their_msg else set()
        for field in my_msg.field:
            if field.name not in their_fields and f"{full}.{field.name}" not in NEWER_FIELDS:
                unexplained.append(f"field {full}.{field.name}")
        for oneof in my_msg.oneof_decl:
            if oneof.name not in their_oneofs and f"{full}.{oneof.name}" not in NEWER_ONEOFS:
                unexplained.append(f"oneof {full}.{oneof.name}")
    for full, my_enum in mine.enums.items():
        their_enum = theirs.enums.get(full)
        if their_enum is None:
            unexplained.append(f"enum {full}")
        elif len(my_enum.value) != len(their_enum.value):
            unexplained.append(f"enum values of {full}")
    assert not unexplained, "not in Triton: " + ", ".join(sorted(unexplained))


def test_newer_triton_additions_present(ours):
    """Schema added by Triton after tritonclient 2.41 (checked from a fixed table)."""
    mine = Index(ours.values())
    for name in NEWER_MESSAGES:
        assert name in mine.messages, name
    assert mine.messages["inference.ModelStatistics.ResponseStatsEntry"].options.map_entry
    metric_control = mine.messages["inference.ModelMetrics.MetricControl"]
    histogram = next(f for f in metric_control.field if f.name == "histogram_options")
    assert metric_control.oneof_decl[histogram.oneof_index].name == "metric_options"
    for full, want in NEWER_FIELDS.items():
        msg_name, field_name = full.rsplit(".", 1)
        field = next((f for f in mine.messages[msg_name].field if f.name == field_name), None)
        assert field is not None, full
        got = (
            field.number,
            LABEL_NAMES[field.label].removeprefix("LABEL_").lower(),
            TYPE_NAMES[field.type].removeprefix("TYPE_").lower(),
            field.type_name,
        )
        assert got == want, full


# --------------------------------------------------------------------------
# Real config.pbtxt files parse into our ModelConfig
# --------------------------------------------------------------------------

DYNAMIC_BATCHING_CONFIG = r"""
name: "resnet50"
platform: "onnxruntime_onnx"
max_batch_size: 64
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  },
  {
    name: "scale"
    data_type: TYPE_FP16
    dims: [ 1 ]
    reshape: { shape: [ ] }
    optional: true
  }
]
output [
  {
    name: "probs"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
batch_input [
  {
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "ACC"
    data_type: TYPE_INT32
    source_input: "input"
  }
]
instance_group [
  {
    name: "gpu_group"
    count: 2
    kind: KIND_GPU
    gpus: [ 0, 1 ]
    rate_limiter {
      resources [ { name: "R1" count: 4 }, { name: "shared" global: true count: 1 } ]
      priority: 2
    }
  },
  { count: 1 kind: KIND_CPU }
]
dynamic_batching {
  preferred_batch_size: [ 16, 32 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 500000
    allow_timeout_override: true
    max_queue_size: 128
  }
  priority_queue_policy {
    key: 1
    value { timeout_action: DELAY default_timeout_microseconds: 1000 max_queue_size: 8 }
  }
  priority_queue_policy [
    { key: 3 value: { max_queue_size: 0 } }
  ]
}
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda {
    graphs: true
    busy_wait_events: true
    graph_spec [
      {
        batch_size: 8
        input { key: "input" value { dim: [ 3, 224, 224 ] } }
        graph_lower_bound { batch_size: 1 input { key: "input" value { dim: [ 3, 224, 224 ] } } }
      }
    ]
    output_copy_stream: true
  }
  execution_accelerators {
    gpu_execution_accelerator : [
      {
        name : "tensorrt"
        parameters { key: "precision_mode" value: "FP16" }
        parameters { key: "max_workspace_size_bytes" value: "1073741824" }
      }
    ]
    cpu_execution_accelerator : [ { name : "openvino" } ]
  }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: true }
  gather_kernel_buffer_threshold: 4
  eager_batching: true
}
parameters { key: "intra_op_thread_count" value: { string_value: "4" } }
parameters [ { key: "cudnn_conv_algo_search" value: { string_value: "1" } } ]
model_warmup [
  {
    name: "zeros"
    batch_size: 8
    count: 2
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
response_cache { enable: true }
default_model_filename: "model.onnx"
cc_model_filenames { key: "8.6" value: "model_sm86.plan" }
metric_tags { key: "team" value: "vision" }
model_repository_agents {
  agents [ { name: "checksum" parameters { key: "MD5:model.onnx" value: "abc" } } ]
}
"""

SEQUENCE_BATCHING_CONFIG = r"""
name: "stateful_rnn"
backend: "pytorch"
max_batch_size: 8
version_policy: { specific: { versions: [ 1, 3 ] } }
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [
  {
    count: 1
    kind: KIND_GPU
    secondary_devices [ { kind: KIND_NVDLA device_id: 0 } ]
    passive: false
    host_policy: "numa0"
  }
]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest {
    max_candidate_sequences: 4
    preferred_batch_size: [ 2, 4 ]
    max_queue_delay_microseconds: 100
    preserve_ordering: true
  }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "END"
      control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ]
    },
    {
      name: "READY"
      control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "CORRID"
      control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ]
    }
  ]
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [ -1 ]
      initial_state: {
        data_type: TYPE_INT32
        dims: [ 1 ]
        zero_data: true
        name: "initial state"
      }
      use_same_buffer_for_input_output: true
      use_growable_memory: true
    }
  ]
  iterative_sequence: false
}
model_transaction_policy { decoupled: true }
"""

ENSEMBLE_CONFIG = r"""
name: "pipeline"
platform: "ensemble"
max_batch_size: 4
version_policy: { all: { } }
input [ { name: "RAW" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "IN" value: "RAW" }
      output_map { key: "OUT" value: "pixels" }
    },
    {
      model_name: "classifier"
      model_version: 2
      input_map { key: "input" value: "pixels" }
      output_map { key: "probs" value: "SCORES" }
    }
  ]
}
"""


@pytest.fixture(scope="module")
def our_pool(our_descriptor_set) -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for fdp in our_descriptor_set.file:  # --include_imports lists dependencies first
        pool.Add(fdp)
    return pool


@pytest.fixture(scope="module")
def ModelConfig(our_pool):  # noqa: N802 - a message class
    return message_factory.GetMessageClass(our_pool.FindMessageTypeByName("inference.ModelConfig"))


def _enum(pool: descriptor_pool.DescriptorPool, enum_name: str, value: str) -> int:
    return pool.FindEnumTypeByName(f"inference.{enum_name}").values_by_name[value].number


def _roundtrip_through_triton(config) -> None:
    """Our bytes decode in Triton's class and re-encode to the same message."""
    theirs = triton_model_config_pb2.ModelConfig.FromString(config.SerializeToString())
    back = type(config).FromString(theirs.SerializeToString(deterministic=True))
    assert back == config
    assert text_format.MessageToString(theirs) == text_format.MessageToString(config)


def test_dynamic_batching_config_parses(ModelConfig, our_pool):  # noqa: N803
    cfg = text_format.Parse(DYNAMIC_BATCHING_CONFIG, ModelConfig())
    assert cfg.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert cfg.version_policy.WhichOneof("policy_choice") == "latest"
    assert cfg.version_policy.latest.num_versions == 2
    assert [i.name for i in cfg.input] == ["input", "scale"]
    assert cfg.input[0].data_type == _enum(our_pool, "DataType", "TYPE_FP32")
    assert cfg.input[0].format == _enum(our_pool, "ModelInput.Format", "FORMAT_NCHW")
    assert list(cfg.input[0].dims) == [3, 224, 224]
    assert cfg.input[1].HasField("reshape") and list(cfg.input[1].reshape.shape) == []
    assert cfg.output[0].label_filename == "labels.txt"
    assert cfg.batch_input[0].kind == _enum(
        our_pool, "BatchInput.Kind", "BATCH_ACCUMULATED_ELEMENT_COUNT"
    )

    gpu_group, cpu_group = cfg.instance_group
    assert gpu_group.kind == _enum(our_pool, "ModelInstanceGroup.Kind", "KIND_GPU")
    assert list(gpu_group.gpus) == [0, 1]
    assert gpu_group.rate_limiter.priority == 2
    resources = [(r.name, getattr(r, "global"), r.count) for r in gpu_group.rate_limiter.resources]
    assert resources == [("R1", False, 4), ("shared", True, 1)]
    assert cpu_group.kind == _enum(our_pool, "ModelInstanceGroup.Kind", "KIND_CPU")

    db = cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [16, 32]
    assert db.max_queue_delay_microseconds == 100
    assert db.preserve_ordering
    assert (db.priority_levels, db.default_priority_level) == (3, 2)
    reject = _enum(our_pool, "ModelQueuePolicy.TimeoutAction", "REJECT")
    delay = _enum(our_pool, "ModelQueuePolicy.TimeoutAction", "DELAY")
    assert db.default_queue_policy.timeout_action == reject
    assert db.default_queue_policy.default_timeout_microseconds == 500000
    assert db.default_queue_policy.allow_timeout_override
    assert db.default_queue_policy.max_queue_size == 128
    assert sorted(db.priority_queue_policy) == [1, 3]
    assert db.priority_queue_policy[1].timeout_action == delay
    assert db.priority_queue_policy[1].max_queue_size == 8

    opt = cfg.optimization
    assert opt.graph.level == 1
    assert opt.priority == _enum(our_pool, "ModelOptimizationPolicy.ModelPriority", "PRIORITY_MAX")
    assert opt.cuda.graphs and opt.cuda.busy_wait_events and opt.cuda.output_copy_stream
    spec = opt.cuda.graph_spec[0]
    assert spec.batch_size == 8 and list(spec.input["input"].dim) == [3, 224, 224]
    assert spec.graph_lower_bound.batch_size == 1
    trt = opt.execution_accelerators.gpu_execution_accelerator[0]
    assert trt.name == "tensorrt"
    assert dict(trt.parameters) == {
        "precision_mode": "FP16",
        "max_workspace_size_bytes": "1073741824",
    }
    assert opt.execution_accelerators.cpu_execution_accelerator[0].name == "openvino"
    assert not opt.input_pinned_memory.enable and opt.output_pinned_memory.enable
    assert opt.gather_kernel_buffer_threshold == 4 and opt.eager_batching

    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "intra_op_thread_count": "4",
        "cudnn_conv_algo_search": "1",
    }
    warmup = cfg.model_warmup[0]
    assert (warmup.name, warmup.batch_size, warmup.count) == ("zeros", 8, 2)
    assert warmup.inputs["input"].WhichOneof("input_data_type") == "zero_data"
    assert cfg.response_cache.enable
    assert cfg.default_model_filename == "model.onnx"
    assert dict(cfg.cc_model_filenames) == {"8.6": "model_sm86.plan"}
    assert dict(cfg.metric_tags) == {"team": "vision"}
    assert cfg.model_repository_agents.agents[0].parameters["MD5:model.onnx"] == "abc"
    _roundtrip_through_triton(cfg)


def test_sequence_batching_config_parses(ModelConfig, our_pool):  # noqa: N803
    cfg = text_format.Parse(SEQUENCE_BATCHING_CONFIG, ModelConfig())
    assert cfg.backend == "pytorch"
    assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"
    assert list(cfg.version_policy.specific.versions) == [1, 3]
    assert cfg.input[0].allow_ragged_batch
    group = cfg.instance_group[0]
    assert group.secondary_devices[0].kind == _enum(
        our_pool, "ModelInstanceGroup.SecondaryDevice.SecondaryDeviceKind", "KIND_NVDLA"
    )
    assert group.host_policy == "numa0"

    sb = cfg.sequence_batching
    assert sb.max_sequence_idle_microseconds == 5_000_000
    assert sb.WhichOneof("strategy_choice") == "oldest"
    assert sb.oldest.max_candidate_sequences == 4
    assert list(sb.oldest.preferred_batch_size) == [2, 4]
    assert sb.oldest.preserve_ordering

    def kind(name: str) -> int:
        return _enum(our_pool, "ModelSequenceBatching.Control.Kind", name)

    controls = {c.name: c.control[0] for c in sb.control_input}
    assert controls["START"].kind == kind("CONTROL_SEQUENCE_START")
    assert list(controls["START"].fp32_false_true) == [0.0, 1.0]
    assert list(controls["END"].bool_false_true) == [False, True]
    assert list(controls["READY"].int32_false_true) == [0, 1]
    assert controls["CORRID"].kind == kind("CONTROL_SEQUENCE_CORRID")
    assert controls["CORRID"].data_type == _enum(our_pool, "DataType", "TYPE_UINT64")

    state = sb.state[0]
    assert (state.input_name, state.output_name) == ("INPUT_STATE", "OUTPUT_STATE")
    assert list(state.dims) == [-1]
    init = state.initial_state[0]
    assert init.WhichOneof("state_data") == "zero_data" and init.name == "initial state"
    assert state.use_same_buffer_for_input_output and state.use_growable_memory
    assert cfg.model_transaction_policy.decoupled
    _roundtrip_through_triton(cfg)


def test_ensemble_config_parses(ModelConfig):  # noqa: N803
    cfg = text_format.Parse(ENSEMBLE_CONFIG, ModelConfig())
    assert cfg.WhichOneof("scheduling_choice") == "ensemble_scheduling"
    assert cfg.version_policy.WhichOneof("policy_choice") == "all"
    pre, cls = cfg.ensemble_scheduling.step
    assert (pre.model_name, pre.model_version) == ("preprocess", -1)
    assert dict(pre.input_map) == {"IN": "RAW"}
    assert dict(pre.output_map) == {"OUT": "pixels"}
    assert (cls.model_name, cls.model_version) == ("classifier", 2)
    assert dict(cls.output_map) == {"probs": "SCORES"}
    _roundtrip_through_triton(cfg)


def test_scheduling_choice_is_a_oneof(ModelConfig):  # noqa: N803
    with pytest.raises(text_format.ParseError):
        text_format.Parse("dynamic_batching { } sequence_batching { }", ModelConfig())


def test_model_config_response_embeds_our_model_config(our_pool, ModelConfig):  # noqa: N803
    """ModelConfigResponse.config is wire-identical for tritonclient."""
    response_cls = message_factory.GetMessageClass(
        our_pool.FindMessageTypeByName("inference.ModelConfigResponse")
    )
    response = response_cls(config=text_format.Parse(ENSEMBLE_CONFIG, ModelConfig()))
    theirs = triton_service_pb2.ModelConfigResponse.FromString(response.SerializeToString())
    assert theirs.config.name == "pipeline"
    assert theirs.config.ensemble_scheduling.step[1].output_map["probs"] == "SCORES"
