"""A worker that cannot map the gateway's tensor region (issue 26 item 3).

A worker on another host or container that the gateway still takes for a
local one (it joined less than a refresh ago) gets references it cannot map.
Made certain here: the gateway's region file is unlinked before any request,
so the worker, which maps a peer's region on its first reference, finds no
file, as on another host. It refuses the batch TENSOR_REGION_NOT_LOCAL and
the gateway resends the request with its bytes inline: the client gets the
right answer, on both fronts, never a "bad input".
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bench.chaos_audit import tensor_slots_in_use
from stageserve.tensor_region import SHM_DIR
from stageserve.tensor_shm import stack_id
from stageserve_tools.examples import write_identity
from tests.integration.helpers import RPC_TIMEOUT_S
from tests.stack import RunningStack, running_stack, wait_until

DIMS = (3, 64, 64)  # 49 KB of FP32: above tensor_shm_min_bytes


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("shm_not_local_repo")
    write_identity(root, "identity_49k", "FP32", DIMS, max_batch_size=8)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGESERVE_STACK_TENSOR_SHM", "1")  # every stage, restarts too
        with running_stack(root) as s:
            yield s


def test_requests_are_resent_inline_when_the_worker_cannot_map_the_region(
    stack: RunningStack,
) -> None:
    regions = list(SHM_DIR.glob(f"stageserve-{stack_id(stack.redis_url)}-gateway-*"))
    assert len(regions) == 1
    regions[0].unlink()  # the gateway keeps its mapping; a newcomer cannot open it
    client = stack.client()
    # Over 3 s: the gateway's view of local models refreshes every second and
    # puts the model back on shared memory after each refusal took it off.
    deadline = time.monotonic() + 3
    i = 0
    while time.monotonic() < deadline:
        x = np.random.default_rng(i).standard_normal((1, *DIMS), dtype=np.float32)
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer("identity_49k", [inp], client_timeout=RPC_TIMEOUT_S)
        assert out.as_numpy("OUTPUT0").tobytes() == x.tobytes()
        with httpclient.InferenceServerClient(stack.gateway.http_address) as http:
            hin = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            hin.set_data_from_numpy(x, binary_data=True)
            got = http.infer("identity_49k", [hin]).as_numpy("OUTPUT0")
            assert got.tobytes() == x.tobytes()
        i += 1
        time.sleep(0.3)
    # the worker's region: no output left behind (the gateway's is unlisted now)
    assert wait_until(lambda: tensor_slots_in_use(stack.redis_url) == 0, 5)
