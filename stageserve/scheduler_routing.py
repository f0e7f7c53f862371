"""Route each request to the scheduler that owns its model.

Schedulers are sharded by model (stageserve/shard_map.py): the router looks
the model up in its ShardView (a dict lookup, no Redis on the hot path) and
sends the request on one SchedulerLink per scheduler address. A scheduler
that no longer owns the model refuses it with NOT_OWNER before queueing it,
so the request ran nowhere; the router waits for the map to move and
resends it to the new owner, as often as it is refused within
`resend_wait_s`.

With no live scheduler registered in Redis (a stage started alone with
--scheduler, before any scheduler registered), requests go to `fallback`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from stageserve.errors import unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.scheduler_link import SchedulerGone, SchedulerLink
from stageserve.settings import Settings
from stageserve.shard_map import ShardView

log = logging.getLogger(__name__)

# Long enough for a release (its queue's last batch drains first) and for a
# dead owner's lease to run out and a survivor to take the model.
RESEND_WAIT_S = 5.0
# After a refusal, how long a resend waits for the map to move before it goes
# again anyway. The map may already name the refusing scheduler as owner: it
# took the model in Redis a moment after it refused (a dead owner's heir), and
# then the map never moves; waiting for a move would hold the request for the
# whole RESEND_WAIT_S (seen: a sequence answered 8 s after its scheduler was
# killed, 5 s after the heir took the model).
RESEND_RECHECK_S = 0.25


class SchedulerRouter:
    def __init__(
        self,
        view: ShardView | None,
        fallback: str | None,
        make_link: Callable[[str], SchedulerLink],
        resend_wait_s: float = RESEND_WAIT_S,
    ) -> None:
        self.view = view
        self.fallback = fallback
        self.make_link = make_link
        self.resend_wait_s = resend_wait_s
        self.links: dict[str, SchedulerLink] = {}

    def address_for(self, model: str) -> str:
        address = self.view.route(model) if self.view is not None else None
        address = address or self.fallback
        if not address:
            raise unavailable(f"no scheduler is registered to serve model '{model}'")
        return address

    def link(self, address: str) -> SchedulerLink:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = self.make_link(address)
            view = self.view
            if view is not None and link.give_up is None:  # a dead owner's heir gets it
                link.give_up = lambda: view.gone(address)
        return link

    async def schedule(
        self,
        request: pb.ScheduleRequest,
        on_more: Callable[[pb.ScheduleResponse], None] | None = None,
    ) -> pb.ScheduleResponse:
        """As SchedulerLink.schedule, on the owner of `request.model`."""
        if self.view is None:
            return await self.link(self.address_for(request.model)).schedule(request, on_more)
        self.view.start()  # follows the map from the first call on (idempotent)
        # Refused (NOT_OWNER) or its scheduler left the map before the link
        # connected (SchedulerGone): either way it ran nowhere, so resend as
        # the map moves, within the wait. More than once: a view sees a dead
        # owner's lease run out a moment before Redis does (it times the lease
        # from before its read), so the heir refuses a resend that comes in
        # that moment, whether it followed a refusal or a gone link.
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        address = self.address_for(request.model)
        while True:
            try:
                response = await self.link(address).schedule(request, on_more)
            except SchedulerGone:
                if deadline is not None and loop.time() >= deadline:
                    raise
                deadline = deadline or loop.time() + self.resend_wait_s
                address = self.address_for(request.model)  # the view dropped it: the heir
                continue
            if response.failure != pb.NOT_OWNER:
                return response
            deadline = deadline or loop.time() + self.resend_wait_s
            left = deadline - loop.time()
            if left <= 0:
                return response
            await self.view.moved(request.model, address, min(left, RESEND_RECHECK_S))
            address = self.address_for(request.model)

    async def close(self) -> None:
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        if self.view is not None:
            await self.view.close()


async def scheduler_router(
    redis: aioredis.Redis, fallback: str | None, settings: Settings, hold_us: int | None = None
) -> SchedulerRouter:
    """A gateway's (or a worker's BLS) router, following the shard map from now
    on. `hold_us`: the links' write hold (default: the gateway's setting;
    0 for a worker's BLS calls, which a model's execute waits on)."""
    gateway = settings.gateway
    hold = gateway.scheduler_link_hold_us if hold_us is None else hold_us
    view = ShardView(redis)
    try:
        await view.refresh()
    except RedisError as exc:  # routes to `fallback` until the follower reads the map
        log.warning("shard map unreadable", extra={"error": str(exc)})
    view.start()
    return SchedulerRouter(
        view,
        fallback,
        lambda address: SchedulerLink(
            address,
            gateway.scheduler_connect_timeout_s,
            settings.stage_tls,
            hold,
            client=gateway.stream_client,
        ),
    )
