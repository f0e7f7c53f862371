"""Triton's rate limiter through tritonclient: resources, device scope,
priorities, two rate limiters, and nothing leaked by killed processes.

Models are the `simple` add/sub model without batching (one request, one
execution) made slow with the `execute_delay_ms` parameter. Executions that exclude
each other take at least the sum of their delays (a lower bound: load only
stretches it), and the rate limiter's held count in Redis, sampled while they
run, never exceeds the resource; executions allowed to overlap finish
together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from stageserve_tools.examples import write_simple
from tests.integration.helpers import (
    client,
    infer_simple,
    model_stats,
    redis_client,
    stack_retrying,
    start_worker_retrying,
    worker_id,
)
from tests.stack import RunningStack, wait_until

DELAY_MS = 300
DELAY_S = DELAY_MS / 1000
#: how long a killed holder may keep resources: grant lease 2 s / worker lease
#: 3 s, plus the 0.25 s sweep and slack for a loaded machine
LEASE_BOUND_S = 8.0


def write_limited(root: Path, name: str, rate_limiter: str, delay_ms: int = DELAY_MS) -> None:
    path = write_simple(root, name, max_batch_size=0)
    cfg = path / "config.pbtxt"
    text = cfg.read_text()
    start = text.index("instance_group")
    end = text.index("]", start) + 1
    group = f"instance_group [ {{ count: 1 kind: KIND_CPU rate_limiter {{ {rate_limiter} }} }} ]"
    delay = f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{delay_ms}" }} }}'
    cfg.write_text(text[:start] + group + text[end:] + delay + "\n")


def res(name: str, count: int = 1, is_global: bool = False) -> str:
    flag = " global: true" if is_global else ""
    return f'resources [ {{ name: "{name}" count: {count}{flag} }} ]'


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rate_limited")
    write_limited(root, "ga", res("G", is_global=True))
    write_limited(root, "gb", res("G", is_global=True))
    write_limited(root, "pd", res("R"))  # per device: one per worker at a time
    write_limited(root, "gl", res("G2", is_global=True))
    write_limited(root, "sa", res("S", is_global=True))  # S:2 on the command line
    write_limited(root, "sb", res("S", is_global=True))
    write_limited(root, "p1", res("P", is_global=True) + " priority: 1", delay_ms=5)
    write_limited(root, "p4", res("P", is_global=True) + " priority: 4", delay_ms=5)
    write_limited(root, "kw", res("K", is_global=True), delay_ms=3000)
    write_limited(root, "ks", res("K2", is_global=True), delay_ms=3000)
    return root


RL_ARGS = ("--rate-limit", "execution_count", "--rate-limit-resource", "S:2")


@pytest.fixture(scope="module")
def limited(repo: Path) -> Iterator[RunningStack]:
    """execution_count, two workers (two devices)."""
    with stack_retrying(repo, workers=2, ratelimiter_args=RL_ARGS) as running:
        yield running


def run_together(url: str, models: list[str]) -> tuple[float, list[tuple[str, float]]]:
    """One request per entry, all sent at once; (wall time, (model, finish time))."""
    barrier = threading.Barrier(len(models))
    finished: list[tuple[str, float]] = []
    errors: list[BaseException] = []

    def one(model: str) -> None:
        c = client(url)
        try:
            c.is_server_live()  # the connection is up before the clock starts
            barrier.wait()
            infer_simple(c, model=model)
            finished.append((model, time.monotonic()))
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    # warm each model once so loading costs are out of the timings
    c = client(url)
    for m in set(models):
        infer_simple(c, model=m)
    c.close()
    threads = [threading.Thread(target=one, args=(m,)) for m in models]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return max(t for _, t in finished) - start, sorted(finished, key=lambda x: x[1])


def gaps(finished: list[tuple[str, float]]) -> list[float]:
    times = [t for _, t in finished]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


#: Executions of DELAY_S that exclude each other finish at least DELAY_S
#: apart; two that finish closer than this ran at the same time. (Wall times
#: are only asserted as lower bounds: a loaded machine stretches them.)
TOGETHER_S = 0.3 * DELAY_S


def held(url: str, field: str) -> int:
    r = redis_client(url)
    try:
        return int(r.hget("ss:rl:res:held", field) or 0)
    finally:
        r.close()


@contextlib.contextmanager
def held_peak(url: str, field: str) -> Iterator[list[int]]:
    """The most of resource `field` held at once while the block runs, read
    from the rate limiter's own count in Redis every millisecond or so (the
    list's one item, set on exit). Executions that overlap hold the count for
    their whole DELAY_S, so the sampler sees it; a loaded machine only makes
    it sample less often, never see more than was held (client-side finish
    times are no such measure: a late response bunches with the next)."""
    peak = [0]
    done = threading.Event()
    r = redis_client(url)

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], int(r.hget("ss:rl:res:held", field) or 0))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        r.close()


# ------------------------------------------------------------------- resources


def test_two_models_sharing_a_count_1_resource_never_execute_at_once(limited):
    # ga and gb each have an instance on both workers; G is global, count 1
    with held_peak(limited.redis_url, "G@global") as peak:
        wall, finished = run_together(limited.url, ["ga", "gb", "ga", "gb"])
    assert wall >= 4 * DELAY_S * 0.95, (wall, finished)
    assert peak == [1], peak  # held, and never twice


def test_a_larger_count_lets_them_overlap(limited):
    # S is raised to 2 by --rate-limit-resource S:2
    _, finished = run_together(limited.url, ["sa", "sb", "sa", "sb"])
    assert min(gaps(finished)) < TOGETHER_S, finished  # 2 at a time


def test_per_device_resource_runs_once_per_device_global_once_overall(limited):
    _, finished_pd = run_together(limited.url, ["pd", "pd"])
    with held_peak(limited.redis_url, "G2@global") as peak:
        wall_gl, _ = run_together(limited.url, ["gl", "gl"])
    assert min(gaps(finished_pd)) < TOGETHER_S, finished_pd  # one per worker, at once
    assert wall_gl >= 2 * DELAY_S * 0.95, wall_gl
    assert peak == [1], peak


def test_counts_and_available_in_redis(limited):
    r = redis_client(limited.redis_url)
    try:
        caps = {k.decode(): int(v) for k, v in r.hgetall("ss:rl:res:cap").items()}
    finally:
        r.close()
    assert caps["G@global"] == 1 and caps["S@global"] == 2
    per_device = {k for k in caps if k.startswith("R@")}
    assert len(per_device) == 2 and all(caps[k] == 1 for k in per_device)  # one per worker


def test_priorities_1_and_4_share_picks_as_triton(limited):
    """Priority 4 gets a quarter of priority 1's turns at a contended resource
    (ONNX models on two workers; test_rate_limiter_triton.py compares the
    Python-backend twin with real Triton, which measured 3.98-4.01)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def load(model: str) -> None:
        c = client(limited.url)
        try:
            while not stop.is_set():
                infer_simple(c, model=model)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    c = client(limited.url)
    before = {m: model_stats(c, m).execution_count for m in ("p1", "p4")}
    threads = [threading.Thread(target=load, args=(m,)) for m in ("p1", "p4") for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    picks = Counter({m: int(model_stats(c, m).execution_count) - int(before[m]) for m in before})
    c.close()
    assert picks["p4"] > 10, picks
    ratio = picks["p1"] / picks["p4"]
    print(f"priority 1 vs 4 picks: {dict(picks)}, ratio {ratio:.2f} (Triton: 4)")
    assert 2.5 <= ratio <= 6.0, picks


# ------------------------------------------------------------- two rate limiters


def test_two_rate_limiters_share_one_set_of_counts(limited, repo):
    stack = limited.stack
    common = ["--listen", "127.0.0.1:0", "--redis-url", limited.redis_url]
    rl2 = stack.start_service("ratelimiter-2", ["ratelimiter", *common, *RL_ARGS])
    sched2 = stack.start_service(
        "scheduler-2", ["scheduler", *common, "--ratelimiter", rl2.address]
    )
    gw2 = stack.start_service(
        "gateway-2",
        [
            "gateway",
            *common,
            "--ratelimiter",
            rl2.address,
            "--scheduler",
            sched2.address,
            "--model-repository",
            str(repo),
            # a port of its own: the default (Triton's 8000) may be taken
            "--http-address",
            "127.0.0.1",
            "--http-port",
            "0",
        ],
    )
    # ga through the first path, gb through the second: G (count 1) still
    # admits one execution at a time
    finished: list[tuple[str, float]] = []
    barrier = threading.Barrier(4)

    def one(url: str, model: str) -> None:
        c = client(url)
        infer_simple(c, model=model)
        barrier.wait()
        infer_simple(c, model=model)
        finished.append((model, time.monotonic()))
        c.close()

    threads = [
        threading.Thread(target=one, args=(url, m))
        for url, m in [(limited.url, "ga"), (gw2.address, "gb")] * 2
    ]
    with held_peak(limited.redis_url, "G@global") as peak:
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(finished) == 4
    finished.sort(key=lambda x: x[1])
    assert finished[-1][1] - start >= 4 * DELAY_S * 0.95, finished
    assert peak == [1], peak
    # Each rate limiter follows its own release channel (a release by one
    # wakes the other's waiting Acquire through Redis, not by its poll).
    r = redis_client(limited.redis_url)
    try:
        assert len(r.pubsub_channels("ss:rl:freed:*")) == 2
        for child in (gw2, sched2, rl2):
            child.proc.terminate()
            child.proc.wait(10)
        assert wait_until(lambda: len(r.pubsub_channels("ss:rl:freed:*")) == 1, timeout_s=5)
    finally:
        r.close()


# ------------------------------------------------------------- joining worker


def test_a_joining_worker_adds_its_devices_counts(limited):
    def per_device() -> set[str]:
        r = redis_client(limited.redis_url)
        try:
            return {k.decode() for k in r.hkeys("ss:rl:res:cap") if k.startswith(b"R@")}
        finally:
            r.close()

    assert len(per_device()) == 2
    start_worker_retrying(limited, "worker-joined")
    assert wait_until(lambda: len(per_device()) == 3, 60)
    _, finished = run_together(limited.url, ["pd", "pd", "pd"])
    # three devices, three at once, no restart
    assert finished[-1][1] - finished[0][1] < 2 * TOGETHER_S, finished


# ----------------------------------------------------------- killed holders


def _hold(url: str, model: str) -> threading.Thread:
    """Send one long request in the background (its answer does not matter)."""

    def send() -> None:
        c = client(url)
        try:
            infer_simple(c, model=model)
        except Exception:
            pass  # the holder is killed under it
        finally:
            c.close()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_killed_worker_gives_its_resources_back(limited):
    assert wait_until(lambda: held(limited.redis_url, "K@global") == 0, 10)
    _hold(limited.url, "kw")
    assert wait_until(lambda: held(limited.redis_url, "K@global") == 1, 10)
    r = redis_client(limited.redis_url)
    try:
        gid = r.zrange("ss:rl:grants", 0, -1)
        holders = {r.hget(f"ss:rl:grant:{g.decode()}", "instance") for g in gid}
        holder = next(h.decode() for h in holders if h and b"/kw/" in h)
    finally:
        r.close()
    victim = next(w for w in limited.workers if holder.startswith(worker_id(w.proc.pid) + "/"))
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: held(limited.redis_url, "K@global") == 0, LEASE_BOUND_S)
    print(f"K back {time.monotonic() - killed:.2f} s after the worker was killed")


def test_killed_scheduler_gives_its_resources_back(limited):
    _hold(limited.url, "ks")
    assert wait_until(lambda: held(limited.redis_url, "K2@global") == 1, 10)
    os.kill(limited.scheduler.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    # the grant's lease (2 s, no longer renewed) runs out; the sweep gives K2 back
    assert wait_until(lambda: held(limited.redis_url, "K2@global") == 0, LEASE_BOUND_S)
    elapsed = time.monotonic() - killed
    print(f"K2 back {elapsed:.2f} s after the scheduler was killed")
    assert elapsed < LEASE_BOUND_S


# ------------------------------------------------------------------------- off


def test_off_is_one_payload_per_instance_resources_ignored(tmp_path):
    write_limited(tmp_path, "ga", res("G", is_global=True))
    write_limited(tmp_path, "gb", res("G", is_global=True))
    with stack_retrying(tmp_path) as running:
        _, finished = run_together(running.url, ["ga", "gb", "ga", "gb"])
        # one instance per model: ga and gb run side by side, two each
        assert min(gaps(finished)) < TOGETHER_S, finished
