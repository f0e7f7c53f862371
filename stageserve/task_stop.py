"""Stop a background task and wait until it has ended, for certain.

`task.cancel(); await task` can wait forever on Python 3.11: its
asyncio.wait_for returns the inner result and drops the caller's cancel when
the inner call finishes in the same loop turn as the cancel lands (CPython
gh-86296; 3.12 rebuilt wait_for on asyncio.timeout). redis-py sends every
command through wait_for once socket_timeout is set, and from redis-py 8 it is
set by default (5 s). A loop that was sending a command when it was cancelled
then carries on as if it never was, and whoever awaits it waits for good
(a test closing a ShardView sat until pytest's 300 s timeout). Measured on the
2-core VM: of shard-map followers polling Redis every 5 ms and cancelled at
random moments, 20 % kept running (tests/unit/test_task_stop.py makes the
same race).
"""

from __future__ import annotations

import asyncio
from typing import Any

# How long one cancel is given before the next is sent. A cancel that is not
# dropped ends a Redis-polling loop within a loop turn or two.
RECANCEL_S = 0.1


async def stop(task: asyncio.Future[Any], recancel_s: float = RECANCEL_S) -> BaseException | None:
    """Cancel `task` until it is done; its exception (None if it was
    cancelled or returned). If the caller is cancelled meanwhile, `task` is
    cancelled once more and the caller's cancel goes on."""
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=recancel_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
    return None if task.cancelled() else task.exception()
