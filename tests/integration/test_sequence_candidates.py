"""How many sequences run at once, as real Triton 2.51 has it.

Oldest strategy: a sequence is a candidate from its START to its END (or
idle timeout); a START beyond max_candidate_sequences per instance (unset:
max_batch_size) waits until a candidate ends, while the candidates' own
requests go on. Direct strategy: every instance has max_batch_size slots,
and a START beyond them waits the same way. Triton 2.51 was asked with this
same model and calls: it holds the waiting START exactly so
(test_triton_holds_the_start_the_same runs it again when .venv-triton is
installed, and skips without it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from tests.integration.helpers import triton_grpc
from tests.integration.test_python_backend_sequence import MODEL
from tests.stack import running_stack

# model -> (max_batch_size, strategy, instance count, sequences open at once):
# one candidate set on purpose, one left to the default (max_batch_size,
# here 2), and direct slots on two instances (max_batch_size 1 each).
MODELS = {
    "cand_one": (4, "oldest { max_candidate_sequences: 1 }", 1, 1),
    "cand_default": (2, "oldest { }", 1, 2),
    "direct_two": (1, "direct { }", 2, 2),
}
WAIT_S = 1.0


def _config(name: str, max_batch: int, strategy: str, count: int, log: Path) -> str:
    return f"""name: "{name}"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: 60000000
  control_input [
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
parameters {{ key: "log" value: {{ string_value: "{log}" }} }}
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name, (max_batch, strategy, count, _) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL)
        (root / name / "config.pbtxt").write_text(
            _config(name, max_batch, strategy, count, root / f"{name}.log")
        )
    return root


def _send(client, model: str, cid: int, start: bool = False, end: bool = False) -> None:
    inp = grpcclient.InferInput("IN", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[cid]], np.int32))
    out = client.infer(model, [inp], sequence_id=cid, sequence_start=start, sequence_end=end)
    assert int(out.as_numpy("OUT")[0][0]) == cid


def _held_start(url: str, model: str) -> dict[str, bool]:
    """Open as many sequences as may be (1..), START one more from a
    thread, run an open one's request, END sequence 1: what happened to the
    extra START at each step."""
    full = MODELS[model][3]
    extra = full + 1
    seen: dict[str, bool] = {}
    done = threading.Event()
    with grpcclient.InferenceServerClient(url) as client:
        for cid in range(1, full + 1):
            _send(client, model, cid, start=True)

        def start_extra() -> None:
            with grpcclient.InferenceServerClient(url) as own:
                _send(own, model, extra, start=True)
            done.set()

        thread = threading.Thread(target=start_extra)
        thread.start()
        seen["ran while the candidates were full"] = done.wait(WAIT_S)
        _send(client, model, 1)
        seen["ran with a candidate's next request"] = done.is_set()
        _send(client, model, 1, end=True)
        seen["ran once a candidate ended"] = done.wait(30)
        thread.join(30)
        for cid in range(2, extra + 1):
            _send(client, model, cid, end=True)
    return seen


EXPECTED = {
    "ran while the candidates were full": False,
    "ran with a candidate's next request": False,
    "ran once a candidate ended": True,
}


@pytest.mark.parametrize("model", list(MODELS))
def test_stageserve_holds_a_start_beyond_the_candidates(repository: Path, model: str) -> None:
    with running_stack(repository) as stack:
        wait_ready(stack.url, list(MODELS), 120)
        assert _held_start(stack.url, model) == EXPECTED


@pytest.mark.parametrize("model", list(MODELS))
def test_triton_holds_the_start_the_same(repository: Path, tmp_path: Path, model: str) -> None:
    began = time.monotonic()
    with triton_grpc(repository, tmp_path, list(MODELS)) as url:
        assert _held_start(url, model) == EXPECTED
    assert time.monotonic() - began < 60  # no idle timeout (60 s) was waited for
