"""The event loop a stage runs on: uvloop's or asyncio's (StackSettings.event_loop).

Every stage's sockets are asyncio protocols (stageserve/h2grpc/, the HTTP
front, redis-py), so the loop's own socket and callback handling is a share
of each request's CPU; uvloop does that part in C. docs/benchmarks.md ("The
stages on uvloop") has the interleaved figures that chose it.

Timers differ: uvloop counts them in whole milliseconds, so a wait under
0.5 ms comes due at the next loop turn and one of 0.5-1.5 ms after 1 ms.
asyncio's loop also sleeps in whole milliseconds (epoll's timeout), rounded
up. The waits that can be that short (a batch's hold, a write's hold) look
at the clock again when they wake, so either loop keeps their meaning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
UVLOOP, ASYNCIO = "uvloop", "asyncio"


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of `choice`'s loop; None: asyncio's default. uvloop asked
    for and not installed: asyncio's, with a warning (a stage still serves)."""
    if choice == ASYNCIO:
        return None
    if choice != UVLOOP:
        raise ValueError(f"event loop {choice!r}: expected {UVLOOP} or {ASYNCIO}")
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: this stage runs on asyncio's event loop")
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """asyncio.run(main) on `choice`'s loop."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
