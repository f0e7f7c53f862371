"""Every request of a sequence runs on the instance its START ran on, as in
Triton 2.51 ("the sequence batcher ensures that all inference requests in a
sequence get routed to the same model instance"): a Python model that keeps
a sequence's state in the instance itself answers right with several
instances.

The model below keeps a running sum per correlation id in `self` and answers
it with a tag of its instance (its process and object: instances may share
a process).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.references import wait_ready
from stageserve import redis_keys as keys
from stageserve.launcher import Stack, start_services
from tests.integration.helpers import granted_instances, registered_instances, triton_grpc
from tests.stack import running_stack, wait_until

MODEL = """\
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}
        self.tag = hash((os.getpid(), id(self))) & 0x7FFFFFFFFFFFFFFF

    def execute(self, requests):
        time.sleep(0.005)
        out = []
        for r in requests:
            x = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)[0])
            cid = r.correlation_id()
            if r.flags() & 1:
                self.sums[cid] = 0
            self.sums[cid] = self.sums.get(cid, -1000000) + x
            total = np.array([[self.sums[cid]]], np.int64)
            tag = np.array([[self.tag]], np.int64)
            if r.flags() & 2:
                del self.sums[cid]
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("SUM", total), pb_utils.Tensor("TAG", tag)]))
        return out
"""

MODELS = {"sticky_oldest": "oldest", "sticky_direct": "direct"}
SEQUENCES = 8
STEPS = 6


def _config(name: str, strategy: str) -> str:
    return f"""name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "SUM" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "TAG" data_type: TYPE_INT64 dims: [ 1 ] }} ]
sequence_batching {{
  {strategy} {{ }}
  max_sequence_idle_microseconds: 60000000
}}
instance_group [ {{ kind: KIND_CPU count: 2 }} ]
"""


def write_repository(root: Path) -> Path:
    for name, strategy in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL)
        (root / name / "config.pbtxt").write_text(_config(name, strategy))
    return root


def run_sequences(url: str, model: str) -> dict[int, list[tuple[int, int]]]:
    """(running sum, instance tag) per step of each sequence, sequences in parallel."""
    seen: dict[int, list[tuple[int, int]]] = {}
    errors: list[BaseException] = []

    def one(cid: int) -> None:
        try:
            with grpcclient.InferenceServerClient(url) as client:
                for step in range(STEPS):
                    inp = grpcclient.InferInput("IN", [1, 1], "INT32")
                    inp.set_data_from_numpy(np.array([[cid * 10 + step]], np.int32))
                    r = client.infer(
                        model, [inp], sequence_id=cid, sequence_start=step == 0,
                        sequence_end=step == STEPS - 1,
                    )  # fmt: skip
                    seen.setdefault(cid, []).append(
                        (int(r.as_numpy("SUM")[0][0]), int(r.as_numpy("TAG")[0][0]))
                    )
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(1, SEQUENCES + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return seen


def check(seen: dict[int, list[tuple[int, int]]]) -> set[int]:
    """Each sequence's sums are right and its steps ran on one instance;
    returns the instances seen."""
    tags = set()
    for cid, steps in seen.items():
        sums = [s for s, _ in steps]
        want = list(np.cumsum([cid * 10 + step for step in range(STEPS)]))
        assert sums == want, (cid, steps)
        assert len({p for _, p in steps}) == 1, (cid, steps)
        tags.add(steps[0][1])
    return tags


@contextlib.contextmanager
def _serving(server: str, repository: Path, workdir: Path) -> Iterator[str]:
    if server == "triton":
        with triton_grpc(repository, workdir, list(MODELS)) as url:
            yield url
        return
    # "stageserve-2": two workers, four instances; the sequences still take
    # the config's two (the others stand by for a worker's death)
    with running_stack(repository, workers=2 if server.endswith("-2") else 1) as stack:
        wait_ready(stack.url, list(MODELS), 120)
        yield stack.url
        # every grant goes back once the queues are idle: none kept for an
        # instance the filters stopped naming
        assert wait_until(lambda: not granted_instances(stack.redis_url), timeout_s=10)


@pytest.mark.parametrize("server", ["stageserve", "stageserve-2", "triton"])
def test_a_sequence_stays_on_one_instance(server: str, tmp_path: Path) -> None:
    repository = write_repository(tmp_path / "repo")
    with _serving(server, repository, tmp_path) as url:
        for model in MODELS:
            tags = check(run_sequences(url, model))
            assert len(tags) == 2, (model, tags)  # both instances served


def test_sequences_move_on_when_their_instances_worker_dies(tmp_path: Path) -> None:
    """The pinned instances are gone: the sequences' next requests run on the
    new worker's instances (their in-instance sums went with the old ones)
    rather than wait for them, and new sequences run as before."""
    model = "sticky_direct"
    repository = write_repository(tmp_path / "repo")
    with running_stack(repository) as stack:
        wait_ready(stack.url, list(MODELS), 120)
        with grpcclient.InferenceServerClient(stack.url) as client:
            for cid in (1, 2, 3, 4):  # two sequences per instance, left open
                _step(client, model, cid, 1, start=True)
            old = registered_instances(stack.redis_url, model)
            os.kill(stack.workers[0].proc.pid, signal.SIGKILL)
            stack.start_worker()

            def replaced() -> bool:
                now = registered_instances(stack.redis_url, model)
                return len(now) == 2 and not now & old

            # (with no instance registered a request fails UNAVAILABLE, as on Triton)
            assert wait_until(replaced, timeout_s=30)
            for cid in (1, 2, 3, 4):
                _step(client, model, cid, 1, end=True)  # answered, not stuck
        tags = check(run_sequences(stack.url, model))
        assert len(tags) == 2, tags


def _step(
    client: grpcclient.InferenceServerClient,
    model: str,
    cid: int,
    value: int,
    start: bool = False,
    end: bool = False,
) -> tuple[int, int]:
    """One request: (the running sum, the instance's tag)."""
    inp = grpcclient.InferInput("IN", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], np.int32))
    r = client.infer(
        model, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, client_timeout=30
    )
    return int(r.as_numpy("SUM")[0][0]), int(r.as_numpy("TAG")[0][0])


def test_a_killed_schedulers_sequences_stay_on_their_instances(tmp_path: Path) -> None:
    """Two schedulers sharing the models: the owner of the model is killed
    with -9 while sequences are open; the survivor takes up the slots and
    pins the owner saved in Redis, so each sequence's next requests run on
    the instance holding its sum."""
    model = "sticky_direct"
    repository = write_repository(tmp_path / "repo")
    stack = Stack()
    try:
        s = start_services(stack, repository, device="cpu", schedulers=2, http_address=None)
        url = s.gateway.address
        wait_ready(url, list(MODELS), 120)
        shards = redis.Redis.from_url(s.redis_url, decode_responses=True)
        sequences = (1, 2, 3, 4)  # two per instance
        with grpcclient.InferenceServerClient(url) as client:
            tags = {cid: _step(client, model, cid, cid, start=True)[1] for cid in sequences}
            assert len(set(tags.values())) == 2, tags  # both instances
            # the batch that pinned a group saved the pins before it answered
            saved = shards.hgetall(keys.sequence_prefix(model, 1) + "pins")
            pins = {g: i for g, i in saved.items() if g.isdigit()}
            assert sorted(pins) == ["0", "1"] and len(set(pins.values())) == 2, saved
            owner = str(shards.hget(keys.SHARD_OWNERS, model))
            victim = next(c for c in s.schedulers if c.name == owner)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            # in another order than they started: a scheduler placing them
            # afresh would put sequences 1 and 4 in one instance's slots
            again = (1, 2, 4, 3)
            for cid in again:
                step = functools.partial(_step, client, model, cid, 10)
                assert _retrying(step) == (cid + 10, tags[cid]), cid
            for cid in again:
                assert _step(client, model, cid, 20, end=True) == (cid + 30, tags[cid]), cid
        assert str(shards.hget(keys.SHARD_OWNERS, model)) != owner
    finally:
        stack.stop()


def _retrying(call: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """The gateway holds a request for a dead owner until the model moves; a
    request caught in the dead scheduler's stream fails UNAVAILABLE."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return call()
        except InferenceServerException as exc:
            if exc.status() != "StatusCode.UNAVAILABLE" or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
