"""task_stop.stop ends a task that drops a cancel, as Python 3.11's
asyncio.wait_for does inside redis-py; ShardView.close, which uses it, ends
while its follower polls a real Redis, however the cancel lands."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from stageserve import task_stop
from stageserve.shard_map import ShardView


async def _drops_the_first_cancel(dropped: list[int]) -> None:
    while True:
        try:
            await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            if dropped:
                raise
            dropped.append(1)


def test_a_task_that_drops_a_cancel_is_cancelled_again_until_it_ends() -> None:
    async def main() -> None:
        dropped: list[int] = []
        task = asyncio.ensure_future(_drops_the_first_cancel(dropped))
        await asyncio.sleep(0.02)
        assert await asyncio.wait_for(task_stop.stop(task, recancel_s=0.05), 5.0) is None
        assert task.cancelled() and dropped == [1]

    asyncio.run(main())


def test_a_failed_task_hands_back_its_exception() -> None:
    async def fails() -> None:
        raise ValueError("broken")

    async def main() -> None:
        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        error = await task_stop.stop(task)
        assert isinstance(error, ValueError)

    asyncio.run(main())


def test_the_callers_cancel_goes_on_and_cancels_the_task() -> None:
    async def main() -> None:
        dropped: list[int] = []
        task = asyncio.ensure_future(_drops_the_first_cancel(dropped))
        await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(task_stop.stop(task, recancel_s=10.0))
        await asyncio.sleep(0.05)  # the first cancel was dropped; the next is 10 s away
        stopping.cancel()
        try:
            await stopping
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the caller's cancel was lost")
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5.0)
        assert task.cancelled()

    asyncio.run(main())


def test_shard_view_close_ends_however_the_cancel_lands(redis_url) -> None:
    """Followers polling every 5 ms, closed at random moments: on Python 3.11
    with redis-py 8 one close in five used to wait for good (the cancel landed
    while a command was sent through asyncio.wait_for)."""

    async def main() -> None:
        r = aioredis.from_url(redis_url)
        rng = random.Random(26)
        try:
            for _ in range(60):
                view = ShardView(r, poll_s=0.005)
                await view.refresh()
                view.start()
                await asyncio.sleep(rng.uniform(0.0, 0.03))
                await asyncio.wait_for(view.close(), 10.0)
        finally:
            await r.aclose()

    asyncio.run(main())
