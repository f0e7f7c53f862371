"""A stack with shared-memory tensors turned off (STAGESERVE_STACK_TENSOR_SHM=0).

Shared memory is on by default; this keeps the inline path covered: no
process makes a region, and the 49 KB identity answers
byte-exact on both fronts and through the dynamic batcher with every byte
on the streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from stageserve.tensor_region import SHM_DIR
from stageserve.tensor_shm import stack_id
from stageserve_tools.examples import write_identity
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import RunningStack, running_stack

DIMS = (3, 64, 64)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("shm_off_repo")
    write_identity(root, "identity_49k", "FP32", DIMS, max_batch_size=32)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGESERVE_STACK_TENSOR_SHM", "0")  # every stage, restarts too
        with running_stack(root) as s:
            yield s


def data(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *DIMS), dtype=np.float32)


def grpc_infer(stack: RunningStack, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = stack.client().infer("identity_49k", [inp], client_timeout=RPC_TIMEOUT_S)
    return result.as_numpy("OUTPUT0")


def test_no_process_makes_a_region(stack: RunningStack) -> None:
    assert not list(SHM_DIR.glob(f"stageserve-{stack_id(stack.redis_url)}-*"))


def test_49k_identity_is_byte_exact_inline_on_grpc_and_http(stack: RunningStack) -> None:
    x = data(1)
    assert grpc_infer(stack, x).tobytes() == x.tobytes()
    with httpclient.InferenceServerClient(stack.gateway.http_address) as client:
        for binary in (True, False):
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("identity_49k", [inp])
            assert result.as_numpy("OUTPUT0").tobytes() == x.tobytes()


def test_dynamic_batch_of_many_requests_is_right_inline(stack: RunningStack) -> None:
    xs = [data(100 + i, batch=1 + i % 3) for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda x: grpc_infer(stack, x), xs))
    for x, out in zip(xs, outs, strict=True):
        assert out.tobytes() == x.tobytes()
