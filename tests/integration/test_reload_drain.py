"""A reload that removes a version lets the requests already admitted for it
finish on it, as Triton does: requests queued at the scheduler behind an
executing one are answered by version 1 after an explicit RepositoryModelLoad
made version 2 the served one, and new requests get version 2 at once."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stageserve_tools.examples import config_text, write_model
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    granted_instances,
    registered_instances,
    stack_retrying,
    tensor_input,
)
from tests.integration.test_repository import add_const_model
from tests.stack import RunningStack, wait_until

DELAY_MS = 1000  # each request executes this long on the one instance
QUEUED = 3  # requests waiting at the scheduler behind the executing one


def _write(root: Path, version: int) -> None:
    """Version v answers INPUT0 + 100 * v, one instance, no batching: requests
    run one after the other."""
    text = config_text(
        "drained", [("INPUT0", "INT32", [4])], [("OUTPUT0", "INT32", [4])], max_batch_size=8
    )
    text += "version_policy { latest { num_versions: 1 } }\n"
    text += f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{DELAY_MS}" }} }}\n'
    write_model(root, "drained", add_const_model(100 * version), text, versions=(version,))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("drain_repository")
    _write(root, 1)
    with stack_retrying(root, control_mode="explicit", load_models=("drained",)) as running:
        yield running


def _x(k: int) -> np.ndarray:
    return np.full((1, 4), k, np.int32)


def test_reload_removing_a_version_lets_its_queued_requests_finish_on_it(
    stack: RunningStack, tmp_path: Path
) -> None:
    c = stack.client()
    answers: queue.Queue = queue.Queue()
    n = 1 + QUEUED
    for k in range(n):
        c.async_infer(
            "drained",
            [tensor_input("INPUT0", _x(k), "INT32")],
            client_timeout=RPC_TIMEOUT_S,
            callback=lambda result, error, k=k: answers.put((k, result, error, time.monotonic())),
        )
    # one executes (DELAY_MS from its grant), the others wait in the scheduler's queue
    assert wait_until(
        lambda: sum("/drained/1/" in i for i in granted_instances(stack.redis_url)) == 1,
        RPC_TIMEOUT_S,
    )
    # version 2 appears; the policy (latest 1) drops version 1
    _write(tmp_path, 2)
    (tmp_path / "drained" / "2").rename(stack.repository / "drained" / "2")
    c.load_model("drained", client_timeout=RPC_TIMEOUT_S)
    reloaded = time.monotonic()
    after = c.infer("drained", [tensor_input("INPUT0", _x(7), "INT32")])
    assert after.get_response().model_version == "2"
    np.testing.assert_array_equal(after.as_numpy("OUTPUT0"), _x(7) + 200)
    assert not c.is_model_ready("drained", "1")
    done = [answers.get(timeout=RPC_TIMEOUT_S) for _ in range(n)]
    errors = [(k, e.status(), e.message()) for k, _, e, _ in done if e is not None]
    assert not errors, errors
    for k, result, _, _ in done:
        assert result.get_response().model_version == "1"
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), _x(k) + 100)
    # some were still waiting when the reload had finished: they did queue
    assert max(t for *_, t in done) > reloaded
    # once drained, the record drops version 1 and workers unload its instances
    assert wait_until(lambda: not registered_instances(stack.redis_url, "drained", 1), 30)
    assert registered_instances(stack.redis_url, "drained", 2)
    c.close()
