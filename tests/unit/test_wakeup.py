"""services/scheduler/wakeup.py: the model queue's wait-for-a-change signal."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.wakeup import Wakeup


def test_set_wakes_the_waiter_before_its_timeout() -> None:
    async def main() -> float:
        wakeup = Wakeup()
        asyncio.get_running_loop().call_later(0.05, wakeup.set)
        start = time.monotonic()
        await wakeup.wait(5.0)
        return time.monotonic() - start

    assert 0.04 < asyncio.run(main()) < 1.0


def test_a_timeout_just_returns() -> None:
    async def main() -> float:
        start = time.monotonic()
        await Wakeup().wait(0.05)
        return time.monotonic() - start

    assert 0.04 < asyncio.run(main()) < 1.0


def test_a_set_with_nobody_waiting_is_not_kept() -> None:
    """As the queue's loops used it: each wait starts clear."""

    async def main() -> bool:
        wakeup = Wakeup()
        wakeup.set()
        task = asyncio.create_task(wakeup.wait())
        await asyncio.sleep(0.05)
        woke_early = task.done()
        wakeup.set()
        await asyncio.wait_for(task, 1.0)
        return woke_early

    assert asyncio.run(main()) is False


def test_no_timer_is_left_behind() -> None:
    """A wait that was woken cancels its timer: the loop holds no handle."""

    async def main() -> int:
        wakeup = Wakeup()
        loop = asyncio.get_running_loop()
        for _ in range(100):
            loop.call_soon(wakeup.set)
            await wakeup.wait(60.0)
        # asyncio keeps its timers in a private heap; nothing public lists them
        scheduled = loop._scheduled  # type: ignore[attr-defined]  # noqa: SLF001
        return sum(1 for h in scheduled if not h.cancelled())

    assert asyncio.run(main()) == 0
