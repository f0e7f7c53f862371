"""PyTorch models in the configuration layer: platform / backend / model file,
and Triton's auto-complete rules for them (platform only, never io)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageserve.autocomplete_options import TRITON_DEFAULT
from stageserve.config import parse_config_text, to_spec
from stageserve.repository import read_model

IO = """input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


@pytest.mark.parametrize("head", ['platform: "pytorch_libtorch"', 'backend: "pytorch"'])
def test_platform_or_backend_makes_a_pytorch_spec(head: str) -> None:
    spec = to_spec(parse_config_text(f'name: "m"\n{head}\nmax_batch_size: 8\n{IO}'))
    assert spec.platform == "pytorch_libtorch" and spec.model_filename == "model.pt"


def _model(root: Path, name: str, config: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.pt").write_bytes(b"not read by the gateway")
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)


def test_backend_pytorch_gets_its_platform_and_the_file_is_checked(tmp_path: Path) -> None:
    _model(tmp_path, "m", f'backend: "pytorch"\nmax_batch_size: 8\n{IO}')
    m = read_model(tmp_path, "m", TRITON_DEFAULT)
    assert m.ok, m.error
    assert m.config is not None and m.config.platform == "pytorch_libtorch"
    (tmp_path / "m" / "1" / "model.pt").unlink()
    m = read_model(tmp_path, "m", TRITON_DEFAULT)
    assert not m.ok and "missing model file" in (m.error or "")


def test_no_io_auto_complete_for_pytorch(tmp_path: Path) -> None:
    _model(tmp_path, "bare", None)
    _model(tmp_path, "noio", 'platform: "pytorch_libtorch"\nmax_batch_size: 8\n')
    for name in ("bare", "noio"):
        m = read_model(tmp_path, name, TRITON_DEFAULT)
        assert not m.ok
        assert "PyTorch backend does not auto-complete inputs and outputs" in (m.error or "")
