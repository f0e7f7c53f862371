"""services/ratelimiter/registry.py + services/ratelimiter/lua.py against a real redis-server.

The invariants are checked through the key layout documented in
stageserve/redis_keys.py (pool / free / grant / grants / worker keys).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from services.ratelimiter.registry import Grant, Instance, NoInstances, RedisRegistry
from stageserve import redis_keys
from stageserve.settings import RateLimiterSettings
from tests.unit.registry_grants import try_acquire

P = "test:rl:"  # a prefix of our own; the default one is checked once below
LONG = 60_000  # ms: a lease that does not run out during a test


def run(url: str, body, prefix: str = P):
    """Run body(registry, redis) on a fresh database, in its own event loop."""

    async def main():
        r = aioredis.from_url(url)
        try:
            await r.flushdb()
            return await body(RedisRegistry(r, prefix, settings=RateLimiterSettings()), r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def inst(iid: str, worker: str = "w1", model: str = "m", version: int = 1) -> Instance:
    return Instance(iid, model, version, "KIND_CPU", -1, worker, f"addr-{worker}")


async def register(
    reg: RedisRegistry, worker: str, *iids: str, model="m", version=1, lease_ms=LONG
) -> int:
    insts = [inst(i, worker, model, version) for i in iids]
    return await reg.register(worker, f"addr-{worker}", insts, lease_ms)


async def free_list(r, model="m", version=1, prefix=P) -> list[str]:
    return [x.decode() for x in await r.lrange(f"{prefix}free:{model}:{version}", 0, -1)]


async def pool(r, model="m", version=1, prefix=P) -> set[str]:
    return {x.decode() for x in await r.smembers(f"{prefix}pool:{model}:{version}")}


async def check_invariants(r, prefix=P, all_alive=True) -> None:
    """Every registered instance is exactly one of: free, or held by one grant."""
    workers = {w.decode() for w in await r.smembers(prefix + "workers")}
    grants = {}
    for gid in await r.zrange(prefix + "grants", 0, -1):
        g = await r.hgetall(f"{prefix}grant:{gid.decode()}")
        assert g, f"grant {gid} in the zset has no hash"
        grants[gid.decode()] = (
            g[b"instance"].decode(),
            f"{g[b'model'].decode()}:{g[b'version'].decode()}",
        )
    held = Counter(i for i, _ in grants.values())
    assert all(n == 1 for n in held.values()), f"instance granted twice: {held}"

    pks = set()
    async for key in r.scan_iter(match=prefix + "pool:*"):
        pks.add(key.decode()[len(prefix + "pool:") :])
    async for key in r.scan_iter(match=prefix + "free:*"):
        pks.add(key.decode()[len(prefix + "free:") :])
    registered = set()
    for pk in pks:
        members = {x.decode() for x in await r.smembers(f"{prefix}pool:{pk}")}
        free = [x.decode() for x in await r.lrange(f"{prefix}free:{pk}", 0, -1)]
        assert len(free) == len(set(free)), f"duplicates in free list {pk}: {free}"
        assert set(free) <= members, f"free list {pk} holds unregistered {set(free) - members}"
        busy = {i for i, gpk in grants.values() if gpk == pk}
        assert not set(free) & busy, f"{pk}: granted instances also free: {set(free) & busy}"
        if all_alive:
            assert set(free) | busy == members, f"{pk}: leaked {members - set(free) - busy}"
        for iid in members:
            f = await r.hgetall(f"{prefix}inst:{iid}")
            assert f, f"pool member {iid} has no inst hash"
            assert f"{f[b'model'].decode()}:{f[b'version'].decode()}" == pk
            wid = f[b"worker_id"].decode()
            assert wid in workers
            assert await r.sismember(f"{prefix}worker:{wid}:insts", iid)
        registered |= members
    for iid, _ in grants.values():
        assert iid in registered, f"a grant holds {iid}, which is not registered"
    for wid in workers:
        for iid in await r.smembers(f"{prefix}worker:{wid}:insts"):
            assert await r.exists(f"{prefix}inst:{iid.decode()}")


# ====================================================================== grants


def test_n_instances_n_grants_then_busy_then_release(redis_url):
    async def body(reg, r):
        assert await register(reg, "w1", "a", "b", "c") == 3
        await check_invariants(r)
        grants = [await try_acquire(reg, "m", 1, LONG) for _ in range(3)]
        assert all(isinstance(g, Grant) for g in grants)
        assert sorted(g.instance.instance_id for g in grants) == ["a", "b", "c"]
        assert len({g.grant_id for g in grants}) == 3
        g0 = grants[0]
        assert g0.instance.model == "m" and g0.instance.version == 1
        assert g0.instance.worker_id == "w1" and g0.instance.worker_address == "addr-w1"
        assert g0.instance.kind == "KIND_CPU" and g0.instance.device_id == -1
        assert await try_acquire(reg, "m", 1, LONG) is None  # all busy, not NoInstances
        await check_invariants(r)
        assert await reg.release(grants[1].grant_id) is True
        again = await try_acquire(reg, "m", 1, LONG)
        assert again.instance.instance_id == grants[1].instance.instance_id
        assert await try_acquire(reg, "m", 1, LONG) is None
        await check_invariants(r)
        for g in (grants[0], grants[2], again):
            assert await reg.release(g.grant_id)
        assert sorted(await free_list(r)) == ["a", "b", "c"]
        await check_invariants(r)

    run(redis_url, body)


def test_default_prefix_is_the_documented_one(redis_url):
    async def body(reg, r):
        assert reg.prefix == redis_keys.RL_PREFIX == "ss:rl:"
        await register(reg, "w1", "a")
        assert (
            await r.exists(
                "ss:rl:workers",
                "ss:rl:worker:w1",
                "ss:rl:worker:w1:insts",
                "ss:rl:inst:a",
                "ss:rl:pool:m:1",
                "ss:rl:free:m:1",
            )
            == 6
        )
        g = await try_acquire(reg, "m", 1, LONG)
        assert await r.hget(f"ss:rl:grant:{g.grant_id}", "instance") == b"a"
        assert await r.zscore("ss:rl:grants", g.grant_id) is not None
        await check_invariants(r, prefix="ss:rl:")

    run(redis_url, lambda reg, r: body(RedisRegistry(r, settings=RateLimiterSettings()), r))


def test_grant_lease_deadline_in_zset(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a")
        before = int(time.time() * 1000)
        g = await try_acquire(reg, "m", 1, 5_000)
        score = await r.zscore(P + "grants", g.grant_id)
        assert before + 5_000 <= score <= int(time.time() * 1000) + 5_000

    run(redis_url, body)


def test_models_and_versions_are_separate_pools(redis_url):
    async def body(reg, r):
        await reg.register(
            "w1",
            "addr-w1",
            [inst("a1", model="a"), inst("a2", model="a", version=2), inst("b1", model="b")],
            LONG,
        )
        assert (await try_acquire(reg, "a", 1, LONG)).instance.instance_id == "a1"
        assert await try_acquire(reg, "a", 1, LONG) is None
        assert (await try_acquire(reg, "a", 2, LONG)).instance.instance_id == "a2"
        assert (await try_acquire(reg, "b", 1, LONG)).instance.instance_id == "b1"
        with pytest.raises(NoInstances):
            await try_acquire(reg, "b", 2, LONG)
        await check_invariants(r)

    run(redis_url, body)


def test_unknown_model_raises_no_instances(redis_url):
    async def body(reg, r):
        with pytest.raises(NoInstances, match="'ghost'"):
            await try_acquire(reg, "ghost", 1, LONG)
        await register(reg, "w1", "a")
        with pytest.raises(NoInstances):
            await try_acquire(reg, "ghost", 1, LONG)
        with pytest.raises(NoInstances, match="version 3"):
            await try_acquire(reg, "m", 3, LONG)
        assert await r.zcard(P + "grants") == 0

    run(redis_url, body)


def test_multiple_workers_share_a_pool(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a")
        await register(reg, "w2", "b")
        got = {(await try_acquire(reg, "m", 1, LONG)).instance.worker_id for _ in range(2)}
        assert got == {"w1", "w2"}
        assert await try_acquire(reg, "m", 1, LONG) is None
        await check_invariants(r)

    run(redis_url, body)


def test_instances_and_busy_listing(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", "b")
        await register(reg, "w2", "c", model="other", version=2)
        all_insts = await reg.instances()
        assert [i.instance_id for i in all_insts] == ["a", "b", "c"]
        assert all_insts[2] == inst("c", "w2", "other", 2)
        assert [i.instance_id for i in await reg.instances("other")] == ["c"]
        assert [i.instance_id for i in await reg.instances("m", 1)] == ["a", "b"]
        assert await reg.instances("m", 2) == []
        assert await reg.busy_instance_ids() == []
        g = await try_acquire(reg, "other", 2, LONG)
        assert await reg.busy_instance_ids() == ["c"]
        await reg.release(g.grant_id)
        assert await reg.busy_instance_ids() == []

    run(redis_url, body)


# ====================================================================== register


def test_reregister_same_set_adds_nothing(redis_url):
    async def body(reg, r):
        assert await register(reg, "w1", "a", "b") == 2
        g = await try_acquire(reg, "m", 1, LONG)
        assert await register(reg, "w1", "a", "b") == 0
        assert await register(reg, "w1", "b", "a") == 0
        assert await free_list(r) == [x for x in ("a", "b") if x != g.instance.instance_id]
        await check_invariants(r)  # the busy one was not re-freed
        await reg.release(g.grant_id)
        assert sorted(await free_list(r)) == ["a", "b"]
        await check_invariants(r)

    run(redis_url, body)


def test_reregister_smaller_set_removes_instances(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", "b", "c")
        g = await try_acquire(reg, "m", 1, LONG)
        busy = g.instance.instance_id
        keep = next(i for i in "abc" if i != busy)
        assert await register(reg, "w1", keep) == 0
        assert await pool(r) == {keep}
        assert await free_list(r) == [keep]
        assert not await r.exists(f"{P}inst:{busy}")
        assert {x.decode() for x in await r.smembers(P + "worker:w1:insts")} == {keep}
        await check_invariants(r)
        # the removed instance's grant ends harmlessly and does not come back free
        await reg.release(g.grant_id)
        assert await free_list(r) == [keep]
        assert [i.instance_id for i in await reg.instances()] == [keep]
        await check_invariants(r)

    run(redis_url, body)


def test_reregister_with_nothing_keeps_worker_but_no_instances(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a")
        assert await register(reg, "w1") == 0
        with pytest.raises(NoInstances):
            await try_acquire(reg, "m", 1, LONG)
        assert await reg.heartbeat("w1", LONG)
        await check_invariants(r)

    run(redis_url, body)


def test_removed_busy_instance_readded_then_old_grant_released(redis_url):
    """A model reload under load: an instance id goes away while busy and comes back."""

    async def body(reg, r):
        await register(reg, "w1", "a")
        old = await try_acquire(reg, "m", 1, LONG)
        await register(reg, "w1")  # unloaded while its payload still runs
        assert await register(reg, "w1", "a") == 1  # loaded again, same id
        await check_invariants(r)
        await reg.release(old.grant_id)  # the old payload finishes
        assert await free_list(r) == ["a"]
        await check_invariants(r)
        g1 = await try_acquire(reg, "m", 1, LONG)
        assert g1 is not None
        assert await try_acquire(reg, "m", 1, LONG) is None  # never handed out twice

    run(redis_url, body)


def test_register_moves_instance_to_new_version(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", "b")
        await reg.register("w1", "addr-w1", [inst("a"), inst("c", version=2)], LONG)
        assert await pool(r) == {"a"}
        assert await pool(r, version=2) == {"c"}
        assert await free_list(r, version=2) == ["c"]
        await check_invariants(r)

    run(redis_url, body)


def test_deregister_removes_everything(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", "b")
        await register(reg, "w2", "c")
        g = await try_acquire(reg, "m", 1, LONG)
        assert await reg.deregister("w1") == 2
        assert await reg.deregister("w1") == 0
        assert not await r.exists(
            P + "worker:w1", P + "worker:w1:insts", P + "inst:a", P + "inst:b"
        )
        assert {w.decode() for w in await r.smembers(P + "workers")} == {"w2"}
        if g.instance.worker_id == "w1":
            await reg.release(g.grant_id)
        assert not await reg.heartbeat("w1", LONG)
        await check_invariants(r)
        assert await pool(r) == {"c"}

    run(redis_url, body)


# ====================================================================== liveness


def test_heartbeat_keeps_worker(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", lease_ms=300)
        for _ in range(6):
            await asyncio.sleep(0.1)
            assert await reg.heartbeat("w1", 300) is True
        assert await reg.sweep() == (0, 0)
        assert (await try_acquire(reg, "m", 1, LONG)).instance.instance_id == "a"
        assert 0 < await r.pttl(P + "worker:w1") <= 300

    run(redis_url, body)


def test_heartbeat_unknown_worker(redis_url):
    async def body(reg, r):
        assert await reg.heartbeat("nobody", 1000) is False
        assert not await r.exists(P + "worker:nobody")

    run(redis_url, body)


def test_expired_worker_removed_by_sweep_and_never_granted(redis_url):
    async def body(reg, r):
        await register(reg, "dead", "d1", "d2", lease_ms=80)
        await register(reg, "live", "l1")
        await asyncio.sleep(0.15)
        assert await reg.heartbeat("dead", 80) is False  # too late: it must register again
        assert await reg.sweep() == (0, 1)
        assert await pool(r) == {"l1"}
        assert {w.decode() for w in await r.smembers(P + "workers")} == {"live"}
        assert not await r.exists(P + "inst:d1", P + "inst:d2", P + "worker:dead:insts")
        for _ in range(3):
            g = await try_acquire(reg, "m", 1, LONG)
            if g is not None:
                assert g.instance.worker_id == "live"
        assert await reg.sweep() == (0, 0)
        await check_invariants(r)

    run(redis_url, body)


def test_expired_worker_not_granted_even_before_sweep(redis_url):
    async def body(reg, r):
        await register(reg, "dead", "d1", lease_ms=50)
        await asyncio.sleep(0.1)
        assert await try_acquire(reg, "m", 1, LONG) is None  # stale entry skipped
        assert await reg.sweep() == (0, 1)
        with pytest.raises(NoInstances):
            await try_acquire(reg, "m", 1, LONG)

    run(redis_url, body)


def test_worker_back_after_lease_lapsed_gets_its_instances_back(redis_url):
    """Heartbeat late (GC pause): an acquire skipped its stale instances, then the
    worker registered again before any sweep. Nothing may stay leaked."""

    async def body(reg, r):
        await register(reg, "w1", "a", "b", lease_ms=50)
        g = await try_acquire(reg, "m", 1, LONG)  # one payload in flight across the lapse
        await asyncio.sleep(0.1)
        assert await try_acquire(reg, "m", 1, LONG) is None
        assert await reg.heartbeat("w1", 50) is False
        await register(reg, "w1", "a", "b")
        await check_invariants(r)
        await reg.release(g.grant_id)  # the old payload's release frees nothing twice
        await check_invariants(r)
        got = [await try_acquire(reg, "m", 1, LONG) for _ in range(3)]
        assert sorted(x.instance.instance_id for x in got[:2]) == ["a", "b"]
        assert got[2] is None
        await check_invariants(r)

    run(redis_url, body)


def test_expired_grant_released_by_sweep_exactly_once(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a", "b")
        short = await try_acquire(reg, "m", 1, 50)
        long_ = await try_acquire(reg, "m", 1, LONG)
        await asyncio.sleep(0.1)
        assert await reg.sweep() == (1, 0)
        assert await free_list(r) == [short.instance.instance_id]
        assert not await r.exists(f"{P}grant:{short.grant_id}")
        assert await reg.sweep() == (0, 0)
        assert await free_list(r) == [short.instance.instance_id]
        # the late holder's own release is harmless
        assert await reg.release(short.grant_id) is False
        assert await free_list(r) == [short.instance.instance_id]
        # the instance is handed out again; the stale release still does nothing
        again = await try_acquire(reg, "m", 1, LONG)
        assert again.instance.instance_id == short.instance.instance_id
        assert await reg.release(short.grant_id) is False
        assert await free_list(r) == []
        await check_invariants(r)
        await reg.release(long_.grant_id)
        await reg.release(again.grant_id)
        assert sorted(await free_list(r)) == ["a", "b"]
        await check_invariants(r)

    run(redis_url, body)


def test_a_schedulers_next_process_ends_its_predecessors_grants(redis_url):
    """release_holder: every grant an earlier process of the scheduler id
    holds ends (its instance free again, at once), while the asking
    process's own grants, another scheduler's (even one whose id the first
    begins with) and grants without a holder stay."""

    async def body(reg, r):
        await register(reg, "w1", "a", "b", "c", "d", "e", "f")

        async def grant(holder: str) -> Grant:
            got = await reg.attempt("m", 1, LONG, holder=holder)
            assert isinstance(got, Grant)
            return got

        dead = [await grant("s/old1"), await grant("s/old2")]
        mine = await grant("s/new")
        other = await grant("s2/old1")
        anonymous = await try_acquire(reg, "m", 1, LONG)
        assert dead[0].grant_id.startswith("s/old1/") and anonymous is not None
        assert await free_list(r) == ["f"]

        assert await reg.release_holder("s/new") == 2
        assert sorted(await free_list(r)) == sorted(["f"] + [g.instance.instance_id for g in dead])
        for g in dead:
            assert not await r.exists(f"{P}grant:{g.grant_id}")
        for g in (mine, other, anonymous):
            assert await r.zscore(P + "grants", g.grant_id) is not None
        await check_invariants(r)
        assert await reg.release_holder("s/new") == 0  # nothing more to end
        assert await reg.release(dead[0].grant_id) is False  # a late release is harmless
        for g in (mine, other, anonymous):
            assert await reg.release(g.grant_id)
        assert len(await free_list(r)) == 6
        await check_invariants(r)

    run(redis_url, body)


# ====================================================================== release


def test_release_failed_removes_whole_worker(redis_url):
    async def body(reg, r):
        await register(reg, "bad", "x1", "x2")
        await register(reg, "good", "g1")
        grants = [await try_acquire(reg, "m", 1, LONG) for _ in range(3)]
        by_iid = {g.instance.instance_id: g for g in grants}
        assert set(by_iid) == {"x1", "x2", "g1"}
        assert await reg.release(by_iid["x1"].grant_id, failed=True) is True
        assert await pool(r) == {"g1"}
        assert {w.decode() for w in await r.smembers(P + "workers")} == {"good"}
        assert not await r.exists(P + "worker:bad", P + "inst:x1", P + "inst:x2")
        assert await reg.heartbeat("bad", LONG) is False
        await check_invariants(r)
        # the other payload of the removed worker ends: its instance stays gone
        await reg.release(by_iid["x2"].grant_id)
        assert await free_list(r) == []
        await reg.release(by_iid["g1"].grant_id)
        assert await free_list(r) == ["g1"]
        await check_invariants(r)

    run(redis_url, body)


def test_double_release_is_harmless(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a")
        g = await try_acquire(reg, "m", 1, LONG)
        assert await reg.release(g.grant_id) is True
        assert await reg.release(g.grant_id) is False
        assert await reg.release(g.grant_id, failed=True) is False  # no worker removed
        assert await free_list(r) == ["a"]
        assert await pool(r) == {"a"}
        assert await reg.release("never-granted") is False
        await check_invariants(r)

    run(redis_url, body)


def test_release_after_deregister(redis_url):
    async def body(reg, r):
        await register(reg, "w1", "a")
        g = await try_acquire(reg, "m", 1, LONG)
        await reg.deregister("w1")
        await reg.release(g.grant_id)
        assert await free_list(r) == []
        assert await r.zcard(P + "grants") == 0
        await register(reg, "w1", "a")
        assert await free_list(r) == ["a"]
        await check_invariants(r)

    run(redis_url, body)


# ====================================================================== random sequences


def test_random_sequences_never_leak_or_duplicate(redis_url):
    async def body(reg, r):
        rng = random.Random(1234)
        universe = {w: [f"{w}-{k}" for k in range(3)] for w in ("w1", "w2", "w3")}
        held: list[Grant] = []
        released: list[Grant] = []
        for step in range(400):
            op = rng.choice(
                [
                    "register",
                    "register",
                    "acquire",
                    "acquire",
                    "acquire",
                    "release",
                    "release",
                    "failed",
                    "stale",
                    "deregister",
                    "sweep",
                ]
            )
            if op == "register":
                w = rng.choice(list(universe))
                ids = rng.sample(universe[w], rng.randint(0, 3))
                await reg.register(
                    w, f"addr-{w}", [inst(i, w, version=1 + int(i[-1]) % 2) for i in ids], LONG
                )
            elif op == "acquire":
                try:
                    g = await try_acquire(reg, "m", rng.choice([1, 2]), LONG)
                except NoInstances:
                    g = None
                if g is not None:
                    assert g.instance.instance_id not in {h.instance.instance_id for h in held}
                    held.append(g)
            elif op in ("release", "failed") and held:
                g = held.pop(rng.randrange(len(held)))
                await reg.release(g.grant_id, failed=op == "failed" and rng.random() < 0.3)
                released.append(g)
            elif op == "stale" and released:
                await reg.release(rng.choice(released).grant_id)
            elif op == "deregister":
                await reg.deregister(rng.choice(list(universe)))
            elif op == "sweep":
                assert await reg.sweep() == (0, 0)
            # grants of removed instances are gone: forget them as holders
            live = {x.decode() for x in await r.zrange(P + "grants", 0, -1)}
            for g in [g for g in held if g.grant_id not in live]:
                held.remove(g)
                released.append(g)
            try:
                await check_invariants(r)
            except AssertionError as exc:
                raise AssertionError(f"step {step} ({op}): {exc}") from None
        for g in held:
            await reg.release(g.grant_id)
        await check_invariants(r)
        assert await r.zcard(P + "grants") == 0

    run(redis_url, body)
