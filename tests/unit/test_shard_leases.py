"""Shard leases against a real redis-server: services/scheduler/shard_member.py
(take, hand over, prune the dead, leave) and stageserve/shard_map.py (the
view gateways route with). Heartbeats are driven by hand (`tick`), so each
step is one observable state of the map."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.scheduler.shard_member import ShardMember
from stageserve import redis_keys as keys
from stageserve.shard_map import ShardView
from stageserve.shard_policy import assign

MODELS = [f"m{i}" for i in range(12)]
LEASE_MS = 10_000  # outlives any stall of a loaded machine between two ticks
SHORT_LEASE_MS = 500  # the scheduler the death test lets die


def run(url: str, body) -> None:
    async def main() -> None:
        r = aioredis.from_url(url)
        await r.flushdb()
        await r.hset(keys.MODELS, mapping={m: 1 for m in MODELS})
        drained: list[str] = []

        async def drain(model: str) -> None:  # the scheduler's queues, already idle
            drained.append(model)

        def member(name: str, lease_ms: int = LEASE_MS) -> ShardMember:
            return ShardMember(r, name, f"{name}:1", drain, lease_ms=lease_ms)

        view = ShardView(r)
        try:
            await body(r, member, view, drained)
        finally:
            await view.close()
            await r.aclose()

    asyncio.run(main())


async def owners(r: aioredis.Redis) -> dict[str, str]:
    raw = await r.hgetall(keys.SHARD_OWNERS)
    return {_text(k): _text(v) for k, v in raw.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_two_schedulers_take_the_policys_shares_and_the_view_routes_there(redis_url) -> None:
    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b")
        await a.tick()
        await b.tick()  # b sees a live owner for a's models: takes only unowned ones
        await a.tick()  # a sees b live: hands b its share
        await asyncio.gather(*a._moves)
        await b.tick()
        expected = assign(MODELS, ["a", "b"])
        assert await owners(r) == expected
        assert a.owned == {m for m, s in expected.items() if s == "a"}
        assert b.owned == {m for m, s in expected.items() if s == "b"}
        assert set(drained) == b.owned  # a drained each model before handing it over
        await view.refresh()
        assert {m: view.route(m) for m in MODELS} == {m: f"{s}:1" for m, s in expected.items()}

    run(redis_url, body)


def test_a_live_owner_keeps_its_model_and_a_handed_model_is_adopted(redis_url) -> None:
    async def body(r, member, view, drained) -> None:
        a, b = member("a"), member("b")
        await a.tick()  # alone: a takes everything
        assert a.owned == set(MODELS)
        await b.tick()
        b_share = {m for m, s in assign(MODELS, ["a", "b"]).items() if s == "b"}
        model = sorted(b_share)[0]
        assert not await b.holds(model)  # the policy names b, but a is live and owns it
        await a.tick()
        await asyncio.gather(*a._moves)
        b.live = ["b"]  # a stale view of the live set does not stop an adoption
        other = sorted(set(MODELS) - b_share)[0]
        assert await b.holds(model)
        assert not await b.holds(other)  # and no take of what a still owns

    run(redis_url, body)


def test_a_dead_schedulers_models_go_to_the_survivor_after_its_lease(redis_url) -> None:
    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b", SHORT_LEASE_MS)
        for step in (a, b, a):
            await step.tick()
        await asyncio.gather(*a._moves)
        await b.tick()
        await view.refresh()
        gone = asyncio.ensure_future(view.gone("b:1"))
        version = view.version
        await asyncio.sleep(SHORT_LEASE_MS / 1000 + 0.05)  # b stops renewing: dead
        await a.tick()  # prunes b, takes its models
        assert await owners(r) == {m: "a" for m in MODELS}
        assert a.owned == set(MODELS)
        assert [s.decode() for s in await r.zrange(keys.SHARD_MEMBERS, 0, -1)] == ["a"]
        assert await view.wait_past(version, 2.0)
        await asyncio.wait_for(gone, 2.0)  # links waiting on b give up
        assert {view.route(m) for m in MODELS} == {"a:1"}

    run(redis_url, body)


def test_the_view_drops_a_lapsed_lease_with_no_survivor_pruning_it(redis_url) -> None:
    """No heartbeat prunes b (a is not ticking either), so the map's version
    never moves: the following view still stops routing to b once b's lease
    ran out (within lease + one poll), and a's models still route to a."""

    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b", SHORT_LEASE_MS)
        for step in (a, b, a):
            await step.tick()
        await asyncio.gather(*a._moves)
        await b.tick()
        b_share = sorted(b.owned)
        follower = ShardView(r, poll_s=0.1)
        try:
            await follower.refresh()
            follower.start()
            assert {follower.route(m) for m in b_share} == {"b:1"}
            version = int(await r.get(keys.SHARD_VERSION))
            loop = asyncio.get_running_loop()
            lapsed = loop.time() + SHORT_LEASE_MS / 1000
            while follower.route(b_share[0]) == "b:1" and loop.time() < lapsed + 2:
                await asyncio.sleep(0.02)
            assert loop.time() < lapsed + 0.5  # within one poll (and a load margin)
            assert {follower.route(m) for m in b_share} == {"a:1"}
            assert int(await r.get(keys.SHARD_VERSION)) == version  # nothing pruned b
        finally:
            await follower.close()

    run(redis_url, body)


def test_a_stalled_scheduler_is_fenced_once_its_lease_lapsed(redis_url) -> None:
    """b stalls past its lease (no tick), a takes its models; b's fence says
    its lease is stale, and confirming re-reads the map: b owns nothing, and
    each model it lost is reported once (its queue is refused)."""

    async def body(r, member, view, drained) -> None:
        a, b = member("a"), member("b", SHORT_LEASE_MS)
        lost: list[str] = []
        b.on_lost = lost.append
        for step in (a, b, a):
            await step.tick()
        await asyncio.gather(*a._moves)
        await b.tick()
        b_share = set(b.owned)
        assert b_share and b.fresh()
        assert await b.confirm(sorted(b_share)[0])  # fresh: no Redis needed
        await asyncio.sleep(SHORT_LEASE_MS / 1000 + 0.05)  # b stalls
        assert not b.fresh()
        await a.tick()  # prunes b, takes its models
        assert await owners(r) == {m: "a" for m in MODELS}
        results = await asyncio.gather(*(b.confirm(m) for m in sorted(b_share)))
        assert not any(results)  # no batch of a lost model runs on b
        assert b.fresh() and not b.owned
        assert sorted(lost) == sorted(b_share)
        await a.tick()  # b is live again: a hands b its share back, as on a join
        await asyncio.gather(*a._moves)
        await b.tick()
        assert b.owned == b_share

    run(redis_url, body)


def test_a_leaving_scheduler_hands_everything_over_and_the_view_sees_the_move(
    redis_url,
) -> None:
    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b")
        for step in (a, b, a):
            await step.tick()
        await asyncio.gather(*a._moves)
        await b.tick()
        await view.refresh()
        b_model = sorted(b.owned)[0]
        moved = asyncio.ensure_future(view.moved(b_model, "b:1", 2.0))
        await asyncio.sleep(0)
        await b.leave()
        assert await owners(r) == {m: "a" for m in MODELS}
        view.start()
        assert await asyncio.wait_for(moved, 3.0)
        assert view.route(b_model) == "a:1"
        assert not await view.moved(b_model, "a:1", 0.2)  # no further move: times out

    run(redis_url, body)


def test_each_change_of_owner_makes_a_new_term_and_only_the_owner_holds_it(redis_url) -> None:
    """A model's term (what sequence commits check) is new with each take and
    hand-over, matches Redis's while the scheduler owns the model, and is
    gone once the model left it."""

    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b")
        await a.tick()  # a alone takes every model
        model = MODELS[0]
        first = a.term(model)
        assert first and _text(await r.hget(keys.SHARD_TERMS, model)) == first
        await a.tick()
        assert a.term(model) == first  # still a's, no break: the same term
        assert b.term(model) is None
        await b.tick()
        await a.tick()  # hands b its share
        await asyncio.gather(*a._moves)
        moved = next(m for m in MODELS if assign(MODELS, ["a", "b"])[m] == "b")
        kept = next(m for m in MODELS if assign(MODELS, ["a", "b"])[m] == "a")
        assert a.term(moved) is None
        assert await b.holds(moved)
        handed = b.term(moved)
        assert handed and handed != a.terms.get(moved) and handed != first
        assert _text(await r.hget(keys.SHARD_TERMS, moved)) == handed
        assert a.term(kept) == _text(await r.hget(keys.SHARD_TERMS, kept))
        await r.delete(keys.SHARD_TERMS, keys.SHARD_OWNERS)  # Redis restarted empty
        await a.tick()  # a takes its models back: new terms
        assert a.term(kept) not in (None, first)

    run(redis_url, body)


def test_a_hand_over_to_nobody_still_makes_a_new_term(redis_url) -> None:
    """The last scheduler leaves: the models have no owner but a new term, so
    a commit of the old term cannot pass (only a Redis restarted empty has
    no term)."""

    async def body(r, member, view: ShardView, drained) -> None:
        a = member("a")
        await a.tick()
        before = a.term(MODELS[0])
        await a.leave()
        assert await owners(r) == {}
        after = _text(await r.hget(keys.SHARD_TERMS, MODELS[0]))
        assert after and after != before
        assert a.term(MODELS[0]) is None

    run(redis_url, body)
