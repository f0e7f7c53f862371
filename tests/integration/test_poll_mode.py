"""Triton's --model-control-mode=poll through tritonclient: models added,
changed and removed on disk are loaded, reloaded and unloaded without a
restart; a request in flight during a reload finishes on the old version.
With two gateways polling one repository, each change is applied once
stack-wide (one generation published, one set of instances) and nothing is
published again afterwards (no flapping)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
from tritonclient.utils import InferenceServerException

from services.gateway.poller import diff, snapshot
from stageserve import redis_keys as keys
from stageserve_tools.examples import write_simple
from tests.integration.helpers import (
    client,
    granted_instances,
    infer_simple,
    registered_instances,
    stack_retrying,
    two_paths,
)
from tests.stack import RunningStack, wait_until

POLL_S = 0.5
#: a change must be served within this long (a poll, a load, slack)
BOUND_S = 30.0


def _delay(path: Path, ms: int) -> None:
    with (path / "config.pbtxt").open("a") as cfg:
        cfg.write(f'parameters {{ key: "execute_delay_ms" value {{ string_value: "{ms}" }} }}\n')


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("polled_repository")
    write_simple(root, "steady")
    _delay(write_simple(root, "versioned", max_batch_size=0), 1500)
    write_simple(root, "doomed")
    with stack_retrying(root, control_mode="poll", repository_poll_secs=POLL_S) as running:
        yield running


def _ready_at(url: str, model: str, version: str = "") -> bool:
    c = client(url)
    try:
        return c.is_model_ready(model, version)
    except InferenceServerException:
        return False
    finally:
        c.close()


def _ready(running: RunningStack, model: str, version: str = "") -> bool:
    return _ready_at(running.url, model, version)


def test_snapshot_and_diff(tmp_path: Path):
    write_simple(tmp_path, "a")
    write_simple(tmp_path, "b")
    before = snapshot(tmp_path)
    assert not diff(before, snapshot(tmp_path))
    write_simple(tmp_path, "c")
    (tmp_path / "a" / "config.pbtxt").write_text(
        (tmp_path / "a" / "config.pbtxt").read_text() + "\n"
    )
    shutil.rmtree(tmp_path / "b")
    changes = diff(before, snapshot(tmp_path))
    assert (changes.added, changes.changed, changes.removed) == (("c",), ("a",), ("b",))


def test_added_model_is_loaded(polled, tmp_path):
    assert not _ready(polled, "newcomer")
    # built beside the repository, renamed into place: one atomic change
    write_simple(tmp_path, "newcomer").rename(polled.repository / "newcomer")
    assert wait_until(lambda: _ready(polled, "newcomer"), BOUND_S)
    c = client(polled.url)
    infer_simple(c, model="newcomer")
    infer_simple(c, model="steady")  # the others kept serving
    c.close()


def test_changed_model_reloads_and_in_flight_request_finishes_on_old_version(polled, tmp_path):
    model_dir = polled.repository / "versioned"
    result: dict = {}

    def in_flight() -> None:
        c = client(polled.url)
        try:
            result["answer"] = infer_simple(c, model="versioned")
        except Exception as exc:
            result["error"] = exc
        finally:
            c.close()

    t = threading.Thread(target=in_flight)
    t.start()
    # it is executing (1.5 s from its grant) when version 2 appears
    assert wait_until(lambda: _granted(polled, "versioned", 1) == 1, BOUND_S)
    staged = tmp_path / "2"
    shutil.copytree(model_dir / "1", staged)
    staged.rename(model_dir / "2")  # Triton's default policy serves the latest: 2
    t.join()
    assert "error" not in result, result
    assert result["answer"].get_response().model_version == "1"
    assert wait_until(lambda: _ready(polled, "versioned", "2"), BOUND_S)
    c = client(polled.url)
    assert infer_simple(c, model="versioned").get_response().model_version == "2"
    # a config change alone reloads too
    cfg = model_dir / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('string_value: "1500"', 'string_value: "0"'))

    def delay_gone() -> bool:
        params = c.get_model_config("versioned").config.parameters
        return params["execute_delay_ms"].string_value == "0"

    assert wait_until(delay_gone, BOUND_S)
    # the new config runs: the server's compute time, not the client's wall
    # clock (which a loaded machine stretches), is under the old 1.5 s delay
    before = _compute_ns(c, "versioned", "2")
    infer_simple(c, model="versioned")
    count, ns = (a - b for a, b in zip(_compute_ns(c, "versioned", "2"), before, strict=True))
    assert count == 1 and ns < 1.5e9, (count, ns)
    c.close()


def _compute_ns(c, model: str, version: str) -> tuple[int, int]:
    """(executions, their compute_infer time in ns) from Triton's statistics."""
    (st,) = c.get_inference_statistics(model, version, as_json=False).model_stats
    return st.inference_stats.compute_infer.count, st.inference_stats.compute_infer.ns


def _granted(running: RunningStack, model: str, version: int) -> int:
    """Grants held on `model`'s `version` instances: each has a request to run."""
    return sum(f"/{model}/{version}/" in i for i in granted_instances(running.redis_url))


def test_removed_model_is_unloaded(polled):
    assert _ready(polled, "doomed")
    shutil.rmtree(polled.repository / "doomed")
    assert wait_until(lambda: not _ready(polled, "doomed"), BOUND_S)
    c = client(polled.url)
    with pytest.raises(InferenceServerException, match="unknown model"):
        infer_simple(c, model="doomed")
    names = {m.name for m in c.get_model_repository_index().models}
    assert "doomed" not in names and "steady" in names
    infer_simple(c, model="steady")
    c.close()


# ------------------------------------------------------- several gateways


@pytest.fixture(scope="module")
def two_polling(tmp_path_factory: pytest.TempPathFactory):
    """Two gateways (each with its scheduler) polling the same repository."""
    root = tmp_path_factory.mktemp("polled_by_two")
    write_simple(root, "steady")
    # Two instances: each gateway's in-flight request executes, none waits in a
    # queue (a queued one fails when the old version goes; see docs/deployment.md).
    _delay(write_simple(root, "versioned", max_batch_size=0, instance_count=2), 1500)
    write_simple(root, "doomed")
    poll = ("--model-control-mode", "poll", "--repository-poll-secs", str(POLL_S))
    with two_paths(root, poll, control_mode="poll", repository_poll_secs=POLL_S) as (
        running,
        _,
        client_b,
    ):
        client_b.close()
        yield running, running.child("gateway-2").address


def _counter(running: RunningStack) -> int:
    r = redis.Redis.from_url(running.redis_url)
    try:
        return int(r.get(keys.GENERATION_COUNTER) or 0)
    finally:
        r.close()


def _record_generation(running: RunningStack, model: str) -> int | None:
    r = redis.Redis.from_url(running.redis_url)
    try:
        value = r.hget(keys.model(model), "generation")
        return None if value is None else int(value)
    finally:
        r.close()


def _published_after(running: RunningStack, model: str, before: int) -> tuple[int, int]:
    """The model's published generation, newer than counter value `before`,
    and the counter now. The counter may have moved by more than one: a
    gateway whose publish lost the race to another's (WatchError) took a
    number and then adopted the other's record (model_state.publish_loaded);
    that the load happened once is what the registered instances show."""
    after = _counter(running)
    generation = _record_generation(running, model)
    assert generation is not None and before < generation <= after, (before, generation, after)
    return generation, after


def _generations_registered(running: RunningStack, model: str, version: int) -> set[str]:
    """The generation tags (instance ids .../<version>/g<gen>/...) in the registry."""
    return {i.split("/")[-3] for i in registered_instances(running.redis_url, model, version)}


def _both(running: RunningStack, url_b: str, check) -> bool:
    return check(running.url) and check(url_b)


def _settled(running: RunningStack, model: str, counter: int, generation: int | None) -> None:
    """No flapping: several polls later nothing was published again."""
    time.sleep(4 * POLL_S)
    assert _counter(running) == counter
    assert _record_generation(running, model) == generation


def test_two_gateways_load_an_added_model_once(two_polling, tmp_path):
    running, url_b = two_polling
    before = _counter(running)
    write_simple(tmp_path, "newcomer").rename(running.repository / "newcomer")
    assert wait_until(lambda: _both(running, url_b, lambda u: _ready_at(u, "newcomer")), BOUND_S)
    # One load stack-wide: one generation published, one set of instances.
    generation, after = _published_after(running, "newcomer", before)
    assert _generations_registered(running, "newcomer", 1) == {f"g{generation}"}
    for url in (running.url, url_b):
        with client(url) as c:
            infer_simple(c, model="newcomer")
    _settled(running, "newcomer", after, generation)


def test_two_gateways_reload_a_changed_model_once_in_flight_finishes_on_old(two_polling, tmp_path):
    running, url_b = two_polling
    model_dir = running.repository / "versioned"
    before = _counter(running)
    results: dict[str, object] = {}

    def in_flight(url: str) -> None:
        c = client(url)
        try:
            results[url] = infer_simple(c, model="versioned").get_response().model_version
        except Exception as exc:
            if hasattr(exc, "status"):  # an InferenceServerException
                err = cast(InferenceServerException, exc)
                results[url] = f"{err.status()}: {err.message()}"
            else:
                results[url] = exc
        finally:
            c.close()

    threads = [threading.Thread(target=in_flight, args=(u,)) for u in (running.url, url_b)]
    for t in threads:
        t.start()
    # both executing (1.5 s from their grants) when version 2 appears
    assert wait_until(lambda: _granted(running, "versioned", 1) == 2, BOUND_S)
    staged = tmp_path / "2"
    shutil.copytree(model_dir / "1", staged)
    staged.rename(model_dir / "2")
    seen: set[str] = set()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and not _both(
        running, url_b, lambda u: _ready_at(u, "versioned", "2")
    ):
        seen |= _generations_registered(running, "versioned", 2)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results == {running.url: "1", url_b: "1"}, results
    assert _both(running, url_b, lambda u: _ready_at(u, "versioned", "2"))
    # One reload stack-wide: one new generation, version 2 loaded once.
    generation, after = _published_after(running, "versioned", before)
    seen |= _generations_registered(running, "versioned", 2)
    assert seen == {f"g{generation}"}
    for url in (running.url, url_b):
        with client(url) as c:
            assert infer_simple(c, model="versioned").get_response().model_version == "2"
    _settled(running, "versioned", after, generation)


def test_two_gateways_unload_a_removed_model(two_polling):
    running, url_b = two_polling
    assert _both(running, url_b, lambda u: _ready_at(u, "doomed"))
    before = _counter(running)
    shutil.rmtree(running.repository / "doomed")
    assert wait_until(lambda: _both(running, url_b, lambda u: not _ready_at(u, "doomed")), BOUND_S)
    assert wait_until(lambda: not registered_instances(running.redis_url, "doomed"), BOUND_S)
    assert _record_generation(running, "doomed") is None
    _settled(running, "doomed", before, None)  # never republished
    assert not registered_instances(running.redis_url, "doomed")
    for url in (running.url, url_b):
        with client(url) as c:
            with pytest.raises(InferenceServerException, match="unknown model"):
                infer_simple(c, model="doomed")
            infer_simple(c, model="steady")
