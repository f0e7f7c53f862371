"""TorchScript models (platform pytorch_libtorch / backend pytorch) through the
whole stack, driven by tritonclient: answers equal the models' arithmetic
in float64 numpy while requests batch under concurrency; Triton's naming
conventions; parameters and a missing config refused with the reason."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from stageserve_tools.examples import mlp_reference, mlp_weights
from stageserve_tools.torch_examples import write_torch_mlp, write_torch_two_io
from tests.integration.helpers import RPC_TIMEOUT_S, stack_retrying, tensor_input
from tests.stack import RunningStack

CONCURRENCY = 8
REQUESTS_PER_CLIENT = 12


class _Accumulator(torch.nn.Module):
    """Running sum per sequence in implicit state (the sequence batcher feeds
    START and ACC_IN by forward()'s argument names)."""

    def forward(
        self,
        INPUT: torch.Tensor,
        START: torch.Tensor,
        ACC_IN: torch.Tensor,  # noqa: N803
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.where(START != 0, torch.zeros_like(ACC_IN), ACC_IN) + INPUT
        return total, total


ACCUMULATOR_CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  oldest { max_candidate_sequences: 8 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
"""


@pytest.fixture(scope="module")
def torch_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("torch_repository")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        write_torch_mlp(root)
        write_torch_two_io(root)
        nvfuser = write_torch_two_io(root, "torch_nvfuser")
    config = (nvfuser / "config.pbtxt").read_text()
    config += 'parameters: { key: "ENABLE_NVFUSER" value: { string_value: "true" } }\n'
    (nvfuser / "config.pbtxt").write_text(config)
    acc = root / "torch_accumulator"
    (acc / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_Accumulator()), str(acc / "1" / "model.pt"))
    (acc / "config.pbtxt").write_text(ACCUMULATOR_CONFIG)
    bare = root / "torch_bare" / "1"
    bare.mkdir(parents=True)
    (bare / "model.pt").write_bytes((root / "torch_two_io" / "1" / "model.pt").read_bytes())
    with stack_retrying(root) as s:
        yield s


def _reference(repo: Path, model: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(repo / model / "1" / "model.pt")).eval()


def _concurrently(fn, n_clients: int = CONCURRENCY) -> None:
    with ThreadPoolExecutor(n_clients) as pool:
        for f in [pool.submit(fn, i) for i in range(n_clients)]:
            f.result()


def _batch_sizes(c: grpcclient.InferenceServerClient, model: str) -> tuple[int, int, list[int]]:
    (st,) = c.get_inference_statistics(model, as_json=False).model_stats
    return st.inference_count, st.execution_count, [b.batch_size for b in st.batch_stats]


def test_mlp_matches_its_float64_reference_under_concurrency(torch_stack: RunningStack) -> None:
    # Not the test process's own forward(): its softmax runs exp, and this
    # process's transcendental results were seen off by 5e-5 (see the two_io
    # reference below); mlp_reference is the same weights in float64 numpy.
    c0 = torch_stack.client()
    assert c0.is_model_ready("torch_mlp")
    before, _, _ = _batch_sizes(c0, "torch_mlp")
    answers: list[tuple[np.ndarray, np.ndarray]] = []  # (input, answer)

    def client_loop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        c = torch_stack.client()
        for _ in range(REQUESTS_PER_CLIENT):
            x = rng.standard_normal((int(rng.integers(1, 5)), 256), dtype=np.float32)
            r = c.infer(
                "torch_mlp", [tensor_input("INPUT__0", x, "FP32")], client_timeout=RPC_TIMEOUT_S
            )
            answers.append((x, r.as_numpy("OUTPUT__0")))

    _concurrently(client_loop)
    # The references once the load is over (float64 BLAS in 8 client threads
    # would take the cores the stack under test needs), in one pass.
    xs = np.concatenate([x for x, _ in answers])
    want = mlp_reference(xs, mlp_weights())
    got = np.concatenate([g for _, g in answers])
    assert got.shape == want.shape == (len(xs), 10)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    inferences, executions, sizes = _batch_sizes(c0, "torch_mlp")
    assert inferences > before
    assert max(sizes) > 4, f"no batch joined two requests: batch sizes {sizes}"


#: The two_io reference is the model's own arithmetic in float64 (the
#: TorchScript file's weight buffer, read but not run), not the module run
#: in this process: in CI an in-process forward() has given tanh(x) * y up to
#: 5.4e-5 off (errors of both signs, up to
#: 5e-5 relative, like a low-order tanh approximation) while the server's
#: answer agreed with float64 math to 1e-7; the cause in the test process was
#: not found (no CPU fuser: this torch has no LLVM; ATen's tanh, vectorised or
#: scalar, is within 3e-8 here). 1e-4 still fails any wrong input or output
#: mapping, whose errors are of order 1.
TWO_IO_ATOL = 1e-4


def _two_io_reference(repo: Path) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, ...]]:
    weight = _reference(repo, "torch_two_io").weight.numpy().astype(np.float64)

    def forward(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        return x64 @ weight + y64, np.tanh(x64) * y64

    return forward


def test_two_inputs_by_argument_name_two_outputs_by_index(torch_stack: RunningStack) -> None:
    forward = _two_io_reference(torch_stack.repository)
    config = torch_stack.client().get_model_config("torch_two_io").config
    assert config.backend == "pytorch" and config.platform == "pytorch_libtorch"

    def client_loop(seed: int) -> None:
        rng = np.random.default_rng(100 + seed)
        c = torch_stack.client()
        for _ in range(REQUESTS_PER_CLIENT):
            n = int(rng.integers(1, 4))
            x = rng.standard_normal((n, 16), dtype=np.float32)
            y = rng.standard_normal((n, 16), dtype=np.float32)
            # inputs in the other order than forward(x, y): mapped by name
            inputs = [tensor_input("y", y, "FP32"), tensor_input("x", x, "FP32")]
            wanted = [grpcclient.InferRequestedOutput("OUTPUT__1")]
            if seed % 2:
                wanted.append(grpcclient.InferRequestedOutput("OUTPUT__0"))
            r = c.infer("torch_two_io", inputs, outputs=wanted, client_timeout=RPC_TIMEOUT_S)
            out0, out1 = forward(x, y)
            got1 = r.as_numpy("OUTPUT__1")
            assert got1.dtype == np.float32 and got1.shape == (n, 16)
            np.testing.assert_allclose(got1, out1, rtol=0, atol=TWO_IO_ATOL)
            if seed % 2:
                np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), out0, rtol=0, atol=TWO_IO_ATOL)
            else:
                assert r.as_numpy("OUTPUT__0") is None

    _concurrently(client_loop)


def test_sequences_keep_their_state_in_a_torchscript_model(torch_stack: RunningStack) -> None:
    c = torch_stack.client()
    sums = {101: 0, 202: 0}
    for step, value in enumerate([3, 5, 7]):
        for seq, scale in ((101, 1), (202, 10)):
            x = np.array([[value * scale]], dtype=np.int32)
            r = c.infer(
                "torch_accumulator",
                [tensor_input("INPUT", x, "INT32")],
                sequence_id=seq,
                sequence_start=step == 0,
                sequence_end=step == 2,
                client_timeout=RPC_TIMEOUT_S,
            )
            sums[seq] += value * scale
            assert r.as_numpy("OUTPUT").tolist() == [[sums[seq]]]


def _reason(c: grpcclient.InferenceServerClient, model: str) -> str:
    (row,) = [m for m in c.get_model_repository_index().models if m.name == model]
    assert row.state == "UNAVAILABLE"
    return row.reason


def test_unsupported_parameter_fails_the_load_with_the_reason(torch_stack: RunningStack) -> None:
    c = torch_stack.client()
    assert not c.is_model_ready("torch_nvfuser")
    reason = _reason(c, "torch_nvfuser")
    assert "ENABLE_NVFUSER" in reason and "NVFuser" in reason


def test_a_torchscript_file_without_config_is_refused_with_the_reason(
    torch_stack: RunningStack,
) -> None:
    c = torch_stack.client()
    assert not c.is_model_ready("torch_bare")
    assert "PyTorch backend does not auto-complete" in _reason(c, "torch_bare")
