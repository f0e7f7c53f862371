"""What the rate limiter tells its callers when a call fails.

Without this, a Redis exception escaping a handler reached the scheduler as
UNKNOWN carrying Python's text ("Unexpected <class 'redis.exceptions.
ConnectionError'>: Error 111 connecting to 127.0.0.1:6379. Connection
refused."). Now Redis being unreachable is UNAVAILABLE with a short message
(callers may retry; a worker's heartbeat registers again once Redis is
back), a StageError keeps its code, and anything else is INTERNAL; the
detail goes to the log, never to the caller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stageserve.errors import StageError, stage_fault, unavailable

log = logging.getLogger(__name__)

REDIS_UNAVAILABLE = "its Redis is unavailable; retry later"

R = TypeVar("R")
Handler = Callable[..., Awaitable[R]]


def stage_error(exc: BaseException, rpc: str) -> StageError:
    """The typed error a caller gets for `exc`; logs the detail."""
    if isinstance(exc, StageError):
        return exc
    detail = f"{type(exc).__name__}: {exc}"[:500]
    # BusyLoadingError (Redis starting) is a ConnectionError too
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        log.warning("redis unavailable", extra={"rpc": rpc, "error": detail})
        return unavailable(REDIS_UNAVAILABLE)
    log.error(
        "unexpected error in a rate-limiter call",
        exc_info=(type(exc), exc, exc.__traceback__),
        extra={"rpc": rpc, "error": detail},
    )
    return stage_fault(f"internal error in the rate limiter's {rpc}; its log has the detail")


def typed_errors(handler: Handler) -> Handler:
    """A unary handler's failure ends the call with stage_error's code and message."""
    rpc = handler.__name__

    @functools.wraps(handler)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            err = stage_error(exc, rpc)
            await context.abort(err.code, err.message)

    return wrapped
