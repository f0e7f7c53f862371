"""A Python model's auto_complete_config runs in a child process
(stageserve/python_autocomplete.py), never in whoever reads the
repository: a model.py that prints, exits or hangs at import fails its own
load and nothing else. Real child processes, real model.py files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stageserve import python_autocomplete as autocomplete
from stageserve.repository import read_model

CONFIG = 'name: "{name}"\nbackend: "python"\n'


@pytest.fixture(autouse=True)
def own_helper(monkeypatch: pytest.MonkeyPatch):
    """Each test starts its own child and stops it after: no child left by
    another test file (the helper is module-global) can answer for it."""
    helper = autocomplete._Helper()
    monkeypatch.setattr(autocomplete, "_helper", helper)
    yield helper
    proc = helper._proc
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


AUTO = """\
import os, sys
import triton_python_backend_utils as pb_utils

print("noise on stdout at import")  # must not spoil the answer
with open(os.path.join(os.path.dirname(__file__), "pid"), "w") as f:
    f.write(str(os.getpid()))
{extra}

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}})
        config.add_output({{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}})
        config.set_max_batch_size(8)
        return config

    def execute(self, requests):
        return []
"""


def _model(root: Path, name: str, extra: str = "") -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (root / name / "1" / "model.py").write_text(AUTO.format(extra=extra))
    return root / name


def test_completed_in_another_process_whatever_the_model_prints(tmp_path: Path) -> None:
    folder = _model(tmp_path, "auto")
    m = read_model(tmp_path, "auto")
    assert m.ok, m.error
    assert m.config is not None
    assert m.config.max_batch_size == 8 and [t.name for t in m.config.input] == ["IN"]
    assert int((folder / "1" / "pid").read_text()) != os.getpid()


def test_a_model_that_exits_at_import_fails_only_its_own_load(tmp_path: Path) -> None:
    _model(tmp_path, "quits", extra="os._exit(3)")
    _model(tmp_path, "fine")
    m = read_model(tmp_path, "quits")
    assert not m.ok
    assert m.error is not None and "'quits'" in m.error and "status 3" in m.error
    assert read_model(tmp_path, "fine").ok  # a new child answers the next model


def test_a_child_that_closes_its_answers_then_exits_reports_its_status(tmp_path: Path) -> None:
    """Its answer pipe ends before the process can be reaped: a dying process's
    files close before it exits, a window (hit in CI) where a child that had
    exited at import could be reported as "did not finish within 120 s". Here
    the window is made 0.3 s wide on purpose."""
    linger = "os.closerange(3, 4096); import time; time.sleep(0.3); os._exit(3)"
    _model(tmp_path, "lingers", extra=linger)
    m = read_model(tmp_path, "lingers")
    assert m.error is not None and "status 3" in m.error, m.error


def test_a_model_that_hangs_at_import_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autocomplete, "CHILD_TIMEOUT_S", 1.0)
    _model(tmp_path, "hangs", extra="import time; time.sleep(60)")
    m = read_model(tmp_path, "hangs")
    assert m.error is not None and "did not finish within 1 s" in m.error
    _model(tmp_path, "after")
    assert read_model(tmp_path, "after").ok  # the stuck child was replaced


def test_a_raising_hook_is_a_load_error_with_its_message(tmp_path: Path) -> None:
    folder = _model(tmp_path, "raises")
    (folder / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        raise RuntimeError('no way')\n"
    )
    m = read_model(tmp_path, "raises")
    assert m.error is not None
    assert "auto_complete_config of model 'raises' raised RuntimeError: no way" in m.error
