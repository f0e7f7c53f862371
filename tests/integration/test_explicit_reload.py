"""An explicit load of a model that is loaded and unchanged, against real
Triton 2.51: a no-op on both servers (`initialize` does not run again, the
statistics go on, the model keeps answering).

Triton takes a model folder's timestamps before its Python backend first
imports model.py, so the `__pycache__` that import writes into the folder
makes the first explicit load after a model's load a real reload (its
statistics start over); the loads after it are no-ops. StageServe takes
them after its auto-complete imported model.py, so its first explicit load
is a no-op already (README, "Known differences")."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from stageserve.launcher import Stack, start_services
from tests.integration.helpers import RPC_TIMEOUT_S, triton_grpc, write_echo

# Appended to the echo model's class: each initialize leaves a line in the
# file its config's `inits` parameter names, outside the repository (a file
# written in the model's folder would change the model, and so reload it).
COUNT_INITS = """
    def initialize(self, args):
        import json

        config = json.loads(args["model_config"])
        with open(config["parameters"]["inits"]["string_value"], "a") as f:
            f.write("init\\n")
"""


def _repository(root: Path, inits: Path) -> Path:
    repo = write_echo(root, max_batch_size=4)
    source = repo / "echo" / "1" / "model.py"
    text = source.read_text().replace(
        "class TritonPythonModel:\n", "class TritonPythonModel:\n" + COUNT_INITS
    )
    source.write_text(text)
    config = repo / "echo" / "config.pbtxt"
    parameter = f'parameters {{ key: "inits" value {{ string_value: "{inits}" }} }}\n'
    config.write_text(config.read_text() + parameter)
    return repo


def _inits(log: Path) -> int:
    return log.read_text().count("init") if log.exists() else 0


def _load_twice(url: str, inits: Path) -> list[tuple[int, int]]:
    """(successful inferences the statistics show, initializations so far):
    after two inferences, after an explicit load of the unchanged model, after
    two more, after a second explicit load, and after one more inference."""
    seen = []
    with grpcclient.InferenceServerClient(url) as client:
        inp = grpcclient.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[7]], np.int32))

        def infer(times: int) -> None:
            for _ in range(times):
                out = client.infer("echo", [inp], client_timeout=RPC_TIMEOUT_S)
                assert out.as_numpy("OUT")[0][0] == 7

        def successes() -> int:
            stats = client.get_inference_statistics("echo").model_stats[0]
            return int(stats.inference_stats.success.count)

        def look() -> None:
            # Triton counts a success after its answer went out: read until
            # two reads 0.1 s apart agree (a loaded machine lags)
            count, deadline = successes(), time.monotonic() + 3
            while time.monotonic() < deadline:
                time.sleep(0.1)
                again = successes()
                if again == count:
                    break
                count = again
            seen.append((count, _inits(inits)))

        for _ in range(2):
            infer(2)
            look()
            client.load_model("echo")
            look()
        infer(1)
        look()
    return seen


def test_an_explicit_load_of_an_unchanged_model_is_a_no_op_as_in_triton(tmp_path: Path) -> None:
    explicit = ("--model-control-mode=explicit", "--load-model=echo")
    triton_inits = tmp_path / "triton_inits.log"
    triton_repo = _repository(tmp_path / "triton_repo", triton_inits)
    with triton_grpc(triton_repo, tmp_path / "triton", ["echo"], *explicit) as url:
        triton = _load_twice(url, triton_inits)
    # Triton: the first load reloads where its Python backend wrote a
    # __pycache__ into the model's folder (it changed the folder), the second
    # is a no-op
    if (triton_repo / "echo" / "1" / "__pycache__").is_dir():
        assert triton == [(2, 1), (0, 2), (2, 2), (2, 2), (3, 2)]
    else:  # no bytecode written (PYTHONDONTWRITEBYTECODE, say): no reload at all
        assert triton == [(2, 1), (2, 1), (4, 1), (4, 1), (5, 1)]
    inits = tmp_path / "inits.log"
    repo = _repository(tmp_path / "repo", inits)
    stack = Stack()
    try:
        services = start_services(
            stack, repo, control_mode="explicit", load_models=["echo"], device="cpu"
        )
        wait_ready(services.gateway.address, ["echo"], 60)
        ours = _load_twice(services.gateway.address, inits)
    finally:
        stack.stop()
    assert ours == [(2, 1), (2, 1), (4, 1), (4, 1), (5, 1)]  # both loads no-ops
    # the settled load (Triton's second): no initialize, statistics go on
    assert (ours[3][0] - ours[2][0], ours[3][1] - ours[2][1]) == (0, 0)
    assert (triton[3][0] - triton[2][0], triton[3][1] - triton[2][1]) == (0, 0)
