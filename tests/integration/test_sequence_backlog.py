"""The sequence backlog in Redis, and states that grow (variable dims).

Two gateway+scheduler paths share one Redis: a sequence's requests queue in
its Redis backlog in arrival order whichever scheduler took them, and a
scheduler killed while executing cannot block the sequence."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve.launcher import Child
from stageserve.settings import settings_from_env
from stageserve_tools.examples import write_accumulator, write_history
from tests.integration.helpers import two_paths
from tests.integration.test_sequences import send
from tests.stack import RunningStack, running_stack, wait_until

SLOW_MS = 600
SLOW = f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{SLOW_MS}" }} }}'
BACKLOG = "ss:seq:acc:1:i:{cid}:q"


def _in_background(
    client: grpcclient.InferenceServerClient, value: int, cid: int
) -> tuple[threading.Thread, list[InferenceServerException]]:
    """Send one request of sequence `cid` from a thread; its errors collect."""
    errors: list[InferenceServerException] = []

    def call() -> None:
        try:
            send(client, "acc", value, cid)
        except InferenceServerException as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    return t, errors


def _owner(r: redis.Redis, running: RunningStack, sched2: Child) -> tuple[Child, str]:
    """The scheduler that owns "acc", and the other one's id."""
    owner_id = r.hget("ss:shard:owners", "acc").decode()  # type: ignore[union-attr]
    other = "scheduler-2" if owner_id == "scheduler" else "scheduler"
    return {"scheduler": running.scheduler, "scheduler-2": sched2}[owner_id], other


def test_backlog_orders_a_sequence_across_schedulers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While path A executes request 2 of a sequence, request 3 arrives at
    path B: it waits in the Redis backlog behind A's entry and runs after it.
    The schedulers stay out of the shard map (each queues what its gateway
    sends), so both run the one sequence, as they may while a model moves."""
    monkeypatch.setenv("STAGESERVE_SCHEDULER_SHARD_LEASE_MS", "0")
    write_accumulator(tmp_path, "acc", idle_us=60_000_000, extra=SLOW)
    with two_paths(tmp_path) as (running, _, client_b):
        r = redis.Redis.from_url(running.redis_url)
        client_a = running.client()
        key = BACKLOG.format(cid=4242)
        send(client_a, "acc", 1, 4242, start=True)
        assert r.llen(key) == 0  # finished requests leave the backlog
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(send, client_a, "acc", 2, 4242)
            assert wait_until(lambda: r.llen(key) == 1, interval_s=0.01)
            second = pool.submit(send, client_b, "acc", 3, 4242)
            assert wait_until(lambda: r.llen(key) == 2, interval_s=0.01)
            # a client without decode_responses: bytes
            entries = [e.decode() for e in cast("list[bytes]", r.lrange(key, 0, -1))]
            owners = {e.split(":")[0] for e in entries}
            assert len(owners) == 2, entries  # one entry per scheduler, A's first
            assert not first.done() and not second.done()
            assert first.result().as_numpy("OUTPUT")[0, 0] == 3
            assert second.result().as_numpy("OUTPUT")[0, 0] == 6
        assert r.llen(key) == 0


def test_scheduler_killed_mid_execution_does_not_block_the_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sequence's scheduler dies while executing a request: that request
    fails, its state change is never kept, and the other scheduler, the
    model's new owner, continues the sequence from the last committed state
    once the dead scheduler's entry expires. (No kept states, so every
    request is listed; the next test kills an owner that keeps them.)"""
    monkeypatch.setenv("STAGESERVE_SCHEDULER_SEQUENCE_CACHE_ENTRIES", "0")
    write_accumulator(tmp_path, "acc", idle_us=60_000_000, extra=SLOW)
    with two_paths(tmp_path) as (running, sched2, client_b):
        r = redis.Redis.from_url(running.redis_url)
        client_a = running.client()
        key = BACKLOG.format(cid=5151)
        send(client_a, "acc", 10, 5151, start=True)
        t, errors = _in_background(client_a, 1000, 5151)
        assert wait_until(lambda: r.llen(key) == 1, interval_s=0.01)
        time.sleep(SLOW_MS / 3000)  # inside the execution
        owner, _ = _owner(r, running, sched2)
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait(10)
        t.join(30)
        assert errors and errors[0].status() == "StatusCode.UNAVAILABLE", errors
        began = time.monotonic()
        out = send(client_b, "acc", 5, 5151, end=True).as_numpy("OUTPUT")[0, 0]
        assert out == 15  # 10 + 5: the killed request's +1000 was never committed
        # It waited for the dead owner's key, not for the idle timeout (60 s).
        assert (
            time.monotonic() - began
            < settings_from_env().scheduler.sequence_owner_ttl_ms / 1000 + 10
        )
        assert r.llen(key) == 0


def test_owner_killed_while_a_request_runs_with_kept_states(tmp_path: Path) -> None:
    """The model's owner keeps a sequence's states, so its next request runs
    unlisted and unclaimed; the owner dies while executing it: the request
    fails, its state change is never kept, and the survivor, the model's next
    owner, continues from the last committed state with no entry to wait for."""
    write_accumulator(tmp_path, "acc", idle_us=60_000_000, extra=SLOW)
    with two_paths(tmp_path) as (running, sched2, client_b):
        r = redis.Redis.from_url(running.redis_url)
        client_a = running.client()
        key = BACKLOG.format(cid=6161)
        send(client_a, "acc", 10, 6161, start=True)
        assert send(client_a, "acc", 5, 6161).as_numpy("OUTPUT")[0, 0] == 15
        t, errors = _in_background(client_a, 1000, 6161)
        time.sleep(SLOW_MS / 2000)  # inside the execution
        assert r.llen(key) == 0  # kept states: nothing listed
        owner, _ = _owner(r, running, sched2)
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait(10)
        t.join(30)
        assert errors and errors[0].status() == "StatusCode.UNAVAILABLE", errors
        out = send(client_b, "acc", 1, 6161, end=True).as_numpy("OUTPUT")[0, 0]
        assert out == 16  # 10 + 5 + 1: the killed request's +1000 was never committed
        assert r.llen(key) == 0


def test_a_stalled_owner_s_commit_is_fenced_after_its_model_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner stalls (SIGSTOP) while a request of a sequence whose states
    it keeps executes; its lease runs out and the survivor takes the model
    and continues the sequence from Redis. Resumed, the stalled scheduler's
    commit finds the model's term changed: it keeps nothing and its request
    fails UNAVAILABLE, so the survivor's state stands."""
    monkeypatch.setenv("STAGESERVE_SCHEDULER_SHARD_LEASE_MS", "1500")
    slow_ms = 2500
    slow = f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{slow_ms}" }} }}'
    write_accumulator(tmp_path, "acc", idle_us=60_000_000, extra=slow)
    with two_paths(tmp_path) as (running, sched2, client_b):
        r = redis.Redis.from_url(running.redis_url)
        client_a = running.client()
        send(client_a, "acc", 10, 6262, start=True)
        owner, survivor = _owner(r, running, sched2)
        t, errors = _in_background(client_a, 1000, 6262)
        time.sleep(slow_ms / 3000)  # inside the execution
        owner.proc.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            assert wait_until(
                lambda: r.hget("ss:shard:owners", "acc") == survivor.encode(), timeout_s=15
            )
            # The survivor continues from Redis: the stalled +1000 is not there.
            assert send(client_b, "acc", 1, 6262).as_numpy("OUTPUT")[0, 0] == 11
            assert time.monotonic() - began < 15
        finally:
            owner.proc.send_signal(signal.SIGCONT)
        t.join(30)
        assert errors and errors[0].status() == "StatusCode.UNAVAILABLE", errors
        assert "moved to another scheduler" in errors[0].message()
        out = send(client_b, "acc", 100, 6262, end=True).as_numpy("OUTPUT")[0, 0]
        assert out == 111  # the stalled commit kept nothing


@pytest.fixture(scope="module")
def history_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("history_repository")
    write_history(root, "history_oldest", "oldest")
    write_history(root, "history_direct", "direct")
    write_history(root, "history_one_slot", "direct", max_batch_size=1, idle_us=500_000)
    with running_stack(root) as running:
        yield running


@pytest.mark.parametrize("model", ["history_oldest", "history_direct"])
def test_state_grows_request_by_request(history_stack: RunningStack, model: str) -> None:
    client = history_stack.client()
    out = grpcclient.InferRequestedOutput
    expected = [0]  # variable dims without initial_state start as one zero
    for step, value in enumerate([4, 7, 1, 9]):
        inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        r = client.infer(
            model,
            [inp],
            outputs=[out("OUTPUT"), out("STATE_OUT")],
            sequence_id=77,
            sequence_start=step == 0,
            sequence_end=step == 3,
        )
        expected.append(value)
        assert r.as_numpy("STATE_OUT").tolist() == [expected]
        assert r.as_numpy("OUTPUT")[0, 0] == sum(expected)


@pytest.mark.parametrize("model", ["history_oldest", "history_direct"])
def test_sequences_of_different_state_lengths_interleave(
    history_stack: RunningStack, model: str
) -> None:
    """Concurrent sequences whose states have different lengths: a batch only
    joins equal shapes, and every sequence sees exactly its own history."""
    client = history_stack.client()

    def run(seq: int) -> list[int]:
        sums = []
        for step in range(seq % 4 + 3):  # 3..6 steps: lengths drift apart
            last = step == seq % 4 + 2
            r = send(client, model, seq * 100 + step, 9000 + seq, step == 0, last)
            sums.append(int(r.as_numpy("OUTPUT")[0, 0]))
        return sums

    seqs = list(range(1, 9))
    with ThreadPoolExecutor(len(seqs)) as pool:
        results = dict(zip(seqs, pool.map(run, seqs), strict=True))
    for seq, sums in results.items():
        values = [seq * 100 + step for step in range(seq % 4 + 3)]
        assert sums == [sum(values[: i + 1]) for i in range(len(values))], seq


def test_start_waiting_for_a_slot_runs_when_the_slot_idles_out(
    history_stack: RunningStack,
) -> None:
    """direct with one slot: a sequence that never ends holds it until its idle
    timeout; a second START waits for that, then runs (no later arrival needed)."""
    client = history_stack.client()
    send(client, "history_one_slot", 1, 501, start=True)
    began = time.monotonic()
    assert send(client, "history_one_slot", 2, 502, start=True).as_numpy("OUTPUT")[0, 0] == 2
    waited = time.monotonic() - began
    assert 0.3 < waited < 10, waited


def test_without_redis_a_sequence_request_is_unavailable(tmp_path: Path) -> None:
    """The sequence's state cannot be kept: the request is answered
    UNAVAILABLE with the reason, at once, instead of waiting."""
    write_accumulator(tmp_path, "acc", idle_us=60_000_000)
    with running_stack(tmp_path) as running:
        client = running.client()
        send(client, "acc", 1, 31, start=True)
        redis_child = next(c for c in running.stack.children if c.name == "redis")
        redis_child.proc.kill()
        redis_child.proc.wait(10)
        with pytest.raises(InferenceServerException) as info:
            send(client, "acc", 2, 31)
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert "the state store is unavailable" in info.value.message()
