"""services/scheduler/sequence_store.py against a real redis-server: the
backlog order across schedulers, dead owners, lost entries, state shapes."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.scheduler.sequence_store import (
    CLAIMED,
    UNKNOWN,
    WAIT,
    Committed,
    Finished,
    PinsSnapshot,
    Placement,
    SequenceStore,
    StateUpdate,
)
from stageserve import redis_keys
from stageserve.script_lane import ScriptLane
from stageserve.settings import SchedulerSettings

# Every test runs with the scripts called through redis-py and through the
# scheduler's pipelined connection (stageserve/script_lane.py).
_CALLS = {"through": "redis-py"}


@pytest.fixture(autouse=True, params=["redis-py", "lane"])
def scripts_through(request: pytest.FixtureRequest) -> None:
    _CALLS["through"] = request.param


def run(url: str, body, idle_ms: int = 60_000):
    """body(a, b, redis): two stores (two schedulers) of one model version."""

    async def main():
        r = aioredis.from_url(url)
        await r.flushdb()
        lane = ScriptLane.of(r) if _CALLS["through"] == "lane" else None
        owner_ttl_ms = SchedulerSettings().sequence_owner_ttl_ms
        a = SequenceStore(r, "m", 1, idle_ms, owner_ttl_ms, lane)
        b = SequenceStore(r, "m", 1, idle_ms, owner_ttl_ms, lane)
        try:
            await body(a, b, r)
        finally:
            a.close()
            b.close()
            if lane is not None:
                lane.close()
            await r.aclose()

    asyncio.run(main())


def test_entries_run_in_arrival_order_across_schedulers(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await a.enqueue([("i:1", ea, False)])
        await b.enqueue([("i:1", eb, False)])
        assert await a.backlog("i:1") == [ea, eb]
        # b's request arrived second: it waits, even though it asks first
        assert (await b.claim([("i:1", eb, False, -1)]))[0].status == WAIT
        assert (await a.claim([("i:1", ea, True, 3)]))[0].status == CLAIMED
        await a.commit([Finished("i:1", ea, False, {"S": StateUpdate(b"\x05", (1,))})])
        claim = (await b.claim([("i:1", eb, False, -1)]))[0]
        assert claim.status == CLAIMED and claim.slot == 3
        assert claim.states == {"S": b"\x05"} and claim.shapes == {"S": (1,)}
        await b.commit([Finished("i:1", eb, True)])
        assert await a.backlog("i:1") == []
        assert not await r.exists(redis_keys.sequence_prefix("m", 1) + "i:1")

    run(redis_url, body)


def test_a_dead_schedulers_entry_is_dropped(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await a.enqueue([("i:2", ea, False)])
        assert (await a.claim([("i:2", ea, True, -1)]))[0].status == CLAIMED
        await b.enqueue([("i:2", eb, False)])
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
        await a.enqueue([("i:3", ea, False)])
        await a.claim([("i:3", ea, True, -1)])
        await b.enqueue([("i:3", eb, False)])
        for _ in range(3):
            assert (await b.claim([("i:3", eb, False, -1)]))[0].status == WAIT
        assert await a.backlog("i:3") == [ea, eb]

    run(redis_url, body)


def test_non_start_for_unknown_sequence_leaves_the_backlog(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2 = a.new_entry(), a.new_entry()
        await a.enqueue([("s:x", e1, False), ("s:x", e2, False)])
        assert (await a.claim([("s:x", e1, False, -1)]))[0].status == UNKNOWN
        assert await a.backlog("s:x") == [e2]
        assert (await a.claim([("s:x", e2, True, -1)]))[0].status == CLAIMED

    run(redis_url, body)


def test_a_lost_entry_queues_again_at_the_back(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        ea, eb = a.new_entry(), b.new_entry()
        await b.enqueue([("i:4", eb, False)])
        # ea was never listed (or its backlog idled out): it waits behind eb
        assert (await a.claim([("i:4", ea, False, -1)]))[0].status == WAIT
        assert await a.backlog("i:4") == [eb, ea]

    run(redis_url, body)


def test_forget_and_failed_commit_free_the_sequence(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2, e3 = a.new_entry(), a.new_entry(), a.new_entry()
        await a.enqueue([("i:5", e1, False), ("i:5", e2, False), ("i:5", e3, False)])
        assert (await a.claim([("i:5", e1, True, -1)]))[0].status == CLAIMED
        await a.commit([Finished("i:5", e1, False)])  # failed execution: no state
        await a.forget([("i:5", e2)])  # answered without running
        claim = (await a.claim([("i:5", e3, False, -1)]))[0]
        assert claim.status == CLAIMED and claim.states == {}

    run(redis_url, body)


def test_growing_state_keeps_its_shape(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        for n in range(1, 4):
            e = a.new_entry()
            await a.enqueue([("i:6", e, False)])
            claim = (await a.claim([("i:6", e, n == 1, -1)]))[0]
            assert claim.status == CLAIMED
            if n > 1:
                assert claim.shapes == {"S": (2, n - 1)}
                assert len(claim.states["S"]) == 2 * (n - 1)
            await a.commit([Finished("i:6", e, False, {"S": StateUpdate(b"\x01" * 2 * n, (2, n))})])

    run(redis_url, body)


def test_sequence_and_backlog_expire_when_idle(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2 = a.new_entry(), a.new_entry()
        await a.enqueue([("i:7", e1, False)])
        await a.claim([("i:7", e1, True, -1)])
        await a.commit([Finished("i:7", e1, False, {"S": StateUpdate(b"\x01", (1,))})])
        await asyncio.sleep(0.3)
        await a.enqueue([("i:7", e2, False)])
        assert (await a.claim([("i:7", e2, False, -1)]))[0].status == UNKNOWN

    run(redis_url, body, idle_ms=150)


def test_held_rows_commit_without_a_listing_or_claim(redis_url) -> None:
    """Rows run with kept states (held): a START records its slot and
    states; a later row keeps its new states and renews the idle expiry."""

    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        await r.hset(redis_keys.SHARD_TERMS, "m", "t1")
        start = Finished("i:8", "", False, {"S": StateUpdate(b"\x02", (1,))}, True, True, 4)
        assert await a.commit([start], "t1") == Committed()
        e = a.new_entry()  # a listed request of the sequence sees what was kept
        await a.enqueue([("i:8", e, False)])
        claim = (await a.claim([("i:8", e, False, -1)]))[0]
        assert claim.status == CLAIMED and claim.slot == 4 and claim.states == {"S": b"\x02"}
        await a.commit([Finished("i:8", e, False)])
        key = redis_keys.sequence_prefix("m", 1) + "i:8"
        await r.persist(key)
        later = Finished("i:8", "", False, {"S": StateUpdate(b"\x03", (1,))}, held=True, slot=4)
        assert await a.commit([later], "t1") == Committed()
        assert await r.hget(key, "st:S") == b"\x03" and await r.hget(key, "slot") == b"4"
        assert 0 < await r.pttl(key) <= 60_000
        await a.commit([Finished("i:8", "", True, held=True, slot=4)], "t1")
        assert not await r.exists(key)
        assert await a.backlog("i:8") == []

    run(redis_url, body)


def test_a_held_commit_under_another_term_keeps_nothing(redis_url) -> None:
    """The model changed owner (or Redis restarted empty): the term no longer
    matches, and no state, listed entry or end is written."""

    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e = a.new_entry()
        await a.enqueue([("i:9", e, False)])
        assert (await a.claim([("i:9", e, True, -1)]))[0].status == CLAIMED
        await r.hset(redis_keys.SHARD_TERMS, "m", "t2")
        rows = [
            Finished("i:9", e, False, {"S": StateUpdate(b"\x07", (1,))}),
            Finished("i:10", "", True, held=True),
        ]
        assert await a.commit(rows, "t1") == Committed(fenced=True)
        assert await a.backlog("i:9") == [e]
        key = redis_keys.sequence_prefix("m", 1) + "i:9"
        assert await r.exists(key) and await r.hget(key, "st:S") is None
        assert await a.commit(rows, "t3") == Committed(fenced=True)

    run(redis_url, body)


def test_a_held_row_whose_sequence_is_gone_is_reported_lost(redis_url) -> None:
    """A held non-START row finds no sequence (Redis lost it): that row keeps
    nothing and is reported, whether it changed states, changed none or had
    END; the batch's other rows commit, a held row of a sequence still there
    renews its expiry without a state change."""

    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        await r.hset(redis_keys.SHARD_TERMS, "m", "t1")
        e = a.new_entry()
        await a.enqueue([("i:12", e, False)])
        assert (await a.claim([("i:12", e, True, -1)]))[0].status == CLAIMED
        start = Finished("i:17", "", False, {"S": StateUpdate(b"\x09", (1,))}, True, True, 2)
        assert await a.commit([start], "t1") == Committed()
        prefix = redis_keys.sequence_prefix("m", 1)
        await r.persist(prefix + "i:17")
        rows = [
            Finished("i:11", "", False, {"S": StateUpdate(b"\x01", (1,))}, held=True),
            Finished("i:12", e, False, {"S": StateUpdate(b"\x05", (1,))}),
            Finished("i:15", "", False, held=True),  # no state changed
            Finished("i:16", "", True, held=True),  # END
            Finished("i:17", "", False, held=True, slot=2),  # still there, unchanged
        ]
        assert await a.commit(rows, "t1") == Committed(lost=[0, 2, 3])
        for gone in ("i:11", "i:15", "i:16"):
            assert not await r.exists(prefix + gone)
        assert await r.hget(prefix + "i:12", "st:S") == b"\x05"
        assert await a.backlog("i:12") == []
        assert await r.hgetall(prefix + "i:17") == {b"slot": b"2", b"st:S": b"\x09", b"sh:S": b"1"}
        assert 0 < await r.pttl(prefix + "i:17") <= 60_000

    run(redis_url, body)


def test_with_no_term_at_all_a_held_commit_finds_what_redis_lost(redis_url) -> None:
    """Redis restarted empty (no term: nobody took the model since): the
    commit goes on; a held row whose sequence is gone is reported lost, a
    held START keeps its states."""

    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        rows = [
            Finished("i:13", "", False, {"S": StateUpdate(b"\x01", (1,))}, held=True),
            Finished("i:14", "", False, {"S": StateUpdate(b"\x02", (1,))}, True, True),
        ]
        assert await a.commit(rows, "t1") == Committed(lost=[0])
        prefix = redis_keys.sequence_prefix("m", 1)
        assert not await r.exists(prefix + "i:13")
        assert await r.hget(prefix + "i:14", "st:S") == b"\x02"

    run(redis_url, body)


def test_a_next_owner_finds_the_slots_and_pins_the_last_one_saved(redis_url) -> None:
    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1, e2 = a.new_entry(), a.new_entry()
        assert await a.enqueue([("i:1", e1, False), ("i:2", e2, False)]) is None
        await a.claim([("i:1", e1, True, 2), ("i:2", e2, True, 1)])  # STARTs in slots 2, 1
        rows = [Finished("i:1", e1, False), Finished("i:2", e2, False)]
        await a.commit(rows, pins=PinsSnapshot(0, {0: "inst-A", 1: "inst-B"}))
        assert 0 < await r.pttl(a.prefix + "pins") <= 60_000  # the commit keeps it
        # b takes the model over: sequence 1 continues, 3 is unknown, 2 is not asked
        placement = await b.enqueue(
            [
                ("i:1", b.new_entry(), True),
                ("i:2", b.new_entry(), False),
                ("i:3", b.new_entry(), True),
            ]
        )
        assert placement == Placement({"i:1": 2}, {0: "inst-A", 1: "inst-B"})
        # b's own pins replace a's, whatever a's serial was
        await b.commit([], pins=PinsSnapshot(0, {}))
        assert await _pins_found(b) == {}

    run(redis_url, body)


async def _pins_found(store: SequenceStore) -> dict[int, str]:
    """The pins a scheduler taking the model over finds, listing i:1."""
    placement = await store.enqueue([("i:1", store.new_entry(), True)])
    assert placement is not None
    return placement.pins


def test_a_snapshot_older_than_the_writers_last_is_not_written(redis_url) -> None:
    """A commit carrying pins that lands after a newer one of the same
    scheduler (a retried call, another connection) leaves the newer pins."""

    async def body(a: SequenceStore, b: SequenceStore, r) -> None:
        e1 = a.new_entry()
        await a.enqueue([("i:1", e1, False)])
        await a.claim([("i:1", e1, True, 0)])
        await a.commit([], pins=PinsSnapshot(5, {0: "inst-B", 1: "inst-A"}))
        await a.commit([], pins=PinsSnapshot(4, {0: "inst-A"}))  # late
        await a.commit([Finished("i:1", e1, False)])  # unchanged: nothing carried
        placement = await b.enqueue([("i:1", b.new_entry(), True)])
        assert placement == Placement({"i:1": 0}, {0: "inst-B", 1: "inst-A"})
        await a.commit([], pins=PinsSnapshot(6, {1: "inst-C"}))
        assert await _pins_found(b) == {1: "inst-C"}

    run(redis_url, body)
