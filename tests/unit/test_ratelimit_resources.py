"""Triton's rate limiter in Redis: resources, device scope, overrides, priorities,
leases (services/ratelimiter/registry.py + services/ratelimiter/lua.py) against
a real redis-server. Counts are read back from the documented keys
(ss:rl:res:held / ss:rl:res:cap, see stageserve/redis_keys.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import redis.asyncio as aioredis

from services.ratelimiter.options import EXECUTION_COUNT, OFF, parse_resource_flag
from services.ratelimiter.registry import Instance, NeverRunnable, RedisRegistry, Resource
from stageserve.settings import RateLimiterSettings
from tests.unit.registry_grants import try_acquire

P = "test:rlres:"
LONG = 60_000


def run(url: str, body, mode: str = EXECUTION_COUNT):
    async def main():
        r = aioredis.from_url(url)
        try:
            await r.flushdb()
            return await body(RedisRegistry(r, P, mode=mode, settings=RateLimiterSettings()), r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def inst(
    iid: str,
    model: str,
    *resources: Resource,
    worker: str = "w1",
    device: int = -1,
    priority: int = 0,
) -> Instance:
    return Instance(
        iid, model, 1, "KIND_CPU", device, worker, f"addr-{worker}", priority, resources
    )


async def register(reg: RedisRegistry, worker: str, *insts: Instance, lease_ms=LONG) -> None:
    await reg.register(worker, f"addr-{worker}", list(insts), lease_ms)


async def counts(reg: RedisRegistry) -> dict[str, tuple[int, int]]:
    return await reg.resources()


async def check_counts(reg: RedisRegistry, r) -> None:
    """Held counts equal the needs of the live grants, and never exceed capacity."""
    expected: Counter[str] = Counter()
    import json

    for gid in await r.zrange(P + "grants", 0, -1):
        need = await r.hget(f"{P}grant:{gid.decode()}", "need")
        for key, count, *_ in json.loads(need or b"[]"):
            expected[key] += count
    for key, (held, cap) in (await counts(reg)).items():
        assert held == expected[key], (key, held, expected[key])
        assert 0 <= held <= cap, (key, held, cap)


R1 = Resource("R1", 1)


def test_two_models_sharing_a_count_1_resource_take_turns(redis_url):
    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1), inst("b", "B", R1))
        assert await counts(reg) == {"R1@w1/-1": (0, 1)}
        ga = await try_acquire(reg, "A", 1, LONG)
        assert ga is not None and ga.holds_resources
        assert await counts(reg) == {"R1@w1/-1": (1, 1)}
        assert await try_acquire(reg, "B", 1, LONG) is None  # B's instance is free, R1 is not
        await reg.release(ga.grant_id)
        assert await counts(reg) == {"R1@w1/-1": (0, 1)}
        gb = await try_acquire(reg, "B", 1, LONG)
        assert gb is not None
        await check_counts(reg, r)

    run(redis_url, body)


def test_default_count_is_the_largest_any_instance_asks_for(redis_url):
    async def body(reg, r):
        await register(
            reg,
            "w1",
            inst("a", "A", Resource("R", 3)),
            inst("b1", "B", Resource("R", 1)),
            inst("b2", "B", Resource("R", 1)),
        )
        assert await counts(reg) == {"R@w1/-1": (0, 3)}
        g1 = await try_acquire(reg, "B", 1, LONG)
        g2 = await try_acquire(reg, "B", 1, LONG)
        assert g1 and g2  # 1 + 1 <= 3: both B instances run at once
        assert await try_acquire(reg, "A", 1, LONG) is None  # A needs 3, 1 left
        await reg.release(g1.grant_id)
        assert await try_acquire(reg, "A", 1, LONG) is None  # 2 left
        await reg.release(g2.grant_id)
        assert await try_acquire(reg, "A", 1, LONG) is not None
        await check_counts(reg, r)

    run(redis_url, body)


def test_off_mode_ignores_resources(redis_url):
    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1), inst("b", "B", R1))
        ga = await try_acquire(reg, "A", 1, LONG)
        gb = await try_acquire(reg, "B", 1, LONG)
        assert ga and gb and not ga.holds_resources and not gb.holds_resources
        assert await try_acquire(reg, "A", 1, LONG) is None  # still one payload per instance
        assert await counts(reg) == {"R1@w1/-1": (0, 1)}

    run(redis_url, body, mode=OFF)


def test_per_device_resources_count_per_device_global_ones_once(redis_url):
    async def body(reg, r):
        g_r = Resource("G", 1, is_global=True)
        await register(reg, "w1", inst("a1", "A", R1, worker="w1", device=0))
        await register(reg, "w1", inst("a1", "A", R1, worker="w1", device=0))
        await register(reg, "w2", inst("a2", "A", R1, worker="w2", device=0))
        await register(reg, "w1", inst("a1", "A", R1, worker="w1", device=0))
        # two devices (one per worker): two payloads at once
        x = await try_acquire(reg, "A", 1, LONG)
        y = await try_acquire(reg, "A", 1, LONG)
        assert x and y and x.instance.worker_id != y.instance.worker_id
        assert await counts(reg) == {"R1@w1/0": (1, 1), "R1@w2/0": (1, 1)}
        await reg.release(x.grant_id)
        await reg.release(y.grant_id)
        # the same instances needing a global resource: one at a time overall
        await register(reg, "w1", inst("g1", "G", g_r, worker="w1", device=0))
        await register(reg, "w2", inst("g2", "G", g_r, worker="w2", device=0))
        x = await try_acquire(reg, "G", 1, LONG)
        assert x is not None
        assert await try_acquire(reg, "G", 1, LONG) is None
        assert (await counts(reg))["G@global"] == (1, 1)
        await reg.release(x.grant_id)
        await check_counts(reg, r)

    run(redis_url, body)


def test_overrides_come_back_when_workers_register_after_redis_lost_them(redis_url):
    async def body(reg, r):
        await reg.set_overrides(dict([parse_resource_flag("R1:3")]))
        await register(reg, "w1", inst("a", "A", R1))
        assert await counts(reg) == {"R1@w1/-1": (0, 3)}
        await r.flushdb()  # Redis restarted empty
        await register(reg, "w1", inst("a", "A", R1))
        assert await counts(reg) == {"R1@w1/-1": (0, 3)}  # not 1, the largest need

    run(redis_url, body)


def test_overrides_any_device_then_one_device_and_too_small(redis_url):
    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1, device=0), inst("b", "B", R1, device=0))
        await reg.set_overrides(dict([parse_resource_flag("R1:2")]))
        assert await counts(reg) == {"R1@w1/0": (0, 2)}
        ga = await try_acquire(reg, "A", 1, LONG)
        gb = await try_acquire(reg, "B", 1, LONG)
        assert ga and gb  # 2 available: both run
        await reg.release(ga.grant_id)
        await reg.release(gb.grant_id)
        await reg.set_overrides(dict([parse_resource_flag("R1:5"), parse_resource_flag("R1:3:0")]))
        assert await counts(reg) == {"R1@w1/0": (0, 3)}  # the device's own override wins
        await reg.set_overrides({"R1": 0})
        with pytest.raises(NeverRunnable, match="resource R1 needs 1 but only 0"):
            await try_acquire(reg, "A", 1, LONG)

    run(redis_url, body)


def test_resource_flag_parsing():
    assert parse_resource_flag("R1:4") == ("R1", 4)
    assert parse_resource_flag("R1:4:1") == ("R1@1", 4)
    for bad in ("R1", "R1:x", ":3", "R1:-1", "R1:1:2:3"):
        with pytest.raises(ValueError):
            parse_resource_flag(bad)


def test_priorities_1_and_4_give_triton_pick_ratio(redis_url):
    """Both models keep asking; every pick goes to the lowest executions x
    priority, so priority 1 runs four times as often as priority 4."""

    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1, priority=1), inst("b", "B", R1, priority=4))
        picks: Counter[str] = Counter()
        rng = random.Random(3)
        for _ in range(200):
            order = ["A", "B"] if rng.random() < 0.5 else ["B", "A"]
            got = None
            for model in order + order:  # the deferring one asks again after
                got = await try_acquire(reg, model, 1, LONG)
                if got is not None:
                    break
            assert got is not None
            picks[got.instance.model] += 1
            await reg.release(got.grant_id)
        assert 155 <= picks["A"] <= 165, picks  # Triton's ratio is 160:40

    run(redis_url, body)


def test_a_pool_waiting_for_a_busy_resource_blocks_no_other(redis_url):
    async def body(reg, r):
        s = Resource("S", 1)
        await register(
            reg,
            "w1",
            inst("c", "C", R1),
            inst("a", "A", R1, priority=1),
            inst("b", "B", s, priority=4),
            inst("b2", "B", s, R1, priority=4),
        )
        hold = await try_acquire(reg, "C", 1, LONG)  # R1 busy
        assert await try_acquire(reg, "A", 1, LONG) is None  # A waits (and asks again)
        assert await try_acquire(reg, "A", 1, LONG) is None
        gb = await try_acquire(reg, "B", 1, LONG)  # S is free: B runs, A does not hold it up
        assert gb is not None and gb.instance.instance_id == "b"
        await reg.release(hold.grant_id)
        await reg.release(gb.grant_id)
        await check_counts(reg, r)

    run(redis_url, body)


def test_expired_grant_and_dead_worker_give_resources_back(redis_url):
    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1), inst("b", "B", R1))
        await register(reg, "w2", inst("x", "X", Resource("G", 1, True)), lease_ms=80)
        short = await try_acquire(reg, "A", 1, 50)  # a scheduler that died holding it
        gx = await try_acquire(reg, "X", 1, LONG)  # on a worker that dies
        assert short and gx
        await asyncio.sleep(0.12)
        assert await reg.sweep() == (1, 1)
        assert (await counts(reg))["R1@w1/-1"] == (0, 1)
        assert "G@global" not in await r.hgetall(P + "res:cap")
        assert await r.hget(P + "res:held", "G@global") is None  # forgotten with its worker
        assert await try_acquire(reg, "B", 1, LONG) is not None
        await check_counts(reg, r)

    run(redis_url, body)


def test_failed_release_removes_the_worker_and_its_holdings(redis_url):
    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1), inst("b", "B", R1))
        g = await try_acquire(reg, "A", 1, LONG)
        await reg.release(g.grant_id, failed=True)
        assert await counts(reg) == {}  # the worker and its resources are gone
        await check_counts(reg, r)

    run(redis_url, body)


def test_random_operations_keep_counts_exact(redis_url):
    async def body(reg, r):
        rng = random.Random(7)
        await register(
            reg,
            "w1",
            inst("a1", "A", Resource("R", 2)),
            inst("a2", "A", Resource("R", 1), Resource("G", 1, True)),
            inst("b1", "B", Resource("G", 2, True), priority=2),
        )
        await register(reg, "w2", inst("c1", "C", Resource("R", 1)), inst("a3", "A"))
        held = []
        for _ in range(300):
            op = rng.random()
            if op < 0.5:
                g = await try_acquire(reg, rng.choice("ABC"), 1, LONG)
                if g is not None:
                    held.append(g)
            elif op < 0.9 and held:
                await reg.release(held.pop(rng.randrange(len(held))).grant_id)
            elif op < 0.95:
                await reg.release(rng.choice(held).grant_id if held else "nope")
            else:
                await register(reg, "w2", inst("c1", "C", Resource("R", 1)))
            await check_counts(reg, r)
        for g in held:
            await reg.release(g.grant_id)
        assert all(h == 0 for h, _ in (await counts(reg)).values())

    run(redis_url, body)


def test_service_exports_counts_and_grant_wait_by_priority(redis_url):
    """The rate limiter's adapter: gauges per resource and device, the grant
    wait histogram per model and priority, a vanished resource leaves."""
    from prometheus_client import REGISTRY

    from services.ratelimiter.service import RateLimiterService
    from stageserve.generated import stageserve_pb2 as pb

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    async def body(reg, r):
        service = RateLimiterService(reg, RateLimiterSettings())
        await register(reg, "w1", inst("a", "metered", Resource("M", 2), priority=3))
        waits = dict(model="metered", priority="3")
        before = sample("stageserve_ratelimiter_grant_wait_seconds_count", **waits) or 0
        resp = await service.acquire(
            pb.AcquireRequest(model="metered", version=1, wait_ms=0, lease_ms=LONG)
        )
        assert resp.granted and resp.holds_resources and resp.instance.priority == 3
        assert sample("stageserve_ratelimiter_grant_wait_seconds_count", **waits) == before + 1
        await service.export_usage_once()
        gauge = "stageserve_ratelimiter_resources"
        assert sample(gauge, resource="M", device="w1/-1", state="held") == 2
        assert sample(gauge, resource="M", device="w1/-1", state="available") == 2
        await service.release(pb.ReleaseRequest(grant_id=resp.grant_id))
        await service.export_usage_once()
        assert sample(gauge, resource="M", device="w1/-1", state="held") == 0
        await reg.deregister("w1")
        await service.export_usage_once()
        assert sample(gauge, resource="M", device="w1/-1", state="available") is None

    run(redis_url, body)


def test_a_new_instance_starts_at_the_lowest_scaled_count_not_zero(redis_url):
    """A model reloaded (or a worker joining) next to one that ran many times
    shares the resource from the start instead of taking every pick."""

    async def body(reg, r):
        await register(reg, "w1", inst("a", "A", R1))
        for _ in range(50):
            g = await try_acquire(reg, "A", 1, LONG)
            await reg.release(g.grant_id)
        await register(reg, "w1", inst("a", "A", R1), inst("b", "B", R1, priority=2))
        assert int(await r.hget(P + "inst:b", "execs")) == 25  # 50 x 1 / priority 2
        picks: Counter[str] = Counter()
        for _ in range(30):
            for model in ("B", "A", "B", "A"):
                g = await try_acquire(reg, model, 1, LONG)
                if g is not None:
                    break
            picks[g.instance.model] += 1
            await reg.release(g.grant_id)
        assert 15 <= picks["A"] <= 25, picks  # 2:1, from the first pick on

    run(redis_url, body)
