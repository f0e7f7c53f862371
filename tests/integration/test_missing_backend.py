"""A model whose backend needs what this install lacks fails its load once, clearly.

A repository holding an ONNX model, a TorchScript model and a Python model
whose model.py imports a package that is not installed, served by a stack
whose processes cannot import torch (a `torch` package on their PYTHONPATH
that raises ModuleNotFoundError, as a plain `pip install stageserve` without
the [torch] extra): the two models that cannot load fail once each with a
reason naming the fix, in the repository index (gRPC and HTTP) and in one
worker log line; the worker does not try them again until a load request;
the ONNX model loads and serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from stageserve.autocomplete_options import AutoComplete
from stageserve.settings import settings_from_env
from stageserve_tools.examples import write_python_model, write_simple
from tests.integration.helpers import RPC_TIMEOUT_S, index_states, infer_simple
from tests.integration.no_torch import TORCH_FIX, torchless_path
from tests.stack import running_stack, wait_until

MISSING = "stageserve_test_not_installed"

_MISSING_IMPORT_CONFIG = """\
name: "py_missing"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

_MISSING_IMPORT_SOURCE = f"""\
import {MISSING}


class TritonPythonModel:
    def execute(self, requests):
        return []
"""


def _load_failures(err: str, model: str) -> list[dict]:
    lines = []
    for line in err.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("msg") == "model load failed" and entry.get("model") == model:
            lines.append(entry)
    return lines


def _http_index(http_address: str) -> dict[str, str]:
    req = urllib.request.Request(f"http://{http_address}/v2/repository/index", method="POST")
    with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as resp:
        return {m["name"]: m.get("reason", "") for m in json.loads(resp.read())}


def test_missing_torch_and_python_import_fail_once_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")  # to write the TorchScript model here
    from stageserve_tools.torch_examples import write_torch_two_io

    repo = tmp_path / "repo"
    write_simple(repo)
    write_torch_two_io(repo)
    write_python_model(repo, "py_missing", _MISSING_IMPORT_SOURCE, _MISSING_IMPORT_CONFIG)
    env_path = torchless_path(tmp_path)
    blocked = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
    )
    assert "ModuleNotFoundError: No module named 'torch'" in blocked.stderr
    monkeypatch.setenv("PYTHONPATH", env_path)  # every service the stack starts

    models = ("simple", "torch_two_io", "py_missing")
    # Without auto-complete the gateway never imports model.py: the worker does.
    no_autocomplete = AutoComplete(enabled=False)
    with running_stack(
        repo, control_mode="explicit", load_models=models, autocomplete=no_autocomplete
    ) as running:
        c = running.client()
        assert wait_until(lambda: index_states(c).get("simple", {}).get("1", ("",))[0] == "READY")
        infer_simple(c)  # the ONNX model serves

        torch_state, torch_reason = index_states(c)["torch_two_io"]["1"]
        assert torch_state == "UNAVAILABLE"
        assert "torch" in torch_reason and TORCH_FIX in torch_reason
        py_state, py_reason = index_states(c)["py_missing"]["1"]
        assert py_state == "UNAVAILABLE"
        assert f"No module named '{MISSING}'" in py_reason
        assert f"install the package that provides '{MISSING}'" in py_reason
        assert "Traceback" not in torch_reason + py_reason
        http = _http_index(running.gateway.http_address)
        assert TORCH_FIX in http["torch_two_io"]
        assert MISSING in http["py_missing"]

        # Several reconcile periods: each failure was logged once, never retried.
        time.sleep(3 * settings_from_env().worker.reconcile_s + 1)
        err = capfd.readouterr().err
        assert "reconcile failed" not in err
        torch_failures = _load_failures(err, "torch_two_io")
        assert len(torch_failures) == 1, torch_failures
        assert TORCH_FIX in torch_failures[0]["error"]
        assert "exc" not in torch_failures[0]  # one line, no traceback
        assert len(_load_failures(err, "py_missing")) == 1

        # A load request is a new generation: the worker tries once more.
        with pytest.raises(InferenceServerException, match=r"stageserve\[torch\]"):
            c.load_model("torch_two_io", client_timeout=RPC_TIMEOUT_S)
        time.sleep(2 * settings_from_env().worker.reconcile_s + 1)
        err = capfd.readouterr().err
        assert len(_load_failures(err, "torch_two_io")) == 1
        assert _load_failures(err, "py_missing") == []
        infer_simple(c)


def test_a_model_py_import_missing_at_auto_complete_names_the_package(tmp_path: Path) -> None:
    """With auto-complete the gateway imports model.py first: same reason."""
    write_simple(tmp_path)
    write_python_model(tmp_path, "py_missing", _MISSING_IMPORT_SOURCE, _MISSING_IMPORT_CONFIG)
    with running_stack(tmp_path, control_mode="explicit", load_models=("simple",)) as running:
        c = running.client()
        with pytest.raises(InferenceServerException, match=f"No module named '{MISSING}'") as e:
            c.load_model("py_missing", client_timeout=RPC_TIMEOUT_S)
        assert f"install the package that provides '{MISSING}'" in str(e.value)
        reasons = [reason for _, reason in index_states(c)["py_missing"].values()]
        assert any(f"provides '{MISSING}'" in r for r in reasons), reasons
        infer_simple(c)
