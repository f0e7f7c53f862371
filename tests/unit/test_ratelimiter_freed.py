"""Release signals between rate limiter processes (registry + Lua scripts +
RateLimiterService.follow_freed_forever) against a real redis-server.

Two registries with their own origins stand for two rate limiter processes
sharing one Redis: a busy answer puts the asker in the pool's waiting set, a
release by the other one is published to the asker's channel, a release by
the asker itself is not (it wakes its own waiters directly)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from services.ratelimiter.options import EXECUTION_COUNT, OFF
from services.ratelimiter.registry import (
    Grant,
    Instance,
    RedisRegistry,
    Resource,
)
from services.ratelimiter.service import RateLimiterService
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import RateLimiterSettings

P = "test:rlfreed:"
RL = RateLimiterSettings()
LONG = 60_000


def inst(iid: str, model: str = "m", *resources: Resource, priority: int = 0) -> Instance:
    return Instance(iid, model, 1, "KIND_CPU", -1, "w1", "addr-w1", priority, resources)


def run(url: str, body, mode: str = OFF):
    """body(a, b, redis): registries of two rate limiter processes, one Redis."""

    async def main():
        r = aioredis.from_url(url)
        try:
            await r.flushdb()
            a = RedisRegistry(r, P, mode=mode, origin="A", settings=RL)
            b = RedisRegistry(r, P, mode=mode, origin="B", settings=RL)
            return await body(a, b, r)
        finally:
            await r.aclose()

    return asyncio.run(main())


async def listening(r, *channels: str):
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(*channels)
    return pubsub


async def messages(pubsub, wait_s: float = 0.2) -> list[tuple[str, str]]:
    out = []
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        m = await pubsub.get_message(timeout=left)
        if m is not None and m["type"] == "message":
            out.append((m["channel"].decode(), m["data"].decode()))
    return out


def test_a_release_tells_the_other_waiting_rate_limiter_only(redis_url):
    async def body(a, b, r):
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        pubsub = await listening(r, a.freed_channel, b.freed_channel)
        held = await a.attempt("m", 1, LONG)
        assert isinstance(held, Grant)
        assert await b.attempt("m", 1, LONG) is b.busy  # B waits on pool m:1
        assert [x.decode() for x in await r.zrange(P + "waiting:m:1", 0, -1)] == ["B"]
        assert 0 < await r.pttl(P + "waiting:m:1") <= 2000
        await a.release(held.grant_id)
        assert await messages(pubsub) == [(P + "freed:B", "m:1")]

        again = await b.attempt("m", 1, LONG)  # B's grant; now A waits
        assert isinstance(again, Grant)
        assert await a.attempt("m", 1, LONG) is a.busy
        await b.release(again.grant_id)
        # B is still in the waiting set (it waited a moment ago) but freed it
        # itself: only A hears.
        assert await messages(pubsub) == [(P + "freed:A", "m:1")]
        await pubsub.aclose()

    run(redis_url, body)


def test_no_waiter_no_message_and_a_waiter_of_another_pool_hears_nothing(redis_url):
    async def body(a, b, r):
        await a.register("w1", "addr-w1", [inst("i1"), inst("o1", "other")], LONG)
        pubsub = await listening(r, a.freed_channel, b.freed_channel)
        held = await a.attempt("m", 1, LONG)
        await a.release(held.grant_id)  # nobody waited
        other = await a.attempt("other", 1, LONG)
        assert await b.attempt("other", 1, LONG) is b.busy  # B waits on another pool
        held = await a.attempt("m", 1, LONG)
        await a.release(held.grant_id)
        assert await messages(pubsub) == []
        await a.release(other.grant_id)
        assert await messages(pubsub) == [(P + "freed:B", "other:1")]
        await pubsub.aclose()

    run(redis_url, body)


def test_freed_resources_and_a_failed_worker_tell_every_waiting_pool(redis_url):
    async def body(a, b, r):
        shared = Resource("R", 1)
        await a.register("w1", "addr-w1", [inst("x", "X", shared), inst("y", "Y", shared)], LONG)
        pubsub = await listening(r, b.freed_channel)
        held = await a.attempt("X", 1, LONG)
        assert isinstance(held, Grant) and held.holds_resources
        assert await b.attempt("Y", 1, LONG) is b.busy  # Y's instance is free, R is not
        await a.release(held.grant_id)  # R went back: any pool may run now
        assert await messages(pubsub) == [(P + "freed:B", "*")]
        held = await a.attempt("X", 1, LONG)
        assert await b.attempt("Y", 1, LONG) is b.busy
        await a.release(held.grant_id, failed=True)  # the worker is removed
        assert await messages(pubsub) == [(P + "freed:B", "*")]
        await pubsub.aclose()

    run(redis_url, body, mode=EXECUTION_COUNT)


def test_an_expired_grant_swept_by_another_rate_limiter_is_announced(redis_url):
    async def body(a, b, r):
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        pubsub = await listening(r, b.freed_channel)
        held = await a.attempt("m", 1, 50)  # a 50 ms lease that nobody renews
        assert isinstance(held, Grant)
        assert await b.attempt("m", 1, LONG) is b.busy
        await asyncio.sleep(0.1)
        assert await a.sweep() == (1, 0)
        assert await messages(pubsub) == [(P + "freed:B", "m:1")]
        await pubsub.aclose()

    run(redis_url, body)


def test_a_pool_held_back_by_priority_is_deferred_not_busy(redis_url):
    """Nothing announces the end of that wait: it looks again on the short period."""

    async def body(a, b, r):
        shared = Resource("R", 1)
        await a.register(
            "w1",
            "addr-w1",
            [inst("lo", "LO", shared, priority=1), inst("hi", "HI", shared, priority=4)],
            LONG,
        )
        for _ in range(3):  # HI ran more often: LO's scaled priority is lower
            g = await a.attempt("HI", 1, LONG)
            await a.release(g.grant_id)
        g = await a.attempt("HI", 1, LONG)
        assert await a.attempt("LO", 1, LONG) is a.busy  # R is held; LO's demand counts
        await a.release(g.grant_id)
        got = await b.attempt("HI", 1, LONG)  # R is free, but LO goes first
        assert got is b.deferred and got.recheck_s == RL.deferred_poll_s
        assert a.deferred.recheck_s < a.busy.recheck_s
        assert not await r.exists(P + "waiting:HI:1")

    run(redis_url, body, mode=EXECUTION_COUNT)


def test_a_waiting_acquire_is_granted_when_another_rate_limiter_releases(redis_url):
    """The service end to end: B's Acquire waits, A's release wakes it through
    Redis in far less than the safety poll (it would take >= 250 ms without)."""

    async def body(a, b, r):
        service_a, service_b = RateLimiterService(a, RL), RateLimiterService(b, RL)
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        follow = asyncio.create_task(service_b.follow_freed_forever())
        try:
            await asyncio.sleep(0.05)  # subscribed
            first = await service_a.acquire(
                pb.AcquireRequest(model="m", version=1, wait_ms=0, lease_ms=LONG)
            )
            assert first.granted
            waiting = asyncio.create_task(
                service_b.acquire(
                    pb.AcquireRequest(model="m", version=1, wait_ms=5000, lease_ms=LONG)
                )
            )
            await asyncio.sleep(0.1)  # B looked once and waits
            assert not waiting.done()
            released = time.monotonic()
            await service_a.release(pb.ReleaseRequest(grant_id=first.grant_id))
            second = await waiting
            woke_after = time.monotonic() - released
            assert second.granted and second.instance.instance_id == "i1"
            assert woke_after < RL.acquire_poll_s / 2, woke_after
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)

    run(redis_url, body)


def test_a_worker_registering_or_leaving_through_another_rate_limiter_is_announced(redis_url):
    async def body(a, b, r):
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        pubsub = await listening(r, a.freed_channel, b.freed_channel)
        held = await a.attempt("m", 1, LONG)
        assert await b.attempt("m", 1, LONG) is b.busy
        w2 = Instance("i2", "m", 1, "KIND_CPU", -1, "w2", "addr-w2")
        await a.register("w2", "addr-w2", [w2], LONG)  # a second instance of m
        assert await messages(pubsub) == [(P + "freed:B", "*")]
        assert isinstance(await b.attempt("m", 1, LONG), Grant)
        assert await b.attempt("m", 1, LONG) is b.busy
        await a.deregister("w1")  # B may now get NoInstances or another instance
        assert await messages(pubsub) == [(P + "freed:B", "*")]
        await a.release(held.grant_id)
        await pubsub.aclose()

    run(redis_url, body)


def test_a_rate_limiter_that_stopped_waiting_is_dropped_while_others_wait(redis_url):
    """A waiting set kept alive by one rate limiter does not keep telling
    another that asked long ago (or exited: each start is a new origin)."""

    async def body(a, b, r):
        c = RedisRegistry(r, P, origin="C", waiting_ttl_ms=100, settings=RL)
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        pubsub = await listening(r, b.freed_channel, c.freed_channel)
        held = await a.attempt("m", 1, LONG)
        assert await c.attempt("m", 1, LONG) is c.busy  # counts for 100 ms
        await asyncio.sleep(0.15)
        assert await b.attempt("m", 1, LONG) is b.busy  # counts for 2 s
        await a.release(held.grant_id)
        assert await messages(pubsub) == [(P + "freed:B", "m:1")]
        assert [x.decode() for x in await r.zrange(P + "waiting:m:1", 0, -1)] == ["B"]
        await pubsub.aclose()

    run(redis_url, body)


def test_a_refused_acquire_says_why_with_a_typed_reason(redis_url):
    """NO_INSTANCE for a model no worker registered, INSTANCE_BUSY when every
    instance stayed taken: the scheduler tells them apart by this field."""

    async def body(a, b, r):
        service = RateLimiterService(a, RL)
        await a.register("w1", "addr-w1", [inst("i1")], LONG)
        absent = await service.acquire(
            pb.AcquireRequest(model="nobody", version=1, wait_ms=0, lease_ms=LONG)
        )
        assert not absent.granted and absent.failure == pb.NO_INSTANCE
        assert "no instance" in absent.reason
        first = await service.acquire(
            pb.AcquireRequest(model="m", version=1, wait_ms=0, lease_ms=LONG)
        )
        assert first.granted and first.failure == pb.FAILURE_NONE
        busy = await service.acquire(
            pb.AcquireRequest(model="m", version=1, wait_ms=0, lease_ms=LONG)
        )
        assert not busy.granted and busy.failure == pb.INSTANCE_BUSY

    run(redis_url, body)
