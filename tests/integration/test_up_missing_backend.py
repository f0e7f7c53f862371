"""`stageserve up` on a TorchScript repository without torch, as a new user meets it.

The CLI runs as its own process on a repository holding `simple` (ONNX) and
`torch_two_io` (pytorch_libtorch), with torch unimportable in every process
it starts (tests/integration/no_torch.py). With Triton's defaults it exits 1
within moments of the failed load, not retrying, and its stderr summary names
the model and the fix. With --exit-on-error false it serves `simple`,
ServerReady follows --strict-readiness as in Triton, the repository index
(gRPC and HTTP) gives the reason with the fix, and the worker logged the
failure once.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from stageserve.settings import settings_from_env
from stageserve_tools.examples import write_simple
from tests.integration.helpers import RPC_TIMEOUT_S, index_states, infer_simple
from tests.integration.no_torch import TORCH_FIX, torchless_path
from tests.integration.up_process import UpProcess

TORCH_MODEL = "torch_two_io"
# Generous for a five-process start on the shared 2-core machine; the point is
# that it ends at all (an endless retry never does).
EXIT_BOUND_S = 180.0


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    pytest.importorskip("torch")  # to write the TorchScript model here
    from stageserve_tools.torch_examples import write_torch_two_io

    root = tmp_path / "repo"
    write_simple(root)
    write_torch_two_io(root)
    return root


@pytest.fixture
def torchless_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": torchless_path(tmp_path)}


def _summary_names_the_fix(up: UpProcess, stream: str) -> None:
    summary = up.events("model not loaded", stream)
    assert [(s["model"], s["version"]) for s in summary] == [(TORCH_MODEL, "1")], summary
    assert TORCH_FIX in summary[0]["reason"], summary[0]
    assert "Traceback" not in summary[0]["reason"]


def _worker_failures(up: UpProcess) -> list[dict]:
    return [e for e in up.logs("model load failed") if e.get("model") == TORCH_MODEL]


def test_default_flags_exit_1_with_the_fix_in_the_summary(
    repo: Path, torchless_env: dict[str, str]
) -> None:
    with UpProcess(repo, env=torchless_env) as up:
        assert up.wait(EXIT_BOUND_S) is None, "stageserve up served with a model failed"
        assert up.proc.returncode == 1
    _summary_names_the_fix(up, "err")
    (failed,) = up.events("startup failed", "err")
    assert "gateway" in failed["error"]
    assert len(_worker_failures(up)) == 1
    assert not any("reconcile failed" in line for line in up.err)


def _http_reasons(http_url: str) -> dict[str, str]:
    req = urllib.request.Request(f"http://{http_url}/v2/repository/index", method="POST")
    with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as resp:
        return {m["name"]: m.get("reason", "") for m in json.loads(resp.read())}


@pytest.mark.parametrize("strict", [True, False])
def test_exit_on_error_false_serves_the_onnx_model(
    repo: Path, torchless_env: dict[str, str], strict: bool
) -> None:
    args = ["--exit-on-error", "false", "--strict-readiness", str(strict).lower()]
    with UpProcess(repo, args, env=torchless_env) as up:
        info = up.wait(EXIT_BOUND_S)
        assert info is not None, "".join(up.err[-30:])
        _summary_names_the_fix(up, "out")
        with grpcclient.InferenceServerClient(up.grpc_url()) as client:
            assert client.is_server_live()
            assert client.is_server_ready() is not strict  # Triton 2.51's answer
            assert client.is_model_ready("simple")
            assert not client.is_model_ready(TORCH_MODEL)
            infer_simple(client)
            state, reason = index_states(client)[TORCH_MODEL]["1"]
            assert state == "UNAVAILABLE"
            assert TORCH_FIX in reason
        assert TORCH_FIX in _http_reasons(up.http_url())[TORCH_MODEL]

        # Several reconcile periods later the worker has still tried once.
        time.sleep(3 * settings_from_env().worker.reconcile_s + 1)
        failures = _worker_failures(up)
        assert len(failures) == 1, failures
        assert TORCH_FIX in failures[0]["error"]
        assert not any("reconcile failed" in line for line in up.err)
        assert up.proc.poll() is None
