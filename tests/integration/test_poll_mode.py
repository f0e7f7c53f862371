"""Triton's --model-control-mode=poll through tritonclient: models added,
changed and removed on disk are loaded, reloaded and unloaded without a
restart; a request in flight during a reload finishes on the old version."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from services.gateway.poller import diff, snapshot
from stageserve.examples import write_simple
from tests.integration.helpers import client, infer_simple, stack_retrying
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


def _ready(running: RunningStack, model: str, version: str = "") -> bool:
    c = client(running.url)
    try:
        return c.is_model_ready(model, version)
    except InferenceServerException:
        return False
    finally:
        c.close()


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
    time.sleep(0.4)  # it is executing (1.5 s) when version 2 appears
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
    start = time.monotonic()
    infer_simple(c, model="versioned")
    assert time.monotonic() - start < 1.0  # the new config runs
    c.close()


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
