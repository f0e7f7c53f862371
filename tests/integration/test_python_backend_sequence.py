"""What a sequence-batched Python model sees in execute(): one InferenceRequest
per batch row with Triton's correlation_id() / flags() / request_id(), and for
the direct strategy a padding request for each empty slot below the highest
used one, as real Triton 2.51 gives it.

EXPECTED was recorded from Triton 2.51 running this same model.py and these
same calls; test_triton_gives_the_same runs them against Triton again when
.venv-triton is installed (about 15 s) and skips cleanly without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from tests.integration.helpers import triton_grpc
from tests.stack import running_stack

# Appends one JSON line per execute(): what each request of the batch carried.
MODEL = """\
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.log = cfg["parameters"]["log"]["string_value"]

    def execute(self, requests):
        rows, out = [], []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            ready = int(pb_utils.get_input_tensor_by_name(r, "READY").as_numpy().reshape(-1)[0])
            row = {"corr": r.correlation_id(), "flags": r.flags(), "ready": ready,
                   "id": r.request_id()}
            if ready:  # a padding row's input is unspecified (Triton: uninitialised)
                row["in"] = int(x.reshape(-1)[0])
            rows.append(row)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        with open(self.log, "a") as f:
            f.write(json.dumps(rows) + "\\n")
        return out
"""

MODELS = {"seq_direct": "direct", "seq_oldest": "oldest"}


def sequence_config(name: str, strategy: str, out_dims: int = 1, extra: str = "") -> str:
    """A sequence-batched Python model: IN and OUT int32, READY control, one
    instance; `extra` lines go at the end."""
    return f"""name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ {out_dims} ] }} ]
sequence_batching {{
  {strategy} {{ }}
  max_sequence_idle_microseconds: 60000000
  control_input [
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{extra}"""


def _config(name: str, strategy: str, log: Path) -> str:
    return sequence_config(
        name, strategy, extra=f'parameters {{ key: "log" value: {{ string_value: "{log}" }} }}\n'
    )


def write_repository(root: Path) -> Path:
    for name, strategy in MODELS.items():
        version = root / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(MODEL)
        (root / name / "config.pbtxt").write_text(_config(name, strategy, root / f"{name}.log"))
    return root


# (model, IN, correlation id, start, end, request id), one call at a time, so
# the batches do not depend on timing.
CALLS = [
    ("seq_direct", 1, 11, True, False, "a1"),  # sequence 11 takes slot 0
    ("seq_direct", 2, 12, True, False, "b1"),  # 12 takes slot 1: slot 0 pads
    ("seq_direct", 3, 12, False, False, "b2"),
    ("seq_direct", 4, 12, False, True, "b3"),
    ("seq_direct", 5, 11, False, True, "a2"),  # slot 1 freed: no padding
    ("seq_direct", 6, 13, True, True, "c1"),  # START and END at once: flags 3
    ("seq_oldest", 7, "alpha", True, False, "s1"),  # string id: correlation_id() a str
    ("seq_oldest", 8, "alpha", False, True, "s2"),
]

PAD = {"corr": 0, "flags": 0, "ready": 0, "id": ""}


def _row(corr, flags: int, value: int, rid: str) -> dict:
    return {"corr": corr, "flags": flags, "ready": 1, "id": rid, "in": value}


# Triton 2.51: START = 1, END = 2 (TRITONSERVER_REQUEST_FLAG_SEQUENCE_*).
EXPECTED = {
    "seq_direct": [
        [_row(11, 1, 1, "a1")],
        [PAD, _row(12, 1, 2, "b1")],
        [PAD, _row(12, 0, 3, "b2")],
        [PAD, _row(12, 2, 4, "b3")],
        [_row(11, 2, 5, "a2")],
        [_row(13, 3, 6, "c1")],
    ],
    "seq_oldest": [[_row("alpha", 1, 7, "s1")], [_row("alpha", 2, 8, "s2")]],
}


def run_calls(url: str, repository: Path) -> dict[str, list[list[dict]]]:
    with grpcclient.InferenceServerClient(url) as client:
        for model, value, sid, start, end, rid in CALLS:
            inp = grpcclient.InferInput("IN", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[value]], np.int32))
            result = client.infer(
                model, [inp], sequence_id=sid, sequence_start=start, sequence_end=end,
                request_id=rid,
            )  # fmt: skip
            assert int(result.as_numpy("OUT")[0][0]) == value
    return {
        name: [json.loads(line) for line in (repository / f"{name}.log").read_text().splitlines()]
        for name in MODELS
    }


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[Path]:
    yield write_repository(tmp_path / "repo")


def test_stageserve_gives_tritons_request_metadata_and_padding(repository: Path) -> None:
    with running_stack(repository) as stack:
        wait_ready(stack.url, list(MODELS), 120)
        assert run_calls(stack.url, repository) == EXPECTED


def test_triton_gives_the_same(repository: Path, tmp_path: Path) -> None:
    with triton_grpc(repository, tmp_path, list(MODELS)) as url:
        assert run_calls(url, repository) == EXPECTED
