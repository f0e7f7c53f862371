"""model_warmup through the whole stack: samples run on every instance
before READY and count in ModelStatistics as Triton counts them; a warmup
that fails (in the model, or building its data) fails the load with the
reason."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest
import torch

from stageserve_tools.examples import (
    TensorSpec,
    config_text,
    python_config_text,
    simple_model,
    write_model,
    write_python_model,
)
from tests.integration.helpers import infer_simple, stack_retrying
from tests.stack import RunningStack


class TensorIO(TypedDict):
    """The inputs= and outputs= of a config_text call."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


SIMPLE_IO = TensorIO(
    inputs=[("INPUT0", "INT32", (16,)), ("INPUT1", "INT32", (16,))],
    outputs=[("OUTPUT0", "INT32", (16,)), ("OUTPUT1", "INT32", (16,))],
)


def _warmup(name: str, batch: int, count: int, input1: str) -> str:
    return f"""model_warmup [
  {{
    name: "{name}"
    batch_size: {batch}
    count: {count}
    inputs {{ key: "INPUT0" value: {{ data_type: TYPE_INT32 dims: [ 16 ] zero_data: true }} }}
    inputs {{ key: "INPUT1" value: {{ data_type: TYPE_INT32 dims: [ 16 ] {input1} }} }}
  }}
]
"""


def _simple_with_warmup(root: Path, name: str, warmup: str, instances: int = 2) -> Path:
    text = config_text(
        name, **SIMPLE_IO, max_batch_size=8, dynamic_batching=True, instance_count=instances
    )
    return write_model(root, name, simple_model(8), text + warmup)


class _RefusesZeros(torch.nn.Module):
    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803
        if bool((INPUT__0 == 0).all()):
            raise RuntimeError("this model refuses an all-zero input")
        return INPUT__0 + 1


# A Python model: OUT = IN + 1, and an error response for an all-zero input.
PY_SOURCE = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if (x == 0).all():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("no zeros")))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
        return out
"""


def _py_warmup(source: str) -> str:
    return f"""model_warmup [ {{ name: "w" batch_size: 2 count: 2
  inputs {{ key: "IN" value: {{ data_type: TYPE_FP32 dims: [ 4 ] {source} }} }} }} ]
"""


def _python_models(root: Path) -> None:
    io = TensorIO(inputs=[("IN", "FP32", (4,))], outputs=[("OUT", "FP32", (4,))])
    text = python_config_text(
        "warm_py", **io, max_batch_size=8, dynamic_batching=True, instance_count=2
    )
    write_python_model(root, "warm_py", PY_SOURCE, text + _py_warmup("random_data: true"))
    text = python_config_text("warm_py_fails", **io, max_batch_size=8, dynamic_batching=True)
    write_python_model(root, "warm_py_fails", PY_SOURCE, text + _py_warmup("zero_data: true"))
    text = python_config_text("warm_py_decoupled", **io, max_batch_size=0, decoupled=True)
    warmup = _py_warmup("random_data: true").replace("batch_size: 2", "batch_size: 1")
    write_python_model(root, "warm_py_decoupled", PY_SOURCE, text + warmup)


@pytest.fixture(scope="module")
def warm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("warmup_repository")
    ok = _simple_with_warmup(
        root, "warm_ok", _warmup("zeros_and_file", 2, 3, 'input_data_file: "ones.bin"')
    )
    (ok / "warmup").mkdir()
    (ok / "warmup" / "ones.bin").write_bytes(np.ones((2, 16), np.int32).tobytes())
    _simple_with_warmup(
        root, "warm_random", _warmup("random", 1, 0, "random_data: true"), instances=1
    )
    short = _simple_with_warmup(
        root, "warm_short_file", _warmup("short", 1, 1, 'input_data_file: "short.bin"')
    )
    (short / "warmup").mkdir()
    (short / "warmup" / "short.bin").write_bytes(b"\x01\x02")
    fails = root / "warm_fails"
    (fails / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_RefusesZeros()), str(fails / "1" / "model.pt"))
    (fails / "config.pbtxt").write_text(
        """platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
model_warmup [ { name: "zeros" batch_size: 2
  inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]
"""
    )
    _python_models(root)
    with stack_retrying(root) as s:
        yield s


def _stats(s: RunningStack, model: str):
    (st,) = s.client().get_inference_statistics(model, as_json=False).model_stats
    return st


def _reason(s: RunningStack, model: str) -> str:
    (row,) = [m for m in s.client().get_model_repository_index().models if m.name == model]
    assert row.state == "UNAVAILABLE"
    return row.reason


def test_warmup_runs_on_every_instance_and_counts_as_triton(warm_stack: RunningStack) -> None:
    c = warm_stack.client()
    assert c.is_model_ready("warm_ok")
    st = _stats(warm_stack, "warm_ok")
    # 2 instances x count 3 x batch_size 2 (two requests of batch 1 per execution)
    assert st.inference_count == 12 and st.execution_count == 6
    assert st.inference_stats.success.count == 12
    assert [(b.batch_size, b.compute_infer.count) for b in st.batch_stats] == [(2, 6)]
    assert st.last_inference > 0
    infer_simple(c, batch=1, model="warm_ok")
    after = _stats(warm_stack, "warm_ok")
    assert after.inference_count == 13 and after.execution_count == 7


def test_random_data_warmup_with_count_zero_runs_once(warm_stack: RunningStack) -> None:
    assert warm_stack.client().is_model_ready("warm_random")
    st = _stats(warm_stack, "warm_random")
    assert st.inference_count == 1 and st.execution_count == 1


def test_a_failing_warmup_fails_the_load_with_the_models_reason(warm_stack: RunningStack) -> None:
    assert not warm_stack.client().is_model_ready("warm_fails")
    reason = _reason(warm_stack, "warm_fails")
    assert "warmup 'zeros' failed" in reason
    assert "this model refuses an all-zero input" in reason


def test_a_warmup_file_of_the_wrong_size_fails_the_load(warm_stack: RunningStack) -> None:
    assert not warm_stack.client().is_model_ready("warm_short_file")
    reason = _reason(warm_stack, "warm_short_file")
    assert "warmup 'short' input 'INPUT1'" in reason and "needs 64 bytes, got 2" in reason


def test_python_models_warm_up_on_every_instance(warm_stack: RunningStack) -> None:
    c = warm_stack.client()
    assert c.is_model_ready("warm_py")
    st = _stats(warm_stack, "warm_py")
    # 2 instances x count 2 x batch_size 2
    assert st.inference_count == 8 and st.execution_count == 4


def test_a_python_warmup_answered_with_an_error_fails_the_load(warm_stack: RunningStack) -> None:
    assert not warm_stack.client().is_model_ready("warm_py_fails")
    reason = _reason(warm_stack, "warm_py_fails")
    assert "warmup 'w' failed: no zeros" in reason


def test_a_decoupled_python_model_with_warmup_fails_the_load(warm_stack: RunningStack) -> None:
    assert not warm_stack.client().is_model_ready("warm_py_decoupled")
    assert "model_warmup is not supported for decoupled" in _reason(warm_stack, "warm_py_decoupled")
