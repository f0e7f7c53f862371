"""Triton's trace file at level TENSORS, diffed against real Triton 2.51:
both servers trace the same requests (`--trace-config triton,file=...` with
level=TIMESTAMPS and level=TENSORS, rate 1), one to `identity` and one to
the ensemble `ens` over it, and their trace files hold the same traces: the
heads (an ensemble's composing request a trace of its own, its parent_id
the ensemble's), the timestamps StageServe writes (Triton's
GRPC_*/INFER_RESPONSE_COMPLETE ones are a frontend's, left out), and the
TENSOR_QUEUE_INPUT / TENSOR_BACKEND_OUTPUT records, data formatted alike, at
the same place. Times are left out; ids stand for the trace they name.
Kept apart on purpose: a composing request's tensors (Triton records them;
the gateway, which writes the file, never holds them).

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
        e = grpcclient.InferInput("IN", [1, 16], "FP32")
        e.set_data_from_numpy(DATA)
        client.infer("ens", [e], request_id="e0")
    finally:
        client.close()


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _traces(entries: list[dict[str, Any]]) -> list[tuple]:
    """Each trace's entries in order, sorted; a parent_id by its trace's model."""
    heads = {e["id"]: e for e in entries if "model_name" in e}
    traces: dict[int, list[tuple]] = {}
    for e in entries:
        got = traces.setdefault(e["id"], [])
        if "model_name" in e:
            parent = heads[e["parent_id"]]["model_name"] if "parent_id" in e else None
            got.append(("head", e["model_name"], e["model_version"], e.get("request_id"), parent))
        elif "activity" in e:
            got.append(("tensor", e["activity"], json.dumps(e["tensor"], sort_keys=True)))
        elif e["timestamps"][0]["name"] in OURS:
            got.append(("stamp", e["timestamps"][0]["name"]))
    return sorted(tuple(t) for t in traces.values())


def _composing(trace: tuple) -> bool:
    return trace[0][4] is not None


def test_tensor_level_trace_file_matches_triton(tmp_path: Path) -> None:
    try:
        find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    theirs_path, ours_path = tmp_path / "triton_trace.json", tmp_path / "ours_trace.json"
    repo = write_repository(tmp_path / "triton_repo", triton=True)
    extra = ["--model-control-mode", "explicit", "--load-model", "identity", "--load-model", "ens"]
    extra += ["--trace-config", f"triton,file={theirs_path}"]
    for c in CONFIG:
        extra += ["--trace-config", c]
    proc, url = start_grpc_triton(tmp_path, repo, ["identity", "ens"], extra)
    try:
        _infer(url)
    finally:
        stop_process(proc)  # Triton writes its file at exit
    theirs = _traces(_read(theirs_path))

    ours_repo = write_repository(tmp_path / "ours_repo", triton=False)
    gateway = tuple(f"--trace-config={c}" for c in [f"triton,file={ours_path}", *CONFIG])
    with running_stack(
        ours_repo,
        control_mode="explicit",
        load_models=("identity", "ens"),
        gateway_extra=gateway,
    ) as running:
        _infer(running.url)
        assert wait_until(lambda: len(_traces(_read(ours_path))) == 3, 10)
    ours = _traces(_read(ours_path))

    # a composing request's tensors: Triton's only (see above)
    for trace in theirs:
        if _composing(trace):
            assert [e[2] for e in trace if e[0] == "tensor"]
    theirs = [tuple(e for e in t if not (_composing(t) and e[0] == "tensor")) for t in theirs]
    assert ours == theirs
    assert [t[0][1:] for t in ours] == [
        ("ens", 1, "e0", None),
        ("identity", 1, "e0", "ens"),
        ("identity", 1, "r0", None),
    ]
    (plain,) = [t for t in ours if t[0][3] == "r0"]
    tensors = [json.loads(e[2]) for e in plain if e[0] == "tensor"]
    assert [t["name"] for t in tensors] == ["INPUT0", "OUTPUT0"]  # the diff is not empty
    assert tensors[0]["data"].startswith("0.5,1.25,1e-07,1.23457e+08,-3,")
