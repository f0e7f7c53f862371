"""Triton's --model-config-name (stageserve/config.py `config_path`): a model's
configs/<name>.pbtxt is read instead of its config.pbtxt where it has one."""

from __future__ import annotations

from pathlib import Path

from stageserve.autocomplete_options import AutoComplete
from stageserve.repository import read_model
from stageserve_tools.examples import write_identity

CUSTOM = """
name: "m"
max_batch_size: 2
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _model(root: Path, custom: bool = True) -> Path:
    model_dir = write_identity(root, "m", "FP32", (-1,), max_batch_size=8)
    if custom:
        (model_dir / "configs").mkdir()
        (model_dir / "configs" / "h100.pbtxt").write_text(CUSTOM)
    return model_dir


def test_the_named_config_is_read_where_the_model_has_one(tmp_path: Path) -> None:
    _model(tmp_path)
    assert read_model(tmp_path, "m", config_name="h100").config.max_batch_size == 2
    assert read_model(tmp_path, "m").config.max_batch_size == 8  # without the flag


def test_a_model_without_the_named_config_keeps_config_pbtxt(tmp_path: Path) -> None:
    _model(tmp_path, custom=False)
    model = read_model(tmp_path, "m", config_name="h100")
    assert model.error is None and model.config.max_batch_size == 8


def test_a_named_config_alone_counts_as_written_for_auto_complete(tmp_path: Path) -> None:
    model_dir = _model(tmp_path)
    (model_dir / "config.pbtxt").unlink()
    model = read_model(tmp_path, "m", AutoComplete(True, 4), config_name="h100")
    assert model.error is None, model.error
    assert model.config.max_batch_size == 2
    # Without the flag the model has no config: auto-complete builds one from the file.
    assert read_model(tmp_path, "m", AutoComplete(True, 4)).config.max_batch_size == 4
