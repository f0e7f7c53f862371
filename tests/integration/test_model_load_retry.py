"""Triton's --model-load-retry-count against real Triton 2.51: a model whose
first `initialize` fails loads on the retry, and without retries the load
fails after one try, on both servers."""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.references import wait_ready
from stageserve.launcher import Stack, start_services
from tests.integration.helpers import triton_grpc, write_echo

# Appended to the echo model's class: each initialize leaves a line in the
# file its config's `tries` parameter names (outside the repository); the
# first one fails.
FAIL_FIRST = """
    def initialize(self, args):
        import json

        path = json.loads(args["model_config"])["parameters"]["tries"]["string_value"]
        with open(path, "a") as f:
            f.write("try\\n")
        with open(path) as f:
            if f.read().count("try") < 2:
                raise RuntimeError("the first initialize fails")
"""


def _repository(root: Path, tries: Path) -> Path:
    repo = write_echo(root, max_batch_size=4)
    source = repo / "echo" / "1" / "model.py"
    source.write_text(
        source.read_text().replace(
            "class TritonPythonModel:\n", "class TritonPythonModel:\n" + FAIL_FIRST
        )
    )
    config = repo / "echo" / "config.pbtxt"
    parameter = f'parameters {{ key: "tries" value {{ string_value: "{tries}" }} }}\n'
    config.write_text(config.read_text() + parameter)
    return repo


def _load(url: str, tries: Path) -> tuple[bool, int]:
    """(whether the explicit load succeeded and the model is ready, initializations)."""
    with grpcclient.InferenceServerClient(url) as client:
        try:
            client.load_model("echo")
            loaded = client.is_model_ready("echo")
        except InferenceServerException:
            loaded = False
    return loaded, tries.read_text().count("try") if tries.exists() else 0


@pytest.mark.parametrize("retries", [0, 1])
def test_a_failed_load_is_tried_again_as_often_as_triton_tries_it(
    tmp_path: Path, retries: int
) -> None:
    flag = f"--model-load-retry-count={retries}"
    triton_tries = tmp_path / "triton_tries.log"
    triton_repo = _repository(tmp_path / "triton_repo", triton_tries)
    explicit = ("--model-control-mode=explicit", flag)
    with triton_grpc(triton_repo, tmp_path / "triton", [], *explicit) as url:
        triton = _load(url, triton_tries)
    assert triton == ((True, 2) if retries else (False, 1))
    tries = tmp_path / "tries.log"
    repo = _repository(tmp_path / "repo", tries)
    stack = Stack()
    try:
        services = start_services(
            stack, repo, control_mode="explicit", device="cpu", gateway_extra=[flag]
        )
        wait_ready(services.gateway.address, [], 60)
        ours = _load(services.gateway.address, tries)
    finally:
        stack.stop()
    assert ours == triton
