"""Triton's `triton` trace mode: sampled requests land in Triton's JSON trace
file format, written by the gateway from its own times and those the
scheduler returns, with Triton's timestamps in order; the count runs out as
Triton's does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.triton_diff import write_repository
from tests.stack import RunningStack, running_stack, wait_until

ORDER = [
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace_out") / "trace.json"


@pytest.fixture(scope="module")
def file_stack(
    trace_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    repo = write_repository(tmp_path_factory.mktemp("trace_file_repo"), triton=False)
    config = [f"triton,file={trace_path}", "level=TIMESTAMPS", "rate=1", "count=2"]
    extra = tuple(f"--trace-config={c}" for c in config)
    with running_stack(
        repo, control_mode="explicit", load_models=("identity",), gateway_extra=extra
    ) as running:
        yield running


def _read(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def test_trace_file_has_tritons_timestamps(file_stack: RunningStack, trace_path: Path) -> None:
    x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    with file_stack.client() as c:
        for i in range(3):  # count=2: the third is not traced
            c.infer("identity", [x], request_id=f"r{i}")
        settings = c.get_trace_settings(as_json=True)["settings"]
    assert settings["trace_count"]["value"] == ["0"]
    assert wait_until(lambda: len({e["id"] for e in _read(trace_path)}) == 2, 10)
    entries = _read(trace_path)
    heads = [e for e in entries if "model_name" in e]
    assert [(h["model_name"], h["model_version"], h["request_id"]) for h in heads] == [
        ("identity", 1, "r0"),
        ("identity", 1, "r1"),
    ]
    for head in heads:
        stamps = [
            e["timestamps"][0] for e in entries if e["id"] == head["id"] and "timestamps" in e
        ]
        assert [s["name"] for s in stamps] == ORDER
        times = [s["ns"] for s in stamps]
        assert times == sorted(times), stamps
        assert times[-1] - times[0] < 30e9
