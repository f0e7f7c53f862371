"""stageserve/config.py and stageserve/repository.py: parsing, defaults, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageserve.config import (
    DEFAULT_ONNX_FILENAME,
    ONNX_PLATFORM,
    ConfigError,
    DynamicBatching,
    InstanceGroup,
    TensorSpec,
    parse_config_text,
    read_config,
    select_versions,
    to_spec,
)
from stageserve.datatypes import from_triton
from stageserve.repository import RepositoryModel, model_names, read_model, version_folders

IO = """
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def cfg(body: str = "", name: str = "m", platform: str = ONNX_PLATFORM, io: str = IO):
    head = f'name: "{name}"\n' if name else ""
    if platform:
        head += f'platform: "{platform}"\n'
    return parse_config_text(head + body + io)


def spec(body: str = "", **kw):
    return to_spec(cfg(body, **kw))


def refused(body: str = "", *words, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        spec(body, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    return str(info.value)


# ====================================================================== parse


def test_parse_error_is_config_error():
    with pytest.raises(ConfigError, match="does not parse"):
        parse_config_text('name: "m"\nmax_batch_size: "eight"\n')


def test_parse_unknown_field_is_config_error():
    with pytest.raises(ConfigError, match="does not parse"):
        parse_config_text('name: "m"\nno_such_field: 3\n')


def test_parse_unknown_enum_is_config_error():
    with pytest.raises(ConfigError):
        parse_config_text('input [ { name: "X" data_type: TYPE_FLOAT dims: [ 1 ] } ]')


# ====================================================================== defaults


def test_minimal_config_defaults():
    s = spec()
    assert s.name == "m"
    assert s.platform == ONNX_PLATFORM
    assert s.max_batch_size == 0 and not s.batching
    assert s.dynamic_batching is None
    assert s.instance_groups == (InstanceGroup("m_0", 1, "KIND_AUTO"),)
    assert s.model_filename == DEFAULT_ONNX_FILENAME == "model.onnx"
    assert s.parameters == {}
    assert s.inputs == (TensorSpec("X", from_triton("FP32"), (4,)),)
    assert s.outputs == (TensorSpec("Y", from_triton("FP32"), (4,)),)
    assert s.input("X") is s.inputs[0] and s.input("Y") is None
    assert s.output("Y") is s.outputs[0] and s.output("X") is None


def test_backend_onnxruntime_means_onnx_platform():
    s = spec('backend: "onnxruntime"\n', platform="")
    assert s.platform == ONNX_PLATFORM


def test_default_model_filename_override():
    assert spec('default_model_filename: "net.onnx"\n').model_filename == "net.onnx"


def test_instance_group_defaults_and_values():
    s = spec(
        """
instance_group [
  { kind: KIND_CPU },
  { name: "gpus" count: 3 kind: KIND_GPU gpus: [ 0, 2 ] },
  { }
]
"""
    )
    assert s.instance_groups == (
        InstanceGroup("m_0", 1, "KIND_CPU"),
        InstanceGroup("gpus", 3, "KIND_GPU", (0, 2)),
        InstanceGroup("m_2", 1, "KIND_AUTO"),
    )


def test_negative_instance_count():
    refused("instance_group [ { count: -1 } ]", "count")


def test_parameters_and_batching():
    s = spec(
        """
max_batch_size: 16
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
dynamic_batching { preferred_batch_size: [ 8, 4, 8 ] max_queue_delay_microseconds: 250
                   preserve_ordering: true }
"""
    )
    assert s.batching and s.max_batch_size == 16
    assert s.parameters == {"intra_op_thread_count": "2"}
    assert s.dynamic_batching == DynamicBatching((4, 8), 250, True)


def test_dynamic_batching_defaults():
    s = spec("max_batch_size: 4\ndynamic_batching { }\n")
    assert s.dynamic_batching == DynamicBatching((), 0, False)


def test_optional_input_and_reshape():
    s = spec(
        io="""
input [
  { name: "A" data_type: TYPE_INT64 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } },
  { name: "B" data_type: TYPE_STRING dims: [ -1 ] optional: true }
]
output [ { name: "Y" data_type: TYPE_BOOL dims: [ 1 ] reshape: { shape: [ ] } } ]
"""
    )
    a, b = s.inputs
    assert a.reshape == (6,) and not a.optional and a.datatype.triton == "INT64"
    assert b.reshape is None and b.optional and b.datatype.triton == "BYTES"
    assert s.outputs[0].reshape == ()


@pytest.mark.parametrize(
    "dims,shape,ok",
    [
        ((4,), (4,), True),
        ((4,), (5,), False),
        ((-1, 3), (7, 3), True),
        ((-1, 3), (7, 4), False),
        ((-1,), (0,), True),
        ((2,), (2, 1), False),
        ((2, 1), (2,), False),
        ((), (), True),
    ],
)
def test_tensor_spec_matches(dims, shape, ok):
    assert TensorSpec("t", from_triton("FP32"), dims).matches(shape) is ok


# ====================================================================== refusals


@pytest.mark.parametrize(
    "platform,backend",
    [("tensorrt_plan", ""), ("", "tensorflow"), ("", "")],
)
def test_unsupported_platform(platform, backend):
    body = f'backend: "{backend}"\n' if backend else ""
    refused(body, "not supported", "'m'", platform=platform)


def test_python_backend_model():
    s = spec('backend: "python"\nmodel_transaction_policy { decoupled: true }\n', platform="")
    assert (s.backend, s.platform, s.model_filename, s.decoupled) == (
        "python",
        "python",
        "model.py",
        True,
    )
    refused("model_transaction_policy { decoupled: true }\n", "decoupled")  # ONNX: refused


def test_negative_max_batch_size():
    refused("max_batch_size: -1\n", "max_batch_size")


def test_no_inputs():
    refused("", "no inputs", io='output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]')


def test_no_outputs():
    refused("", "no outputs", io='input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]')


@pytest.mark.parametrize("dims", ["[ 0 ]", "[ 2, -2 ]", "[ -5 ]", "[ 3, 0, 1 ]"])
@pytest.mark.parametrize("where", ["input", "output"])
def test_bad_dims(dims, where):
    ok = '{ name: "OK" data_type: TYPE_FP32 dims: [ 1 ] }'
    bad = f'{{ name: "BAD" data_type: TYPE_FP32 dims: {dims} }}'
    io = (
        f"input [ {bad} ]\noutput [ {ok} ]"
        if where == "input"
        else f"input [ {ok} ]\noutput [ {bad} ]"
    )
    refused("", "'BAD'", "invalid dims", where, io=io)


@pytest.mark.parametrize("where", ["input", "output"])
def test_invalid_data_type(where):
    ok = '{ name: "OK" data_type: TYPE_FP32 dims: [ 1 ] }'
    bad = '{ name: "BAD" data_type: TYPE_INVALID dims: [ 1 ] }'
    io = (
        f"input [ {bad} ]\noutput [ {ok} ]"
        if where == "input"
        else f"input [ {ok} ]\noutput [ {bad} ]"
    )
    refused("", "'BAD'", "TYPE_INVALID", io=io)


def test_missing_data_type_is_invalid():
    refused(
        "",
        "TYPE_INVALID",
        io="""
input [ { name: "X" dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
""",
    )


def test_tensor_without_name():
    refused(
        "",
        "no name",
        io="""
input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
""",
    )


@pytest.mark.parametrize("where", ["input", "output"])
def test_duplicate_names(where):
    t = '{ name: "T" data_type: TYPE_FP32 dims: [ 1 ] }'
    ok = '{ name: "OK" data_type: TYPE_FP32 dims: [ 1 ] }'
    io = (
        f"input [ {t}, {t} ]\noutput [ {ok} ]"
        if where == "input"
        else f"input [ {ok} ]\noutput [ {t}, {t} ]"
    )
    refused("", "twice", where, io=io)


def test_same_name_for_input_and_output_is_allowed():
    s = spec(
        io="""
input [ { name: "T" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "T" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
    )
    assert s.input("T") and s.output("T")


def test_reshape_element_count_mismatch():
    refused(
        "",
        "reshape",
        "'X'",
        io="""
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 5 ] } } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
""",
    )


def test_dynamic_batching_with_max_batch_size_zero():
    refused("dynamic_batching { }\n", "max_batch_size")


@pytest.mark.parametrize("preferred", ["[ 0 ]", "[ 9 ]", "[ 4, 16 ]"])
def test_preferred_size_outside_range(preferred):
    msg = refused(
        f"max_batch_size: 8\ndynamic_batching {{ preferred_batch_size: {preferred} }}\n",
        "preferred_batch_size",
        "1..8",
    )
    assert "4]" not in msg  # only the bad sizes are named


def test_preferred_size_equal_to_max_is_fine():
    s = spec("max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 1, 8 ] }\n")
    assert s.dynamic_batching.preferred_batch_sizes == (1, 8)


# ====================================================================== versions


def test_version_policy_default_latest_one():
    assert select_versions(cfg(), [3, 1, 2]) == [3]
    assert select_versions(cfg(), []) == []


@pytest.mark.parametrize(
    "n,expected", [(1, [7]), (2, [3, 7]), (3, [1, 3, 7]), (10, [1, 3, 7]), (0, [7])]
)
def test_version_policy_latest_n(n, expected):
    c = cfg(f"version_policy: {{ latest: {{ num_versions: {n} }} }}\n")
    assert select_versions(c, [7, 1, 3]) == expected


def test_version_policy_all():
    c = cfg("version_policy: { all: { } }\n")
    assert select_versions(c, [2, 10, 1]) == [1, 2, 10]


def test_version_policy_specific():
    c = cfg("version_policy: { specific: { versions: [ 3, 1, 3 ] } }\n")
    assert select_versions(c, [1, 2, 3, 4]) == [1, 3]


def test_version_policy_specific_missing_folder():
    c = cfg("version_policy: { specific: { versions: [ 2, 5 ] } }\n")
    with pytest.raises(ConfigError, match=r"\[5\]"):
        select_versions(c, [1, 2])


def test_version_numbers_sort_numerically():
    c = cfg("version_policy: { latest: { num_versions: 2 } }\n")
    assert select_versions(c, [9, 10, 2]) == [9, 10]


# ====================================================================== repository


CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def make_model(
    root: Path, name: str, config: str | bytes | None = CONFIG, versions=(1,), filename="model.onnx"
) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if config is not None:
        p = d / "config.pbtxt"
        if isinstance(config, bytes):
            p.write_bytes(config)
        else:
            p.write_text(config)
    for v in versions:
        (d / str(v)).mkdir()
        if filename:
            (d / str(v) / filename).write_bytes(b"onnx")
    return d


def broken(root: Path, name: str, *words) -> RepositoryModel:
    m = read_model(root, name)
    assert isinstance(m, RepositoryModel)
    assert not m.ok and m.error
    assert m.spec is None and m.versions == ()
    for w in words:
        assert w in m.error, f"{w!r} not in {m.error!r}"
    return m


def test_read_model_ok_name_from_directory(tmp_path):
    make_model(tmp_path, "resnet", versions=(1, 2))
    m = read_model(tmp_path, "resnet")
    assert m.ok and m.error is None
    assert m.name == "resnet" and m.path == tmp_path / "resnet"
    assert m.config.name == "resnet"
    assert m.spec.name == "resnet" and m.spec.max_batch_size == 4
    assert m.versions == (2,)


def test_read_model_explicit_matching_name(tmp_path):
    make_model(tmp_path, "net", 'name: "net"\n' + CONFIG)
    assert read_model(tmp_path, "net").ok


def test_read_model_name_directory_mismatch(tmp_path):
    make_model(tmp_path, "net", 'name: "other"\n' + CONFIG)
    m = broken(tmp_path, "net", "'other'", "'net'")
    assert m.config is None


def test_read_config_missing_file(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="no config.pbtxt"):
        read_config(tmp_path / "m")


def test_read_model_not_in_repository(tmp_path):
    broken(tmp_path, "ghost", "'ghost'", "not in the repository")


def test_read_model_no_config(tmp_path):
    make_model(tmp_path, "m", None)
    broken(tmp_path, "m", "config.pbtxt")


def test_read_model_broken_config_text(tmp_path):
    make_model(tmp_path, "m", CONFIG + "\nthis is { not pbtxt")
    broken(tmp_path, "m", "does not parse")


def test_read_model_config_not_utf8(tmp_path):
    make_model(tmp_path, "m", b'name: "m"\n\xff\xfe\x00garbage')
    broken(tmp_path, "m", "config.pbtxt")


def test_read_model_invalid_spec_keeps_config(tmp_path):
    make_model(tmp_path, "m", CONFIG.replace("onnxruntime_onnx", "tensorrt_plan"))
    m = broken(tmp_path, "m", "not supported")
    assert m.config is not None and m.config.platform == "tensorrt_plan"


def test_read_model_missing_model_file(tmp_path):
    make_model(tmp_path, "m", versions=(1,), filename=None)
    broken(tmp_path, "m", "version 1", "missing model file", "model.onnx")


def test_read_model_custom_filename(tmp_path):
    cfg_text = CONFIG + 'default_model_filename: "net.onnx"\n'
    make_model(tmp_path, "a", cfg_text, filename="net.onnx")
    assert read_model(tmp_path, "a").ok
    make_model(tmp_path, "b", cfg_text, filename="model.onnx")
    broken(tmp_path, "b", "net.onnx")


def test_read_model_missing_file_only_in_selected_version_matters(tmp_path):
    d = make_model(tmp_path, "m", versions=(1, 2))
    (d / "1" / "model.onnx").unlink()
    assert read_model(tmp_path, "m").versions == (2,)  # latest 1 ignores version 1
    (d / "config.pbtxt").write_text(CONFIG + "version_policy: { all: { } }\n")
    broken(tmp_path, "m", "version 1")


def test_read_model_no_version_folder(tmp_path):
    d = make_model(tmp_path, "m", versions=())
    (d / "notaversion").mkdir()
    (d / "3").write_text("a file, not a folder")
    broken(tmp_path, "m", "no version folder")


def test_read_model_specific_version_missing_folder(tmp_path):
    make_model(
        tmp_path,
        "m",
        CONFIG + "version_policy: { specific: { versions: [ 1, 4 ] } }\n",
        versions=(1, 2),
    )
    broken(tmp_path, "m", "[4]")


def test_read_model_version_policy_all(tmp_path):
    make_model(tmp_path, "m", CONFIG + "version_policy: { all: { } }\n", versions=(3, 1, 12))
    assert read_model(tmp_path, "m").versions == (1, 3, 12)


def test_read_model_version_policy_latest_n(tmp_path):
    make_model(
        tmp_path,
        "m",
        CONFIG + "version_policy: { latest: { num_versions: 2 } }\n",
        versions=(3, 1, 12),
    )
    assert read_model(tmp_path, "m").versions == (3, 12)


def test_read_model_bad_config_values_never_raise(tmp_path):
    bad = {
        "dyn0": CONFIG.replace("max_batch_size: 4", "max_batch_size: 0") + "dynamic_batching { }",
        "dims": CONFIG.replace("dims: [ 4 ] }", "dims: [ 0 ] }", 1),
        "pref": CONFIG + "dynamic_batching { preferred_batch_size: [ 5 ] }",
        "noin": CONFIG.split("input")[0]
        + 'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]',
    }
    for name, text in bad.items():
        make_model(tmp_path, name, text)
        broken(tmp_path, name)


def test_version_folders_only_numeric_dirs(tmp_path):
    d = tmp_path / "m"
    for n in ("1", "10", "2", "abc", "-3", ".5"):
        (d / n).mkdir(parents=True)
    (d / "7").write_text("file")
    assert version_folders(d) == [1, 2, 10]


def test_model_names_lists_directories(tmp_path):
    for n in ("b", "a", ".hidden"):
        (tmp_path / n).mkdir()
    (tmp_path / "file.txt").write_text("x")
    assert model_names(tmp_path) == ["a", "b"]


def test_numeric_unknown_data_type_is_config_error():
    refused(
        "",
        "'X'",
        "99",
        io="""
input [ { name: "X" data_type: 99 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
""",
    )


def test_numeric_unknown_instance_kind_is_config_error():
    refused("instance_group [ { kind: 7 } ]\n", "kind 7")


def test_read_model_numeric_unknown_enums_never_raise(tmp_path):
    make_model(tmp_path, "a", CONFIG.replace("TYPE_FP32", "42", 1))
    broken(tmp_path, "a", "42")
    make_model(tmp_path, "b", CONFIG + "instance_group [ { kind: 9 } ]\n")
    broken(tmp_path, "b", "kind 9")


# ============================================================ implicit state


def _state(fields: str) -> str:
    return (
        "max_batch_size: 4\nsequence_batching { oldest { } state [ { "
        'input_name: "SI" output_name: "SO" data_type: TYPE_INT32 ' + fields + " } ] }\n"
    )


def test_fixed_state_starts_from_its_dims():
    (s,) = spec(_state("dims: [ 2, 3 ]")).sequence.states
    assert s.dims == (2, 3) and s.initial_dims == (2, 3) and not s.variable


def test_variable_state_without_initial_state_starts_with_ones():
    (s,) = spec(_state("dims: [ -1, 4 ] use_growable_memory: true")).sequence.states
    assert s.variable and s.initial_dims == (1, 4) and s.initial_file is None


def test_variable_state_takes_initial_state_dims():
    body = _state('dims: [ -1 ] initial_state { data_type: TYPE_INT32 dims: [ 3 ] data_file: "f" }')
    (s,) = spec(body).sequence.states
    assert s.initial_dims == (3,) and s.initial_file == "f"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ("dims: [ 0 ]", ["positive or -1"]),
        ("dims: [ -2 ]", ["positive or -1"]),
        (
            "dims: [ -1 ] initial_state { data_type: TYPE_INT32 zero_data: true }",
            ["initial_state", "fixed dims"],
        ),
        (
            "dims: [ 2 ] initial_state { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true }",
            ["fit the state dims"],
        ),
        (
            "dims: [ -1 ] initial_state { data_type: TYPE_INT32 dims: [ 2, 2 ] zero_data: true }",
            ["fit the state dims"],
        ),
        (
            "dims: [ 1 ] initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } "
            "initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }",
            ["more than one initial_state"],
        ),
    ],
)
def test_bad_state_dims_are_refused(fields, words):
    refused(_state(fields), "'SI'", *words)


def test_decoupled_sequence_model_runs_without_state_and_is_refused_with_one():
    python = 'backend: "python"\nmodel_transaction_policy { decoupled: true }\n'
    s = spec(python + "max_batch_size: 4\nsequence_batching { oldest { } }\n", platform="")
    assert s.decoupled and s.sequence is not None
    refused(python + _state("dims: [ 1 ]"), "state", "decoupled", platform="")
