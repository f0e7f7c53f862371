"""A loop's "something changed, look again" signal, with a timeout.

The dispatch loop and the expiry loop of every model queue wait this way
once per batch (and once per request at low load). Not
`asyncio.wait_for(event.wait(), timeout)`: on Python 3.11 that wraps the
wait in a Task, a timer and callbacks, 12.0 us per wait-and-wake cycle (a
call_soon'd set, 50,000 cycles in one loop) on the 2-core dev machine,
against 6.9 us for this one future and one timer handle.

Semantics: only a set() while someone waits wakes it (each wait starts
clear); a timeout simply returns.
"""

from __future__ import annotations

import asyncio


class Wakeup:
    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Wake the waiter, if one waits now."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Until set() or `timeout_s` (None: no timeout); one waiter at a time."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
