"""Every stage settles its heap when it is ready, and a worker again once it
loaded its models (stageserve/heap_freeze.py): the log lines that say so,
from the stage processes of a real stack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from stageserve_tools.examples import write_simple
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import running_stack, wait_until


def _settled(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("msg") == "heap settled":
                out.append(entry)
    return out


def test_each_stage_settles_when_ready_and_the_worker_after_its_loads(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    write_simple(repo)
    err: list[str] = []

    def settled() -> list[dict]:
        err.extend(capfd.readouterr().err.splitlines())
        return _settled(err)

    with running_stack(repo) as s:
        with grpcclient.InferenceServerClient(s.gateway.address) as client:
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                inp = grpcclient.InferInput(name, [1, 16], "INT32")
                inp.set_data_from_numpy(np.ones((1, 16), np.int32))
                inputs.append(inp)
            out = client.infer("simple", inputs, client_timeout=RPC_TIMEOUT_S)
            assert out.as_numpy("OUTPUT0").tolist() == [[2] * 16]

        def worker_settled_after_loading() -> bool:
            return any(e["service"] == "worker" and e["why"] != "ready" for e in settled())

        assert wait_until(worker_settled_after_loading, timeout_s=10)
    entries = settled()
    ready = {e["service"] for e in entries if e["why"] == "ready"}
    assert ready == {"gateway", "scheduler", "ratelimiter", "worker"}, entries
    loaded = [e for e in entries if e["service"] == "worker" and e["why"] == "model set changed"]
    assert loaded and all(e["frozen"] > 10_000 for e in entries), entries
