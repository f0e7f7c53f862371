"""Stages failing and joining under a running stack, seen through the real tritonclient.

Each test starts a stack of its own and kills (SIGKILL, no goodbye) or adds a
service process. What must hold: a client gets a clear UNAVAILABLE within a
bounded time, never a hang, and the stack serves again from what is left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from stageserve_tools.examples import write_mlp, write_simple
from tests.integration.helpers import (
    RPC_TIMEOUT_S,
    granted_instances,
    infer_simple,
    mlp_input,
    registered_instances,
    registered_workers,
    stack_retrying,
    start_worker_retrying,
    worker_id,
)
from tests.stack import RunningStack, wait_until

UNAVAILABLE = "StatusCode.UNAVAILABLE"
#: a failure must reach the client within this many seconds
BOUND_S = 10.0


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("failures_repository")
    write_simple(root, "simple")
    write_mlp(root, "mlp", instance_count=2)
    _execute_delay(root / "mlp", 5)
    # For the killed-worker test: each request its own batch (no dynamic
    # batching) taking SLOW_MS, and more clients than instances, so every
    # instance is executing whenever the victim is killed. A grant in Redis
    # alone does not show that: the scheduler keeps spare grants it is not
    # using (grant_pool.py), and killing a worker whose only grants are
    # spare fails nothing.
    write_mlp(root, SLOW, sizes=(256, 16, 10), instance_count=2, dynamic_batching=False)
    _execute_delay(root / SLOW, SLOW_MS)
    return root


SLOW = "mlp_unbatched"
SLOW_MS = 300


def _execute_delay(model_dir: Path, ms: int) -> None:
    with (model_dir / "config.pbtxt").open("a") as config:
        config.write(f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{ms}" }} }}\n')


@dataclass
class Outcome:
    start: float
    end: float
    status: str  # "ok" or the error's status
    message: str = ""


class Load:
    """Client threads sending mlp requests back to back until stopped."""

    def __init__(self, url: str, threads: int, batch: int = 8, model: str = "mlp") -> None:
        self.url = url
        self.batch = batch
        self.model = model
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]

    def _run(self, k: int) -> None:
        c = grpcclient.InferenceServerClient(self.url)
        inputs = mlp_input(self.batch, seed=k)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                out = c.infer(self.model, inputs, client_timeout=RPC_TIMEOUT_S).as_numpy("OUTPUT0")
                assert out.shape == (self.batch, 10)
                outcome = Outcome(t0, time.monotonic(), "ok")
            except InferenceServerException as exc:
                outcome = Outcome(t0, time.monotonic(), exc.status() or "", exc.message() or "")
            with self._lock:
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(RPC_TIMEOUT_S + 5)
        assert not any(t.is_alive() for t in self._threads), "a client thread hung"

    def ok(self) -> int:
        return sum(o.status == "ok" for o in self.outcomes)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != "ok"]


def watch_busy(redis_url: str, worker: str, timeout_s: float, model: str = "mlp") -> set[str]:
    """Sample busy instances until one of `worker`'s for `model` shows up (or
    time runs out)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen |= granted_instances(redis_url)
        if any(i.startswith(f"{worker}/{model}/") for i in seen):
            break
        time.sleep(0.002)
    return seen


def worker_instances(redis_url: str, wid: str, model: str = "mlp") -> set[str]:
    return {i for i in registered_instances(redis_url, model) if i.startswith(wid + "/")}


# ------------------------------------------------------------ killed worker


@pytest.fixture
def two_workers(repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(repo, workers=2) as s:
        wids = {worker_id(w.proc.pid) for w in s.workers}
        assert wait_until(lambda: registered_workers(s.redis_url) == wids, 15)
        assert wait_until(lambda: len(registered_instances(s.redis_url, "mlp")) == 4, 30)
        assert wait_until(lambda: len(registered_instances(s.redis_url, SLOW)) == 4, 30)
        yield s


def test_killed_worker_fails_its_requests_fast_then_survivor_serves(
    two_workers: RunningStack,
) -> None:
    s = two_workers
    victim, survivor = s.workers
    victim_id, survivor_id = worker_id(victim.proc.pid), worker_id(survivor.proc.pid)
    assert len(worker_instances(s.redis_url, victim_id)) == 2

    # Twice as many clients as instances: two requests wait in the queue
    # for each instance, so all four execute all the time.
    with Load(s.url, threads=8, batch=1, model=SLOW) as load:
        assert wait_until(lambda: load.ok() >= 8, 30)
        # the victim is taking load before the kill
        seen = watch_busy(s.redis_url, victim_id, 5, SLOW)
        killed_at = time.monotonic()
        victim.proc.kill()
        victim.proc.wait(5)
        time.sleep(1.5)
    assert any(i.startswith(f"{victim_id}/{SLOW}/") for i in seen), seen

    failed = load.failed()
    after_kill = [o for o in load.outcomes if o.end > killed_at]
    assert after_kill, "the load stopped when the worker died"
    # requests in flight on the dead worker fail, clearly and fast
    assert failed, "requests in flight on the killed worker should have failed"
    for o in failed:
        assert o.status == UNAVAILABLE, o
        assert "worker" in o.message, o
        assert "mlp" in o.message, o
        assert o.end - max(o.start, killed_at) < BOUND_S, o
        assert o.end >= killed_at, o  # nothing failed before the kill
    # the rest of the load kept being served
    assert sum(o.status == "ok" and o.start > killed_at for o in load.outcomes) > 0

    # the rate limiter forgets the dead worker and its instances
    assert wait_until(lambda: registered_workers(s.redis_url) == {survivor_id}, BOUND_S)
    for model in ("mlp", SLOW):
        assert registered_instances(s.redis_url, model) == worker_instances(
            s.redis_url, survivor_id, model
        )
        assert len(worker_instances(s.redis_url, survivor_id, model)) == 2

    # and every new request succeeds on the survivor
    c = s.client()
    for k in range(50):
        out = c.infer("mlp", mlp_input(1, seed=k), client_timeout=RPC_TIMEOUT_S)
        assert out.as_numpy("OUTPUT0").shape == (1, 10)
    assert c.is_server_live(client_timeout=RPC_TIMEOUT_S)
    assert c.is_model_ready("mlp", client_timeout=RPC_TIMEOUT_S)


def test_killed_idle_worker_is_forgotten_by_lease(two_workers: RunningStack) -> None:
    """No request touches the dead worker: its lease alone removes it."""
    s = two_workers
    victim, survivor = s.workers
    survivor_id = worker_id(survivor.proc.pid)
    victim.proc.kill()
    victim.proc.wait(5)
    assert wait_until(lambda: registered_workers(s.redis_url) == {survivor_id}, BOUND_S)
    assert registered_instances(s.redis_url, "mlp") == worker_instances(s.redis_url, survivor_id)
    c = s.client()
    for k in range(50):
        c.infer("mlp", mlp_input(2, seed=k), client_timeout=RPC_TIMEOUT_S)
    infer_simple(c)


# ------------------------------------------------------ killed scheduler


@pytest.fixture
def one_worker(repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(repo) as s:
        assert wait_until(lambda: len(registered_instances(s.redis_url, "mlp")) == 2, 30)
        yield s


def _timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        result = fn(*args, **kwargs)
    except InferenceServerException as exc:
        result = exc
    return time.monotonic() - t0, result


def test_killed_scheduler_gives_unavailable_fast(one_worker: RunningStack) -> None:
    s = one_worker
    c = s.client()
    infer_simple(c)  # the gateway's stream to the scheduler is up

    # requests in flight when the scheduler dies
    results: list = []
    done = threading.Event()

    def callback(result, error) -> None:
        results.append(error if error is not None else result)
        if len(results) == 8:
            done.set()

    for k in range(8):
        c.async_infer("mlp", mlp_input(64, seed=k), callback=callback, client_timeout=RPC_TIMEOUT_S)
    t_kill = time.monotonic()
    s.scheduler.proc.kill()
    s.scheduler.proc.wait(5)
    assert done.wait(BOUND_S + 5), "in-flight requests hung after the scheduler died"
    assert time.monotonic() - t_kill < BOUND_S
    for r in results:
        if isinstance(r, InferenceServerException):
            assert r.status() == UNAVAILABLE, r
            assert "scheduler" in r.message(), r

    # a new request: UNAVAILABLE within the bound (the gateway gives the
    # scheduler connection a few seconds before it answers)
    elapsed, result = _timed(infer_simple, c)
    assert isinstance(result, InferenceServerException), result
    assert result.status() == UNAVAILABLE, result
    assert "scheduler" in result.message(), result
    assert elapsed < BOUND_S, elapsed
    # the gateway itself is alive and still answers what it knows
    assert c.is_server_live(client_timeout=RPC_TIMEOUT_S)
    assert c.get_model_metadata("simple", client_timeout=RPC_TIMEOUT_S).name == "simple"


# ---------------------------------------------------- killed rate limiter


def test_killed_ratelimiter_gives_unavailable_fast(one_worker: RunningStack) -> None:
    s = one_worker
    c = s.client()
    infer_simple(c)
    killed_at = time.monotonic()
    s.ratelimiter.proc.kill()
    s.ratelimiter.proc.wait(5)
    # The scheduler may keep serving a little while on grants it already holds
    # (it reuses a grant for a short while); then nothing can be scheduled.
    timings: list[float] = []
    first_failure = None
    while time.monotonic() - killed_at < BOUND_S + 5:
        elapsed, result = _timed(infer_simple, c)
        timings.append(elapsed)
        if isinstance(result, InferenceServerException):
            first_failure = result
            break
        time.sleep(0.05)
    failed_at = time.monotonic()
    assert all(t < BOUND_S for t in timings), timings
    assert first_failure is not None, "requests kept succeeding without a rate limiter"
    assert failed_at - killed_at < BOUND_S, failed_at - killed_at
    assert first_failure.status() == UNAVAILABLE, first_failure
    assert "rate limiter" in first_failure.message(), first_failure
    # and it stays that way, answered fast
    elapsed, again = _timed(infer_simple, c)
    assert isinstance(again, InferenceServerException), again
    assert again.status() == UNAVAILABLE and elapsed < BOUND_S, (again, elapsed)
    assert c.is_server_live(client_timeout=RPC_TIMEOUT_S)


# ------------------------------------------------------ worker added later


def test_worker_added_later_registers_and_takes_load(one_worker: RunningStack) -> None:
    s = one_worker
    first_id = worker_id(s.workers[0].proc.pid)
    assert registered_workers(s.redis_url) == {first_id}

    extra = start_worker_retrying(s)
    extra_id = worker_id(extra.proc.pid)
    # the new worker loads the published models and registers their instances
    assert wait_until(lambda: registered_workers(s.redis_url) == {first_id, extra_id}, 30)
    assert wait_until(lambda: len(worker_instances(s.redis_url, extra_id)) == 2, 30)
    assert len(registered_instances(s.redis_url, "mlp")) == 4

    # under concurrent load, the new worker's instances get execution grants
    with Load(s.url, threads=6) as load:
        seen = watch_busy(s.redis_url, extra_id, 15)
    assert any(i.startswith(extra_id + "/") for i in seen), seen
    assert load.failed() == []
    assert load.ok() > 0


def test_worker_added_later_serves_alone_after_the_first_dies(one_worker: RunningStack) -> None:
    s = one_worker
    first = s.workers[0]
    c = s.client()
    for k in range(5):  # served by the first worker: the only one so far
        c.infer("mlp", mlp_input(1, seed=k), client_timeout=RPC_TIMEOUT_S)
    extra = start_worker_retrying(s)
    extra_id = worker_id(extra.proc.pid)
    assert wait_until(lambda: len(worker_instances(s.redis_url, extra_id)) == 2, 30)
    first.proc.kill()
    first.proc.wait(5)
    assert wait_until(lambda: registered_workers(s.redis_url) == {extra_id}, BOUND_S)
    time.sleep(1.0)  # well past the scheduler's standby hold of an idle grant
    for k in range(30):
        out = c.infer("mlp", mlp_input(1, seed=k), client_timeout=RPC_TIMEOUT_S)
        assert out.as_numpy("OUTPUT0").shape == (1, 10)
    infer_simple(c)


def test_idle_scheduler_returns_its_grants(one_worker: RunningStack) -> None:
    s = one_worker
    c = s.client()
    for _ in range(3):
        infer_simple(c)
    assert wait_until(lambda: not granted_instances(s.redis_url), 10.0), granted_instances(
        s.redis_url
    )
