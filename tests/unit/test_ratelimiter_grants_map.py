"""RateLimiterService's grant map (grant id -> which waiters its release
wakes) forgets a grant once its lease ended: a grant whose release never
comes to this process (swept, lost on a broken stream, released through
another rate limiter) does not stay for the process's life.

No Redis: a stand-in registry answers the few calls the service makes."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
from redis.exceptions import ConnectionError

from services.ratelimiter.registry import Grant, Instance, RedisRegistry
from services.ratelimiter.service import RateLimiterService
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import RateLimiterSettings


class StandInRegistry:
    """Every attempt is granted ("g1", "g2", ...); renew reports `lost` lost;
    sweep answers nothing swept, or fails as with Redis away."""

    def __init__(self, lost: tuple[str, ...] = (), redis_away: bool = False) -> None:
        self.lost = lost
        self.redis_away = redis_away
        self.granted = 0

    async def attempt(self, model: str, version: int, lease_ms: int, *_: object) -> Grant:
        self.granted += 1
        return grant(f"g{self.granted}", model)

    async def renew(self, grant_ids: list[str], lease_ms: int) -> list[str]:
        return [g for g in grant_ids if g in self.lost]

    async def release(self, grant_id: str, failed: bool = False) -> None:
        pass

    async def sweep(self) -> tuple[int, int]:
        if self.redis_away:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return 0, 0


def service(registry: StandInRegistry, settings: RateLimiterSettings | None = None):
    return RateLimiterService(cast(RedisRegistry, registry), settings or RateLimiterSettings())


def grant(gid: str, model: str = "m", holds_resources: bool = False) -> Grant:
    inst = Instance("i1", model, 1, "KIND_CPU", -1, "w1", "addr-w1")
    return Grant(gid, inst, holds_resources)


def test_an_entry_is_dropped_once_its_lease_ended_and_a_live_one_kept():
    rl = service(StandInRegistry())
    rl._granted(grant("short"), 1000)
    rl._granted(grant("long"), 60_000)
    now = time.monotonic()
    assert rl.forget_expired(now) == 0
    assert rl.forget_expired(now + 30) == 1
    assert set(rl._grants) == {"long"}
    assert rl._grants["long"][:3] == ("m", 1, False)
    assert rl.forget_expired(now + 61) == 1
    assert rl._grants == {}


def test_a_renewed_grant_is_kept_past_its_first_lease_a_lost_one_is_not():
    settings = RateLimiterSettings(default_renew_lease_ms=90_000)
    rl = service(StandInRegistry(lost=("lost",)), settings)
    for gid in ("renewed", "by_default", "lost", "not_renewed"):
        rl._granted(grant(gid, holds_resources=gid == "renewed"), 1000)

    async def renew(grant_ids: list[str], lease_ms: int) -> pb.RenewResponse:
        return await rl.Renew(pb.RenewRequest(grant_ids=grant_ids, lease_ms=lease_ms), None)

    resp = asyncio.run(renew(["renewed", "lost", "unknown"], 120_000))
    assert list(resp.lost_grant_ids) == ["lost"]
    asyncio.run(renew(["by_default"], 0))  # the settings' renewal lease
    now = time.monotonic()
    assert rl.forget_expired(now + 30) == 2
    assert set(rl._grants) == {"renewed", "by_default"}  # "unknown" is not added
    assert rl._grants["renewed"][:3] == ("m", 1, True)
    assert rl.forget_expired(now + 100) == 1
    assert set(rl._grants) == {"renewed"}
    assert rl.forget_expired(now + 121) == 1
    assert rl._grants == {}


@pytest.mark.parametrize("redis_away", [False, True])
def test_the_sweep_loop_forgets_ended_leases(redis_away):
    """Acquired with a 1 ms lease and with none (the settings' 60 s)."""
    rl = service(StandInRegistry(redis_away=redis_away), RateLimiterSettings(sweep_s=0.01))

    async def main() -> None:
        for lease_ms in (1, 0):
            resp = await rl.acquire(pb.AcquireRequest(model="m", version=1, lease_ms=lease_ms))
            assert resp.granted
        assert set(rl._grants) == {"g1", "g2"}
        sweeping = asyncio.create_task(rl.sweep_forever())
        try:
            deadline = time.monotonic() + 1.0
            while "g1" in rl._grants and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            sweeping.cancel()
            await asyncio.gather(sweeping, return_exceptions=True)

    asyncio.run(main())
    assert set(rl._grants) == {"g2"}


def test_the_release_of_a_forgotten_grant_wakes_every_waiter():
    """Dropping an entry early is harmless: its release wakes all instead of
    its model's waiters only."""
    rl = service(StandInRegistry())
    rl._granted(grant("known", "a"), 60_000)
    rl._granted(grant("forgotten", "a"), 1)
    rl.forget_expired(time.monotonic() + 1)
    assert set(rl._grants) == {"known"}

    async def main() -> None:
        a, b = rl.wakeups.event("a", 1), rl.wakeups.event("b", 1)
        await rl.release(pb.ReleaseRequest(grant_id="known"))
        assert a.is_set() and not b.is_set()
        a, b = rl.wakeups.event("a", 1), rl.wakeups.event("b", 1)
        await rl.release(pb.ReleaseRequest(grant_id="forgotten"))
        assert a.is_set() and b.is_set()

    asyncio.run(main())
    assert rl._grants == {}
