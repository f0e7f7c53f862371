"""SchedulerRouter's resends, on a real Redis shard map and a real view; the
links are stand-ins that answer as a dead owner's and its heir's would."""

from __future__ import annotations

import asyncio

from stageserve.generated import stageserve_pb2 as pb
from stageserve.scheduler_link import SchedulerGone
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.shard_map import ShardView
from tests.unit.test_shard_leases import SHORT_LEASE_MS, run


class DeadOwnerLink:
    """Never connects: gives up (SchedulerGone) once the view drops it."""

    def __init__(self) -> None:
        self.give_up = None
        self.calls = 0

    async def schedule(self, request, on_more=None) -> pb.ScheduleResponse:
        self.calls += 1
        assert self.give_up is not None
        await self.give_up()
        raise SchedulerGone("left the shard map")

    async def close(self) -> None:
        pass


class HeirLink:
    """Refuses (NOT_OWNER) until `take` ran, as the heir does while Redis
    still counts the dead owner's lease; the first refusal starts `take`."""

    def __init__(self, take) -> None:
        self.give_up = None
        self.take = take
        self.taking: asyncio.Task | None = None
        self.refused = 0

    async def schedule(self, request, on_more=None) -> pb.ScheduleResponse:
        if self.taking is None or not self.taking.done():
            self.refused += 1
            if self.taking is None:
                self.taking = asyncio.ensure_future(self.take())
            return pb.ScheduleResponse(id=request.id, failure=pb.NOT_OWNER, message="refused")
        return pb.ScheduleResponse(id=request.id)

    async def close(self) -> None:
        pass


def test_a_request_waiting_on_a_dead_owner_is_resent_past_the_heirs_refusal(redis_url) -> None:
    """The view drops the dead owner b a moment before Redis counts its lease
    out: the request waiting to connect to b goes to the heir a, which still
    refuses it; the router resends it once a took the model, within its wait."""

    async def body(r, member, view: ShardView, drained) -> None:
        a, b = member("a"), member("b", SHORT_LEASE_MS)
        for step in (a, b, a):
            await step.tick()
        await asyncio.gather(*a._moves)
        await b.tick()
        model = sorted(b.owned)[0]
        follower = ShardView(r, poll_s=0.1)
        dead, heir = DeadOwnerLink(), HeirLink(a.tick)
        links = {"b:1": dead, "a:1": heir}
        router = SchedulerRouter(follower, None, lambda address: links[address], 5.0)  # type: ignore[arg-type, return-value]
        try:
            await follower.refresh()
            assert follower.route(model) == "b:1"
            response = await asyncio.wait_for(
                router.schedule(pb.ScheduleRequest(id=7, model=model)), 10.0
            )
            assert response.failure == pb.FAILURE_NONE, response
            assert dead.calls == 1 and heir.refused >= 1
            assert follower.owners[model] == "a"
        finally:
            await router.close()

    run(redis_url, body)


def test_refusals_past_the_wait_answer_not_owner(redis_url) -> None:
    """A model whose owner keeps refusing (its map never moves) gets the
    refusal back once the wait is over, not a hang."""

    async def body(r, member, view: ShardView, drained) -> None:
        a = member("a")
        await a.tick()
        model = sorted(a.owned)[0]
        follower = ShardView(r, poll_s=0.1)

        async def never() -> None:
            await asyncio.Event().wait()

        heir = HeirLink(never)
        router = SchedulerRouter(follower, None, lambda address: heir, 0.5)  # type: ignore[arg-type, return-value]
        try:
            await follower.refresh()
            loop = asyncio.get_running_loop()
            began = loop.time()
            response = await router.schedule(pb.ScheduleRequest(id=8, model=model))
            assert response.failure == pb.NOT_OWNER
            assert 0.4 < loop.time() - began < 3.0
            if heir.taking is not None:
                heir.taking.cancel()
        finally:
            await router.close()

    run(redis_url, body)


class LateOwnerLink:
    """The map names it owner already, yet it refuses the first request: it
    took the model in Redis a moment after that request came."""

    def __init__(self) -> None:
        self.give_up = None
        self.refused = 0

    async def schedule(self, request, on_more=None) -> pb.ScheduleResponse:
        if not self.refused:
            self.refused += 1
            return pb.ScheduleResponse(id=request.id, failure=pb.NOT_OWNER, message="refused")
        return pb.ScheduleResponse(id=request.id)

    async def close(self) -> None:
        pass


def test_a_refusal_from_the_owner_the_map_names_is_resent_soon(redis_url) -> None:
    """The map will not move (its owner is the one that refused): the resend
    goes after a short recheck, not after the whole 5 s wait."""

    async def body(r, member, view: ShardView, drained) -> None:
        a = member("a")
        await a.tick()
        model = sorted(a.owned)[0]
        follower = ShardView(r, poll_s=0.1)
        link = LateOwnerLink()
        router = SchedulerRouter(follower, None, lambda address: link, 5.0)  # type: ignore[arg-type, return-value]
        try:
            await follower.refresh()
            assert follower.owners[model] == "a"
            loop = asyncio.get_running_loop()
            started = loop.time()
            response = await router.schedule(pb.ScheduleRequest(id=9, model=model))
            assert response.failure == pb.FAILURE_NONE and link.refused == 1
            assert loop.time() - started < 1.5
        finally:
            await router.close()

    run(redis_url, body)
