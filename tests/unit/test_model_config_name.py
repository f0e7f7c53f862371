"""Triton's --model-config-name (stageserve/config.py `config_path`): a model's
configs/<name>.pbtxt is read instead of its config.pbtxt where it has one."""

from __future__ import annotations

from pathlib import Path

from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.generated import model_config_pb2 as mc
from stageserve.repository import read_model
from stageserve_tools.examples import write_identity

CUSTOM = """
name: "m"
max_batch_size: 2
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _config(
    root: Path,
    config_name: str | None = None,
    autocomplete: AutoComplete = TRITON_DEFAULT,
) -> mc.ModelConfig:
    model = read_model(root, "m", autocomplete, config_name=config_name)
    assert model.config is not None, model.error
    return model.config


def _model(root: Path, custom: bool = True) -> Path:
    model_dir = write_identity(root, "m", "FP32", (-1,), max_batch_size=8)
    if custom:
        (model_dir / "configs").mkdir()
        (model_dir / "configs" / "h100.pbtxt").write_text(CUSTOM)
    return model_dir


def test_the_named_config_is_read_where_the_model_has_one(tmp_path: Path) -> None:
    _model(tmp_path)
    assert _config(tmp_path, "h100").max_batch_size == 2
    assert _config(tmp_path).max_batch_size == 8  # without the flag


def test_a_model_without_the_named_config_keeps_config_pbtxt(tmp_path: Path) -> None:
    _model(tmp_path, custom=False)
    assert _config(tmp_path, "h100").max_batch_size == 8


def test_a_named_config_alone_counts_as_written_for_auto_complete(tmp_path: Path) -> None:
    model_dir = _model(tmp_path)
    (model_dir / "config.pbtxt").unlink()
    assert _config(tmp_path, "h100", AutoComplete(True, 4)).max_batch_size == 2
    # Without the flag the model has no config: auto-complete builds one from the file.
    assert _config(tmp_path, None, AutoComplete(True, 4)).max_batch_size == 4
