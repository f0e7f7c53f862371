"""Hostile names on every public RPC that takes one: a clear answer at once, with
Triton's code, nothing read or written outside the repository, no Python text.

One explicit-mode stack for the module. Codes are the ones real Triton 2.51
answers (bench/triton_diff.py checks them against it), except load, where
StageServe answers INVALID_ARGUMENT instead of Triton's INTERNAL
(docs/triton-differences.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from stageserve.examples import write_simple
from tests.integration.helpers import infer_simple, simple_inputs, stack_retrying
from tests.stack import RunningStack

#: every answer here must come well within this (a name with '/' used to hang > 15 s)
PROMPT_S = 3.0

HOSTILE = {
    "slash": "a/b",
    "dotdot": "..",
    "parent": "../simple",
    "absolute": "/etc",
    "nul": "sim\x00ple",
    "long": "x" * 300,
    "very long": "y" * 70_000,
    "dot": ".",
    "version folder": "simple/1",
    "hidden": ".git",
    "newline": "a\nb",
}
LEAKS = ("Traceback", "Errno", "<class", 'File "', "/tmp/", "/work/")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile_repository")
    write_simple(root, "simple")
    (root / "simple" / "1" / "config.pbtxt").write_text("not a model")  # bait for 'simple/1'
    return root


@pytest.fixture(scope="module")
def hostile(repo: Path) -> Iterator[RunningStack]:
    with stack_retrying(repo, control_mode="explicit", load_models=("simple",)) as s:
        yield s


def _answer(fn, *args, **kwargs) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        value = fn(*args, client_timeout=PROMPT_S * 2, **kwargs)
        code, message = "OK", repr(value)
    except InferenceServerException as err:
        code, message = str(err.status()), err.message() or ""
    return code, message, time.monotonic() - start


def _check(answer: tuple[str, str, float], code: str) -> None:
    got, message, seconds = answer
    assert got == code, (got, message)
    assert seconds < PROMPT_S, seconds
    assert not any(leak in message for leak in LEAKS), message
    assert len(message) < 400, len(message)


@pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_names_get_triton_codes_at_once(hostile: RunningStack, name: str) -> None:
    c = hostile.client()
    _check(_answer(c.load_model, name), "StatusCode.INVALID_ARGUMENT")
    _check(_answer(c.unload_model, name), "OK")  # Triton: unloading what is not loaded is no error
    _check(_answer(c.get_model_metadata, name), "StatusCode.NOT_FOUND")
    _check(_answer(c.get_model_config, name), "StatusCode.NOT_FOUND")
    _check(_answer(c.get_inference_statistics, name), "StatusCode.INVALID_ARGUMENT")
    _check(_answer(c.is_model_ready, name), "OK")
    assert c.is_model_ready(name) is False
    _check(
        _answer(
            c.infer, name, simple_inputs(np.ones((1, 16), np.int32), np.ones((1, 16), np.int32))
        ),
        "StatusCode.NOT_FOUND",
    )


def test_hostile_versions_get_invalid_argument(hostile: RunningStack) -> None:
    c = hostile.client()
    for version in ("abc", "-1", "1/..", "../1", "9" * 40):
        for fn in (c.is_model_ready, c.get_model_metadata, c.get_inference_statistics):
            _check(_answer(fn, "simple", version), "StatusCode.INVALID_ARGUMENT")


def test_hostile_calls_leave_the_index_and_the_file_system_alone(
    hostile: RunningStack, repo: Path
) -> None:
    c = hostile.client()
    before = sorted(os.listdir(repo)), sorted(os.listdir(repo.parent))
    for name in HOSTILE.values():
        _answer(c.load_model, name)
        _answer(c.unload_model, name)
    assert {m.name for m in c.get_model_repository_index().models} == {"simple"}
    assert (sorted(os.listdir(repo)), sorted(os.listdir(repo.parent))) == before
    # and the server kept serving
    assert c.is_model_ready("simple")
    infer_simple(c)


def test_shared_memory_keys_never_reach_outside_dev_shm(hostile: RunningStack) -> None:
    c = hostile.client()
    for key in ("/../etc/passwd", "/a/b", "/..", "/" + "k" * 300, "/x\x00y"):
        code, message, seconds = _answer(c.register_system_shared_memory, "r", key, 16)
        # Triton's answer for a key it cannot open
        _check((code, message, seconds), "StatusCode.INTERNAL")
        assert message.startswith("Unable to open shared memory region"), message
    assert c.get_system_shared_memory_status(as_json=True) == {}
