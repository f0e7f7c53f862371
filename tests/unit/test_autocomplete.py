"""Triton's auto-generated model configuration for ONNX models
(stageserve/autocomplete.py through read_model), with real ONNX files."""

from __future__ import annotations

from pathlib import Path

from stageserve.autocomplete_options import AutoComplete
from stageserve.generated import model_config_pb2 as mc
from stageserve.repository import read_model
from stageserve_tools.examples import identity_model, mlp_model


def _repo(root: Path, name: str, model, config: str | None = None) -> Path:
    d = root / name
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.onnx").write_bytes(model.SerializeToString())
    if config is not None:
        (d / "config.pbtxt").write_text(config)
    return d


def _io(tensors) -> list[tuple[str, str, list[int]]]:
    return [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in tensors]


def test_no_config_at_all_is_generated_from_a_batchable_model(tmp_path: Path) -> None:
    _repo(tmp_path, "mlp", mlp_model((8, 4, 3), max_batch_size=16))
    m = read_model(tmp_path, "mlp")
    assert m.ok, m.error
    c = m.config
    assert c is not None and m.spec is not None
    assert (c.name, c.platform, c.backend) == ("mlp", "onnxruntime_onnx", "onnxruntime")
    assert c.max_batch_size == 4 and c.HasField("dynamic_batching")
    assert _io(c.input) == [("INPUT0", "TYPE_FP32", [8])]
    assert _io(c.output) == [("OUTPUT0", "TYPE_FP32", [3])]
    assert m.spec.dynamic_batching is not None and m.versions == (1,)


def test_default_max_batch_size_is_configurable(tmp_path: Path) -> None:
    _repo(tmp_path, "mlp", mlp_model((8, 4, 3), max_batch_size=16))
    c32 = read_model(tmp_path, "mlp", AutoComplete(True, 32)).config
    assert c32 is not None and c32.max_batch_size == 32
    one = read_model(tmp_path, "mlp", AutoComplete(True, 1)).config
    assert one is not None
    assert one.max_batch_size == 1 and not one.HasField("dynamic_batching")  # only above 1


def test_a_given_max_batch_size_and_scheduler_are_kept(tmp_path: Path) -> None:
    _repo(
        tmp_path,
        "mlp",
        mlp_model((8, 4, 3), max_batch_size=16),
        'platform: "onnxruntime_onnx"\nmax_batch_size: 16\n'
        "dynamic_batching { max_queue_delay_microseconds: 100 }\n",
    )
    c = read_model(tmp_path, "mlp").config
    assert c is not None
    assert c.max_batch_size == 16
    assert c.dynamic_batching.max_queue_delay_microseconds == 100
    assert _io(c.input) == [("INPUT0", "TYPE_FP32", [8])]


def test_a_model_without_a_batch_dimension_keeps_max_batch_size_zero(tmp_path: Path) -> None:
    _repo(tmp_path, "fixed", mlp_model((8, 4, 3), max_batch_size=0), 'backend: "onnxruntime"\n')
    m = read_model(tmp_path, "fixed")
    assert m.ok, m.error
    assert m.config is not None
    assert m.config.max_batch_size == 0 and not m.config.HasField("dynamic_batching")
    assert _io(m.config.input) == [("INPUT0", "TYPE_FP32", [1, 8])]  # full shape, no batch dim


def test_a_non_batching_model_with_a_max_batch_size_is_refused(tmp_path: Path) -> None:
    _repo(
        tmp_path,
        "fixed",
        mlp_model((8, 4, 3), max_batch_size=0),
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n',
    )
    m = read_model(tmp_path, "fixed")
    assert not m.ok and m.error is not None
    assert "autofill failed for model 'fixed'" in m.error
    assert "does not support batching" in m.error


def test_declared_inputs_and_outputs_skip_auto_complete(tmp_path: Path) -> None:
    config = (
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    )
    _repo(tmp_path, "mlp", mlp_model((8, 4, 3), max_batch_size=16), config)
    c = read_model(tmp_path, "mlp").config
    assert c is not None
    assert not c.HasField("dynamic_batching")  # taken as written, as Triton does


def test_only_the_missing_side_is_filled(tmp_path: Path) -> None:
    config = (
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
    )
    _repo(tmp_path, "mlp", mlp_model((8, 4, 3), max_batch_size=16), config)
    c = read_model(tmp_path, "mlp").config
    assert c is not None
    assert _io(c.input) == [("INPUT0", "TYPE_FP32", [8])]
    assert _io(c.output) == [("OUTPUT0", "TYPE_FP32", [3])]
    assert c.HasField("dynamic_batching")


def test_a_sequence_model_gets_no_dynamic_batcher(tmp_path: Path) -> None:
    _repo(
        tmp_path,
        "seq",
        identity_model("INT32", (4,), max_batch_size=8),
        'platform: "onnxruntime_onnx"\nmax_batch_size: 2\nsequence_batching { }\n',
    )
    c = read_model(tmp_path, "seq").config
    assert c is not None
    assert c.max_batch_size == 2 and not c.HasField("dynamic_batching")
    assert _io(c.input) == [("INPUT0", "TYPE_INT32", [4])]


def test_a_per_request_scalar_gets_dims_one_and_an_empty_reshape(tmp_path: Path) -> None:
    _repo(tmp_path, "scalar", identity_model("FP64", (), max_batch_size=8))
    m = read_model(tmp_path, "scalar")
    assert m.ok, m.error
    assert m.config is not None and m.spec is not None
    (t,) = m.config.input
    assert list(t.dims) == [1] and t.HasField("reshape") and list(t.reshape.shape) == []
    assert m.spec.inputs[0].reshape == ()


def test_variable_inner_dims_stay_variable(tmp_path: Path) -> None:
    _repo(tmp_path, "var", identity_model("FP32", (-1, 3), max_batch_size=8))
    c = read_model(tmp_path, "var").config
    assert c is not None
    assert _io(c.input) == [("INPUT0", "TYPE_FP32", [-1, 3])]


def test_disabled_auto_complete_asks_for_a_full_config(tmp_path: Path) -> None:
    off = AutoComplete(enabled=False)
    _repo(tmp_path, "bare", mlp_model((8, 4, 3), max_batch_size=16))
    m = read_model(tmp_path, "bare", off)
    assert not m.ok and m.error is not None and "no config.pbtxt" in m.error
    _repo(tmp_path, "partial", mlp_model((8, 4, 3)), 'platform: "onnxruntime_onnx"\n')
    m = read_model(tmp_path, "partial", off)
    assert not m.ok and m.error is not None and "declares no inputs" in m.error


def test_no_config_and_no_model_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty" / "1").mkdir(parents=True)
    m = read_model(tmp_path, "empty")
    assert not m.ok and m.error is not None
    assert "no config.pbtxt" in m.error and "no model file" in m.error


def test_a_config_without_io_and_without_a_model_file_says_so(tmp_path: Path) -> None:
    d = tmp_path / "m"
    (d / "1").mkdir(parents=True)
    (d / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    m = read_model(tmp_path, "m")
    assert not m.ok and m.error is not None
    assert "no model file to complete them from" in m.error


def test_the_newest_version_is_read(tmp_path: Path) -> None:
    d = _repo(tmp_path, "m", mlp_model((8, 4, 3), max_batch_size=16))
    (d / "2").mkdir()
    (d / "2" / "model.onnx").write_bytes(
        mlp_model((5, 4, 3), max_batch_size=16).SerializeToString()
    )
    c = read_model(tmp_path, "m").config
    assert c is not None
    assert _io(c.input) == [("INPUT0", "TYPE_FP32", [5])]
