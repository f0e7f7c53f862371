"""The registry's acquire as a grant or None, for tests that only ask
whether one was granted (RedisRegistry.attempt also says how to wait)."""

from __future__ import annotations

from services.ratelimiter.registry import Grant, RedisRegistry


async def try_acquire(reg: RedisRegistry, model: str, version: int, lease_ms: int) -> Grant | None:
    got = await reg.attempt(model, version, lease_ms)
    return got if isinstance(got, Grant) else None
