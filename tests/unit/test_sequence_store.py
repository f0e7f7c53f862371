"""services/scheduler/sequence_store.py against a real redis-server: the
backlog order across schedulers, dead owners, lost entries, state shapes."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.scheduler.sequence_store import (
    CLAIMED,
    UNKNOWN,
    WAIT,
    SequenceStore,
    StateUpdate,
)
from stageserve import redis_keys
from stageserve.settings import SchedulerSettings


def run(url: str, body, idle_ms: int = 60_000):
    """body(a, b, redis): two stores (two schedulers) of one model version."""

    async def main():
        r = aioredis.from_url(url)
        await r.flushdb()
        owner_ttl_ms = SchedulerSettings().sequence_owner_ttl_ms
        a = SequenceStore(r, "m", 1, idle_ms, owner_ttl_ms)
        b = SequenceStore(r, "m", 1, idle_ms, owner_ttl_ms)
        try:
            await body(a, b, r)
        finally:
            a.close()
            b.close()
            await r.aclose()

    asyncio.run(main())


def test_entries_run_in_arrival_order_across_schedulers(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await a.enqueue([("i:1", ea)])
        await b.enqueue([("i:1", eb)])
        assert await a.backlog("i:1") == [ea, eb]
        # b's request arrived second: it waits, even though it asks first
        assert (await b.claim([("i:1", eb, False, -1)]))[0].status == WAIT
        assert (await a.claim([("i:1", ea, True, 3)]))[0].status == CLAIMED
        await a.commit([("i:1", ea, False, {"S": StateUpdate(b"\x05", (1,))})])
        claim = (await b.claim([("i:1", eb, False, -1)]))[0]
        assert claim.status == CLAIMED and claim.slot == 3
        assert claim.states == {"S": b"\x05"} and claim.shapes == {"S": (1,)}
        await b.commit([("i:1", eb, True, None)])
        assert await a.backlog("i:1") == []
        assert not await r.exists(redis_keys.sequence_prefix("m", 1) + "i:1")

    run(redis_url, body)


def test_a_dead_schedulers_entry_is_dropped(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await a.enqueue([("i:2", ea)])
        assert (await a.claim([("i:2", ea, True, -1)]))[0].status == CLAIMED
        await b.enqueue([("i:2", eb)])
        assert (await b.claim([("i:2", eb, False, -1)]))[0].status == WAIT
        a.close()  # a died: no more heartbeats ...
        # (a renewal already sent reaches Redis on its own connection: let it land)
        await asyncio.sleep(0.1)
        await r.delete(a.owner_key)  # ... and its owner key expired
        claim = (await b.claim([("i:2", eb, False, -1)]))[0]
        assert claim.status == CLAIMED
        assert await b.backlog("i:2") == [eb]

    run(redis_url, body)


def test_a_live_schedulers_running_entry_is_kept(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await a.enqueue([("i:3", ea)])
        await a.claim([("i:3", ea, True, -1)])
        await b.enqueue([("i:3", eb)])
        for _ in range(3):
            assert (await b.claim([("i:3", eb, False, -1)]))[0].status == WAIT
        assert await a.backlog("i:3") == [ea, eb]

    run(redis_url, body)


def test_non_start_for_unknown_sequence_leaves_the_backlog(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2 = a.new_entry(), a.new_entry()
        await a.enqueue([("s:x", e1), ("s:x", e2)])
        assert (await a.claim([("s:x", e1, False, -1)]))[0].status == UNKNOWN
        assert await a.backlog("s:x") == [e2]
        assert (await a.claim([("s:x", e2, True, -1)]))[0].status == CLAIMED

    run(redis_url, body)


def test_a_lost_entry_queues_again_at_the_back(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await b.enqueue([("i:4", eb)])
        # ea was never listed (or its backlog idled out): it waits behind eb
        assert (await a.claim([("i:4", ea, False, -1)]))[0].status == WAIT
        assert await a.backlog("i:4") == [eb, ea]

    run(redis_url, body)


def test_forget_and_failed_commit_free_the_sequence(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2, e3 = a.new_entry(), a.new_entry(), a.new_entry()
        await a.enqueue([("i:5", e1), ("i:5", e2), ("i:5", e3)])
        assert (await a.claim([("i:5", e1, True, -1)]))[0].status == CLAIMED
        await a.commit([("i:5", e1, False, None)])  # failed execution: no state
        await a.forget([("i:5", e2)])  # answered without running
        claim = (await a.claim([("i:5", e3, False, -1)]))[0]
        assert claim.status == CLAIMED and claim.states == {}

    run(redis_url, body)


def test_growing_state_keeps_its_shape(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        for n in range(1, 4):
            e = a.new_entry()
            await a.enqueue([("i:6", e)])
            claim = (await a.claim([("i:6", e, n == 1, -1)]))[0]
            assert claim.status == CLAIMED
            if n > 1:
                assert claim.shapes == {"S": (2, n - 1)}
                assert len(claim.states["S"]) == 2 * (n - 1)
            await a.commit([("i:6", e, False, {"S": StateUpdate(b"\x01" * 2 * n, (2, n))})])

    run(redis_url, body)


def test_sequence_and_backlog_expire_when_idle(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2 = a.new_entry(), a.new_entry()
        await a.enqueue([("i:7", e1)])
        await a.claim([("i:7", e1, True, -1)])
        await a.commit([("i:7", e1, False, {"S": StateUpdate(b"\x01", (1,))})])
        await asyncio.sleep(0.3)
        await a.enqueue([("i:7", e2)])
        assert (await a.claim([("i:7", e2, False, -1)]))[0].status == UNKNOWN

    run(redis_url, body, idle_ms=150)
