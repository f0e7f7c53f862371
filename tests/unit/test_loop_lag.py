"""stageserve/loop_lag.py: the probe observes how late a busy loop woke it."""

from __future__ import annotations

import asyncio
import time

from stageserve import loop_lag


def test_a_blocked_loop_shows_as_lag_the_length_of_the_block() -> None:
    seen: list[float] = []

    async def main() -> None:
        task = asyncio.create_task(loop_lag.probe(seen.append, period_s=0.01))
        await asyncio.sleep(0.05)  # the probe runs on a free loop meanwhile
        before = len(seen)
        time.sleep(0.2)  # a callback that holds the loop
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert before >= 1  # it observed on its own before the block
        assert max(seen[before:]) >= 0.15  # woke ~0.19 s late after the block

    asyncio.run(main())


def test_lag_is_never_negative() -> None:
    seen: list[float] = []

    async def main() -> None:
        task = asyncio.create_task(loop_lag.probe(seen.append, period_s=0.001))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert seen and min(seen) >= 0.0
