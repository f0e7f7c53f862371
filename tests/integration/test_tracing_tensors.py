"""Trace level TENSORS in triton mode, diffed against real Triton 2.51: both
servers trace the same request (`--trace-config triton,file=...` with
level=TIMESTAMPS and level=TENSORS, rate 1) and their trace files hold the
same entries: the head, the timestamps StageServe writes (Triton's
GRPC_*/INFER_RESPONSE_COMPLETE ones are a frontend's, left out), and the
TENSOR_QUEUE_INPUT / TENSOR_BACKEND_OUTPUT records, data formatted alike, at
the same place. Times are left out; ids are compared by position.

Needs .venv-triton (scripts/install_references.sh triton); skips without it.
About 10 s: Triton, then one stack.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import ReferenceNotInstalled, find_triton, start_grpc_triton, stop_process
from bench.triton_diff import write_repository
from tests.stack import running_stack, wait_until

OURS = {
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
}
# what C++ streams print differs from Python's repr here: %g, signed zero, inf, nan, denormals
DATA = np.array(
    [[0.5, 1.25, 1e-7, 123456789.0, -3.0, 3.14159265, 1e20, -0.0]
     + [float("inf"), float("nan"), 2.5e-3, 100.0, 1 / 3, 7.0, 65504.0, 1e-40]],
    dtype=np.float32,
)  # fmt: skip
CONFIG = ["rate=1", "level=TIMESTAMPS", "level=TENSORS"]


def _infer(url: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    try:
        x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(DATA)
        client.infer("identity", [x], request_id="r0")
    finally:
        client.close()


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _normalised(entries: list[dict[str, Any]]) -> list[tuple]:
    out: list[tuple] = []
    for e in entries:
        if "model_name" in e:
            out.append(("head", e["model_name"], e["model_version"], e.get("request_id")))
        elif "activity" in e:
            out.append(("tensor", e["activity"], json.dumps(e["tensor"], sort_keys=True)))
        elif e["timestamps"][0]["name"] in OURS:
            out.append(("stamp", e["timestamps"][0]["name"]))
    return out


def test_tensor_level_trace_file_matches_triton(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    theirs_path, ours_path = tmp_path / "triton_trace.json", tmp_path / "ours_trace.json"
    repo = write_repository(tmp_path / "triton_repo", triton=True)
    extra = ["--model-control-mode", "explicit", "--load-model", "identity"]
    extra += ["--trace-config", f"triton,file={theirs_path}"]
    for c in CONFIG:
        extra += ["--trace-config", c]
    proc, url = start_grpc_triton(tmp_path, repo, ["identity"], extra)
    try:
        _infer(url)
    finally:
        stop_process(proc)  # Triton writes its file at exit
    theirs = _normalised(_read(theirs_path))

    ours_repo = write_repository(tmp_path / "ours_repo", triton=False)
    gateway = tuple(f"--trace-config={c}" for c in [f"triton,file={ours_path}", *CONFIG])
    with running_stack(
        ours_repo, control_mode="explicit", load_models=("identity",), gateway_extra=gateway
    ) as running:
        _infer(running.url)
        assert wait_until(lambda: any("activity" in e for e in _read(ours_path)), 10)
    ours = _normalised(_read(ours_path))

    assert ours == theirs
    tensors = [json.loads(t[2]) for t in ours if t[0] == "tensor"]
    assert [t["name"] for t in tensors] == ["INPUT0", "OUTPUT0"]  # the diff is not empty
    assert tensors[0]["data"].startswith("0.5,1.25,1e-07,1.23457e+08,-3,")
