"""The gateway's hot-path table (services/gateway/model_table.py): what a
request resolves to, and the in-flight counts the lifecycle waits on."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway.model_table import READY, UNAVAILABLE, ModelEntry, ModelTable
from stageserve.errors import StageError


def _table() -> ModelTable:
    table = ModelTable()
    table.entries["m"] = ModelEntry("m", versions={1: READY, 2: READY, 3: UNAVAILABLE})
    return table


def test_resolve_picks_the_latest_ready_version_or_the_one_asked() -> None:
    table = _table()
    assert table.resolve("m", "")[1] == 2
    assert table.resolve("m", "1")[1] == 1
    with pytest.raises(StageError) as err:
        table.resolve("m", "3")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(StageError) as err:
        table.resolve("other", "")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_an_unload_waits_for_every_request_to_the_model() -> None:
    async def main() -> None:
        table = _table()
        entry = table.entries["m"]
        table.begin(entry, 1)
        table.begin(entry, 2)
        waiting = asyncio.create_task(table.wait_idle("m"))
        await asyncio.sleep(0.01)
        table.end(entry, 1)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # version 2's request is still running
        table.end(entry, 2)
        await asyncio.wait_for(waiting, 1)
        assert table.in_flight("m") == 0

    asyncio.run(main())


def test_a_drain_waits_for_its_versions_only_and_gives_up_at_its_timeout() -> None:
    async def main() -> None:
        table = _table()
        entry = table.entries["m"]
        table.begin(entry, 1)
        table.begin(entry, 2)
        draining = asyncio.create_task(table.wait_versions_idle("m", (1,), 5.0))
        await asyncio.sleep(0.01)
        table.end(entry, 1)  # version 2 keeps running: not drained, not waited for
        assert await asyncio.wait_for(draining, 1) == 0
        assert await table.wait_versions_idle("m", (2,), 0.05) == 1  # timed out, 1 left

    asyncio.run(main())
