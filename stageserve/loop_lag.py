"""How late a stage's event loop runs what is due (beyond Triton: no such metric).

Every stage does its own work on one asyncio event loop, so a loop that is
busy makes everything behind it wait: a request's bytes sit in the socket, a
batch's result waits to hand out the next batch. CPU per inference does not
show that wait; this does. A probe task sleeps PERIOD_S and observes how much
later than asked it woke, into stageserve_event_loop_lag_seconds on the
stage's own metrics port. An idle loop wakes within about a millisecond (the
selector's timeout is in milliseconds); a lag that grows toward the length of
the loop's longest callbacks, or beyond, says the loop is what binds.

The probe costs one wake-up per period (20 a second: a few microseconds of
CPU each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

PERIOD_S = 0.05


async def probe(observe: Callable[[float], None], period_s: float = PERIOD_S) -> None:
    """Observe the loop's lag every `period_s`, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        observe(max(0.0, loop.time() - due))
