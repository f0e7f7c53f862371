"""Redis restarted empty under a supervised stack: the state is rebuilt.

The embedded Redis is kill -9ed; the supervisor starts it again on its port,
empty. What must follow with nobody acting: the gateway republishes the
model set (same generations, so workers keep their instances and nothing
reloads), workers re-register those instances, requests succeed again
(goal 5 s, shown by bench.chaos; the bound here, HEAL_BOUND_S, leaves room
for a machine shared with other jobs), statistics keep counting, and a sequence whose state was lost
fails with INVALID_ARGUMENT naming the lost state (never a silent restart
from zero, which would answer a wrong running sum).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve import redis_keys as keys
from stageserve.launcher import redis_answers
from stageserve_tools.examples import write_accumulator, write_simple
from tests.integration.helpers import (
    infer_simple,
    model_stats,
    redis_client,
    registered_instances,
    start_stack_retrying,
)
from tests.stack import RunningStack, wait_until

HEAL_BOUND_S = 15.0


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("redis_restart_repository")
    write_simple(root, "simple")
    write_accumulator(root, "acc", strategy="oldest", idle_us=60_000_000)
    running = start_stack_retrying(root)
    running.stack.supervise()
    try:
        yield running
    finally:
        running.stack.stop()


def _send(client, value: int, seq: int, start: bool = False, end: bool = False):
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    result = client.infer(
        "acc", [inp], sequence_id=seq, sequence_start=start, sequence_end=end, client_timeout=10
    )
    return int(result.as_numpy("OUTPUT")[0, 0])


def _simple_ok(client) -> bool:
    try:
        infer_simple(client)
    except InferenceServerException:
        return False
    return True


def _generation(redis_url: str, model: str) -> int | None:
    r = redis_client(redis_url)
    try:
        value = r.hget(keys.model(model), "generation")
        return None if value is None else int(value)
    finally:
        r.close()


def test_redis_restarted_empty_is_rebuilt(running: RunningStack) -> None:
    client = running.client()
    infer_simple(client)
    assert _send(client, 1, 77, start=True) == 1
    assert _send(client, 2, 77) == 3
    instances = registered_instances(running.redis_url, "simple")
    generation = _generation(running.redis_url, "simple")
    count_before = model_stats(client, "simple").inference_count
    assert instances and generation is not None

    redis_child = running.child("redis")
    old_pid = redis_child.proc.pid
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    assert wait_until(lambda: redis_child.proc.pid != old_pid, HEAL_BOUND_S)
    port = int(redis_child.address.rsplit(":", 1)[1])
    assert wait_until(lambda: redis_answers(port), HEAL_BOUND_S - (time.monotonic() - killed_at))
    # Requests may succeed while Redis is down (grants already held); what
    # counts is success once it is back, empty.
    assert wait_until(lambda: _simple_ok(client), HEAL_BOUND_S - (time.monotonic() - killed_at)), (
        f"no success within {HEAL_BOUND_S}s of the Redis kill"
    )

    # Rebuilt, not reloaded: same generation, same instances registered again.
    left = HEAL_BOUND_S - (time.monotonic() - killed_at)
    assert wait_until(lambda: _generation(running.redis_url, "simple") == generation, left)
    left = HEAL_BOUND_S - (time.monotonic() - killed_at)
    assert wait_until(lambda: registered_instances(running.redis_url, "simple") == instances, left)
    r = redis_client(running.redis_url)
    try:
        assert r.zcard(keys.MODEL_PUBLISHERS) == 1  # the gateway marked again
        assert int(r.get(keys.GENERATION_COUNTER)) >= generation
    finally:
        r.close()
    assert client.is_model_ready("simple") and client.is_model_ready("acc")

    # Statistics continue from where they were (the gateway keeps its own figures).
    assert model_stats(client, "simple").inference_count >= count_before + 1

    # The sequence's running sum (3) was in Redis: its next request is refused
    # with a clear error, not answered from zero.
    with pytest.raises(InferenceServerException) as lost:
        _send(client, 3, 77)
    assert lost.value.status() == "StatusCode.INVALID_ARGUMENT", lost.value.message()
    assert "state was lost" in lost.value.message()
    # Resent from START, it runs; a sequence never started gets the usual error.
    assert _send(client, 1, 77, start=True) == 1
    assert _send(client, 2, 77, end=True) == 3
    with pytest.raises(InferenceServerException) as never:
        _send(client, 1, 78)
    assert never.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "state was lost" not in never.value.message()
    assert "START" in never.value.message()
