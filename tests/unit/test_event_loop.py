"""stageserve/event_loop.py: a stage's coroutine runs on the loop StackSettings.event_loop names."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from stageserve import event_loop
from stageserve.settings import settings_from_env


async def _loop_and(value: int) -> tuple[asyncio.AbstractEventLoop, int]:
    await asyncio.sleep(0)
    return asyncio.get_running_loop(), value


def test_uvloop_runs_the_coroutine_on_uvloop_s_loop() -> None:
    loop, value = event_loop.run(_loop_and(7), "uvloop")
    assert isinstance(loop, uvloop.Loop)
    assert value == 7
    assert loop.is_closed()  # run() closes it, as asyncio.run does


def test_asyncio_runs_it_on_asyncio_s_own_loop() -> None:
    loop, value = event_loop.run(_loop_and(3), "asyncio")
    assert not isinstance(loop, uvloop.Loop)
    assert isinstance(loop, asyncio.BaseEventLoop)
    assert value == 3


def test_an_exception_in_the_coroutine_reaches_the_caller() -> None:
    async def fails() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        event_loop.run(fails(), "uvloop")


def test_without_uvloop_installed_a_stage_warns_and_runs_on_asyncio(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    with caplog.at_level(logging.WARNING, logger="stageserve.event_loop"):
        loop, _ = event_loop.run(_loop_and(1), "uvloop")
    assert not isinstance(loop, uvloop.Loop)
    assert any("uvloop is not installed" in r.getMessage() for r in caplog.records)


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="expected uvloop or asyncio"):
        event_loop.loop_factory("trio")


def test_the_setting_defaults_to_uvloop_and_takes_asyncio_from_the_environment() -> None:
    assert settings_from_env({}).stack.event_loop == "uvloop"
    env = {"STAGESERVE_STACK_EVENT_LOOP": "asyncio"}
    assert settings_from_env(env).stack.event_loop == "asyncio"
    with pytest.raises(ValueError, match="STAGESERVE_STACK_EVENT_LOOP='trio'"):
        settings_from_env({"STAGESERVE_STACK_EVENT_LOOP": "trio"})
