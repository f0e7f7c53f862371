"""Schedulers sharded by model, under the launcher with two schedulers: every
model serves, each model's queue is in one scheduler (its own QueueStats say
which models it carried), a third scheduler joining takes its share with no
request lost, a scheduler stalled (SIGSTOP) past its lease loses its models
within 5 s and, resumed, runs none of the requests it held (they are resent
to the new owner), and a scheduler killed with -9 under a sequence hands the
sequence, state intact, to a survivor within 5 s.

One stack for the module; the tests run in file order (join, leave, stall,
then kill).
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve import redis_keys as keys
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.launcher import Child, Stack, start_scheduler, start_services
from stageserve.shard_policy import assign
from stageserve_tools.examples import (
    PY_BLS_SOURCE,
    python_config_text,
    write_accumulator,
    write_ensemble_mlp,
    write_identity,
    write_mlp,
    write_preprocess,
    write_python_model,
)
from tests.stack import wait_until

IDENTITIES = [f"id_{c}" for c in "abcdefgh"]
# py_bls (owned by `scheduler`) calls mlp_d (owned by `scheduler-1`) from the
# worker: a BLS call routed by the called model, not to the worker's --scheduler.
QUEUED = [*IDENTITIES, "acc", "preprocess", "mlp", "py_bls", "mlp_d"]  # models with a queue
ALL = [*QUEUED, "ensemble_mlp"]  # the ensemble runs its steps on their owners


class Shards:
    def __init__(self, stack: Stack, redis_url: str, schedulers: list[Child], url: str) -> None:
        self.stack = stack
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.redis_url = redis_url
        self.schedulers = schedulers
        self.url = url
        self.common = [
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            redis_url,
            "--ratelimiter",
            next(c for c in stack.children if c.name == "ratelimiter").address,
        ]

    def owners(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.redis.hgetall(keys.SHARD_OWNERS).items()}

    def live(self) -> list[str]:
        return sorted(str(m) for m in self.redis.zrange(keys.SHARD_MEMBERS, 0, -1))

    def child(self, scheduler_id: str) -> Child:
        return next(c for c in self.schedulers if c.name == scheduler_id)


def owned_in_metrics(child: Child) -> set[str]:
    """The models this scheduler's /metrics says it owns."""
    with urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics") as page:
        text = page.read().decode()
    prefix = 'stageserve_scheduler_shard_owned{model="'
    return {
        line[len(prefix) :].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith(prefix) and line.endswith(" 1.0")
    }


def carried(child: Child) -> set[str]:
    """The models with a queue in this scheduler (its own QueueStats)."""
    with grpc.insecure_channel(child.address) as channel:
        stats = pb_grpc.SchedulerStub(channel).QueueStats(pb.QueueStatsRequest(), timeout=10)
    return {m.model for m in stats.models}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shards]:
    root = tmp_path_factory.mktemp("shards")
    for name in IDENTITIES:
        write_identity(root, name, "FP32", dims=(4,), max_batch_size=8)
    write_accumulator(root, "acc", idle_us=60_000_000)
    write_preprocess(root)
    write_mlp(root, sizes=(256, 16, 10))
    write_ensemble_mlp(root)
    write_mlp(root, "mlp_d", sizes=(256, 16, 10))
    bls_config = python_config_text(
        "py_bls",
        [("INPUT0", "FP32", (256,))],
        [("PROBS", "FP32", (10,)), ("LABEL", "INT64", (1,))],
        max_batch_size=8,
        dynamic_batching=True,
        instance_count=1,
    )
    write_python_model(root, "py_bls", PY_BLS_SOURCE.replace('"mlp"', '"mlp_d"'), bls_config)
    stack = Stack()
    try:
        s = start_services(
            stack, root, device="cpu", schedulers=2, http_address=None, stage_metrics=True
        )
        yield Shards(stack, s.redis_url, s.schedulers, s.gateway.address)
    finally:
        stack.stop()


def infer_identity(
    client: grpcclient.InferenceServerClient, model: str, value: float, timeout_s: float = 30
) -> None:
    data = np.full((1, 4), value, dtype=np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(data)
    out = client.infer(model, [inp], client_timeout=timeout_s).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, data)  # its own answer, not another request's


def send_acc(client, value: int, seq: int, start=False, end=False) -> int:
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    r = client.infer(
        "acc", [inp], sequence_id=seq, sequence_start=start, sequence_end=end, client_timeout=30
    )
    return int(r.as_numpy("OUTPUT")[0, 0])


def test_every_model_serves_and_each_queue_is_in_one_scheduler(shards: Shards) -> None:
    client = grpcclient.InferenceServerClient(shards.url)
    for i, name in enumerate(IDENTITIES):
        infer_identity(client, name, float(i))
    assert send_acc(client, 2, 11, start=True) == 2
    assert send_acc(client, 3, 11, end=True) == 5
    raw = grpcclient.InferInput("RAW", [1, 256], "FP32")
    raw.set_data_from_numpy(np.ones((1, 256), dtype=np.float32))
    assert client.infer("ensemble_mlp", [raw]).as_numpy("PROBS").shape == (1, 10)
    bls_in = grpcclient.InferInput("INPUT0", [1, 256], "FP32")
    bls_in.set_data_from_numpy(np.full((1, 256), 0.5, np.float32))
    assert client.infer("py_bls", [bls_in]).as_numpy("PROBS").shape == (1, 10)

    ids = [c.name for c in shards.schedulers]
    assert shards.live() == sorted(ids)
    assert assign(["py_bls", "mlp_d"], ids) == {"py_bls": "scheduler", "mlp_d": "scheduler-1"}
    owners = shards.owners()
    assert {m: owners[m] for m in QUEUED} == assign(QUEUED, ids)
    loads = {c.name: carried(c) for c in shards.schedulers}
    assert all(loads.values()), loads  # both carry models
    assert loads[ids[0]].isdisjoint(loads[ids[1]]), loads
    for model in QUEUED:
        assert model in loads[owners[model]], (model, loads)
    for child in shards.schedulers:  # and each one's /metrics says which it owns
        assert owned_in_metrics(child) == {m for m, s in owners.items() if s == child.name}


def test_a_joining_scheduler_takes_its_share_with_no_request_lost(shards: Shards) -> None:
    ids = [c.name for c in shards.schedulers] + ["scheduler-2"]
    moving = {m for m, s in assign(IDENTITIES, ids).items() if s == "scheduler-2"}
    assert moving  # the names are chosen so the newcomer wins some
    before = shards.owners()
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def load(models: list[str]) -> None:
        client = grpcclient.InferenceServerClient(shards.url)
        n = 0
        while not stop.is_set():
            for m in models:
                try:
                    infer_identity(client, m, float(n))
                    served[0] += 1
                except (InferenceServerException, AssertionError) as exc:
                    failures.append(f"{m}: {exc}")
                n += 1

    threads = [threading.Thread(target=load, args=(IDENTITIES[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        joined = start_scheduler(shards.stack, 2, [*shards.common])
        shards.schedulers.append(joined)
        t0 = time.monotonic()
        assert wait_until(lambda: moving <= carried(joined), timeout_s=10), carried(joined)
        moved_s = time.monotonic() - t0
        done = served[0]
        assert wait_until(lambda: served[0] > done + 20, timeout_s=10)  # still serving after
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:5]
    assert moved_s < 5.0
    after = shards.owners()
    assert {m for m in IDENTITIES if after[m] != before[m]} == moving
    # The old owners closed the moved models' queues: each queue in one place.
    for child in shards.schedulers[:2]:
        assert not (carried(child) & moving)


def test_a_leaving_scheduler_hands_its_models_back_with_no_request_lost(shards: Shards) -> None:
    leaver = shards.child("scheduler-2")
    ids = [c.name for c in shards.schedulers if c is not leaver]
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def load() -> None:
        client = grpcclient.InferenceServerClient(shards.url)
        n = 0
        while not stop.is_set():
            for m in IDENTITIES:
                try:
                    infer_identity(client, m, float(n))
                    served[0] += 1
                except (InferenceServerException, AssertionError) as exc:
                    failures.append(f"{m}: {exc}")
                n += 1

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert wait_until(lambda: served[0] > 20, timeout_s=10)
        leaver.proc.send_signal(signal.SIGTERM)  # a clean stop: it hands over first
        assert leaver.proc.wait(15) == 0
        done = served[0]
        assert wait_until(lambda: served[0] > done + 20, timeout_s=10)
    finally:
        stop.set()
        thread.join(30)
    shards.schedulers.remove(leaver)
    assert not failures, failures[:5]
    assert "scheduler-2" not in shards.live()
    owners = shards.owners()
    assert {m: owners[m] for m in IDENTITIES} == assign(IDENTITIES, ids)


def batches_run(child: Child, model: str) -> float:
    """How many batches of `model` this scheduler has dispatched (/metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics") as page:
        text = page.read().decode()
    prefix = f'stageserve_scheduler_batch_size_count{{model="{model}",'
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_stalled_scheduler_loses_its_models_and_is_fenced_when_it_resumes(
    shards: Shards,
) -> None:
    client = grpcclient.InferenceServerClient(shards.url)
    assert send_acc(client, 1, 91, start=True) == 1
    victim = shards.child(shards.owners()["acc"])
    ids = [c.name for c in shards.schedulers]
    mine = [m for m, s in assign(IDENTITIES, ids).items() if s == victim.name]
    assert mine, ids
    model = mine[0]
    infer_identity(client, model, 1.0)
    assert shards.owners()[model] == victim.name
    ran_before = batches_run(victim, model)

    victim.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # Sent at once, while the map still names the stalled owner: it waits
        # in that scheduler's stream.
        held: list[object] = []

        def send_held() -> None:
            try:
                infer_identity(grpcclient.InferenceServerClient(shards.url), model, 7.0)
                held.append("ok")
            except (InferenceServerException, AssertionError) as exc:
                held.append(exc)

        holder = threading.Thread(target=send_held)
        holder.start()
        # New requests reach the other scheduler once the lease ran out.
        served_s = None
        while time.monotonic() - stopped < 10:
            try:
                infer_identity(client, model, 2.0, timeout_s=0.5)  # routed to the stalled one: none
                served_s = time.monotonic() - stopped
                break
            except InferenceServerException:
                pass
        assert served_s is not None and served_s < 5.0, served_s
        assert shards.owners()[model] != victim.name
        assert victim.name not in shards.live()
        assert send_acc(client, 10, 91) == 11  # the sequence goes on, state from Redis
        assert not held  # still waiting on the stalled scheduler
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    holder.join(30)
    # Resumed, it found the map moved on: it refused what it held (NOT_OWNER),
    # the gateway resent it to the new owner, and it ran no batch of the model;
    # unless the survivor had already handed the model back (the resumed one
    # is live again and the policy gives it its share) when the resend came:
    # then the resend went on to it, the owner again, and it ran that one.
    assert held == ["ok"], held
    ran = batches_run(victim, model) - ran_before
    assert ran == 0 or (ran == 1 and shards.owners()[model] == victim.name), ran
    assert send_acc(client, 100, 91, end=True) == 111
    assert wait_until(lambda: victim.name in shards.live(), timeout_s=5)
    # Back in the map, it gets its share back.
    assert wait_until(lambda: shards.owners()[model] == assign([model], ids)[model], timeout_s=5)
    infer_identity(client, model, 3.0)


def test_a_killed_scheduler_s_sequence_continues_on_a_survivor(shards: Shards) -> None:
    client = grpcclient.InferenceServerClient(shards.url)
    owner = shards.owners()["acc"]
    assert send_acc(client, 1, 77, start=True) == 1
    assert send_acc(client, 10, 77) == 11
    victim = shards.child(owner)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    killed = time.monotonic()
    total = None
    while time.monotonic() - killed < 10:
        try:
            total = send_acc(client, 100, 77)
            break
        # The gateway holds a request for the dead owner until the map moves
        # (nothing was sent), then sends it to the heir; a request caught in
        # the dead scheduler's stream fails UNAVAILABLE, as before sharding.
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc
            time.sleep(0.05)
    recovered_s = time.monotonic() - killed
    assert total == 111  # the state from before the kill, applied once
    assert recovered_s < 5.0, recovered_s
    assert send_acc(client, 1000, 77, end=True) == 1111
    survivor = shards.owners()["acc"]
    assert survivor != owner and survivor in shards.live()
    assert owner not in shards.live()
    assert "acc" in carried(shards.child(survivor))
