"""`nv_inference_pending_request_count` on the metrics port, as Triton 2.51
serves it: one series per ready model version, the requests queued and not
yet executing, 0 when none; an ensemble's own count 0, its steps counted in
the model they queue for.

The same repository and the same requests go to real Triton and to
`stageserve up --gateways 2`: a slow Python model (one instance, one
request at a time) holds its first request while the others queue. Both
servers must reach the same counts. In StageServe the queues live in the
schedulers; each gateway's own port and the stack's merged port report the
whole backlog (not a share, not a sum over gateways).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from stageserve.metrics_merge import parse
from stageserve.net import free_port
from stageserve_tools.examples import write_python_model
from tests.integration.helpers import RPC_TIMEOUT_S, triton_grpc
from tests.integration.up_process import UpProcess, scrape_metrics, up_with_gateways
from tests.stack import wait_until

PENDING = "nv_inference_pending_request_count"
EXECUTE_S = 1.5

SLOW_SOURCE = f"""\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({EXECUTE_S})
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
"""

ENSEMBLE = """\
name: "ens"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "slow"
      model_version: -1
      input_map { key: "IN" value: "IN" }
      output_map { key: "OUT" value: "OUT" }
    }
  ]
}
"""

#: model -> requests sent: `slow` gets 2 of its own and 2 through `ens`;
#: `slow_dyn` runs one request per batch (max_batch_size 1), so its count
#: does not depend on how many arrived before its first batch formed.
SENT = {"slow": 2, "slow_dyn": 3, "ens": 2}
#: what both servers show while each model's first request executes
LOADED = {"slow": 3, "slow_dyn": 2, "ens": 0, "idle": 0}
IDLE = dict.fromkeys(LOADED, 0)
MODELS = sorted(LOADED)


def _config(name: str, max_batch_size: int, extra: str = "") -> str:
    return f"""\
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pending_repository")
    write_python_model(root, "slow", SLOW_SOURCE, _config("slow", 0))
    dynamic = _config("slow_dyn", 1, "dynamic_batching { }")
    write_python_model(root, "slow_dyn", SLOW_SOURCE, dynamic)
    write_python_model(root, "idle", SLOW_SOURCE, _config("idle", 0))
    (root / "ens" / "1").mkdir(parents=True)
    (root / "ens" / "config.pbtxt").write_text(ENSEMBLE)
    return root


def _pending(port: int) -> dict[str, float]:
    """model -> its version 1 count on the metrics port `port`."""
    samples = parse(scrape_metrics(port)).get(PENDING, {})
    out = {}
    for labels, value in samples.items():
        named = dict(labels)
        assert named["version"] == "1", labels
        out[named["model"]] = value
    return out


def _send_load(url: str) -> tuple[grpcclient.InferenceServerClient, list]:
    """SENT's requests, all at once; the answers' errors (None) as they come."""
    c = grpcclient.InferenceServerClient(url)
    answers: list = []

    def send(model: str, shape: list[int]) -> None:
        x = grpcclient.InferInput("IN", shape, "FP32")
        x.set_data_from_numpy(np.zeros(shape, np.float32))
        c.async_infer(
            model,
            [x],
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error: answers.append(error),
        )

    for model, n in SENT.items():
        for _ in range(n):
            send(model, [1, 1] if model == "slow_dyn" else [1])
    return c, answers


def _check_counts(url: str, ports: list[int], all_answered: bool = True) -> None:
    """The counts on every port of `ports`: IDLE, LOADED while SENT's
    requests queue, IDLE once they are answered (`all_answered`: and none
    failed)."""
    for port in ports:
        assert _pending(port) == IDLE, port
    c, answers = _send_load(url)
    try:
        for port in ports:
            assert wait_until(lambda port=port: _pending(port) == LOADED, 3 * EXECUTE_S, 0.05), (
                port,
                _pending(port),
            )
        total = sum(SENT.values())
        assert wait_until(lambda: len(answers) == total, RPC_TIMEOUT_S)
        if all_answered:
            assert [str(e) for e in answers if e is not None] == []
        for port in ports:
            assert _pending(port) == IDLE, port
    finally:
        c.close()


def test_triton_counts_each_models_queued_requests(repository: Path, tmp_path: Path) -> None:
    metrics_port = free_port()
    extra = ("--allow-metrics", "true", "--metrics-port", str(metrics_port))
    with triton_grpc(repository, tmp_path, MODELS, *extra) as url:
        # What this takes from Triton is its counts: one of its answers failed
        # once on a loaded machine (in a full suite run, with no line in its
        # log), and that is not what is compared here.
        _check_counts(url, [metrics_port], all_answered=False)


@pytest.fixture(scope="module")
def up(repository: Path) -> Iterator[tuple[UpProcess, int]]:
    with up_with_gateways(repository) as running:
        yield running


def test_every_metrics_port_counts_the_stacks_queued_requests_as_triton(
    up: tuple[UpProcess, int],
) -> None:
    running, port = up
    _check_counts(running.grpc_url(), [port, *running.gateway_metrics_ports()])
