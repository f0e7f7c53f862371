"""A process's local copy of the model -> scheduler map kept in Redis.

Schedulers write the map (services/scheduler/shard_member.py: leases, take,
release); gateways, workers' BLS clients and schedulers read it through a
ShardView. The view is refreshed when the map changes (pub/sub on
ss:shard:events, and a poll of ss:shard:version every `poll_s` in case a
message was missed or Redis restarted), so routing a request is a dict
lookup: the hot path never reads Redis.

A model with no live owner in the map (just loaded, or its owner's lease
ran out and no one has taken it yet) routes to the scheduler the policy
names among the live ones; that scheduler takes it on its first request.

A lease that runs out changes nothing in Redis until a survivor's heartbeat
prunes it (then the version bumps). The view does not wait for that: it
notes when the earliest live lease it read runs out and re-reads the map
at the first poll past it, so a scheduler that stopped renewing leaves
every view's routing within `lease + poll_s` even with no survivor pruning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from stageserve import redis_keys as keys
from stageserve import task_stop
from stageserve.shard_policy import DEFAULT_POLICY, ShardPolicy

log = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_now_ms(time_reply: tuple[int, int]) -> int:
    """Redis TIME (seconds, microseconds) in ms: every process compares
    lease deadlines against the one clock, never its own."""
    return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000


class ShardView:
    def __init__(
        self, redis: aioredis.Redis, policy: ShardPolicy = DEFAULT_POLICY, poll_s: float = 1.0
    ) -> None:
        self.redis = redis
        self.policy = policy
        self.poll_s = poll_s
        self.version = -1  # ss:shard:version when last read; -1: never read
        self.owners: dict[str, str] = {}  # model -> scheduler id, as written
        self.addresses: dict[str, str] = {}  # live scheduler id -> address
        self._next: asyncio.Future[None] | None = None  # resolved on the next change
        # loop.time() when the earliest live lease read runs out (re-read then)
        self.lease_ends = float("inf")
        self._refreshing: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None

    # Routing ---------------------------------------------------------------

    def owner(self, model: str) -> str | None:
        """The live scheduler id that owns (or is to take) `model`."""
        owner = self.owners.get(model)
        if owner is not None and owner in self.addresses:
            return owner
        return self.policy.owner(model, self.addresses)

    def route(self, model: str) -> str | None:
        """The address of `model`'s scheduler (None: no live scheduler known)."""
        owner = self.owner(model)
        return None if owner is None else self.addresses.get(owner)

    # Reading the map -------------------------------------------------------

    async def refresh(self) -> None:
        """Read the map now; concurrent callers share one read."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._read())
        await asyncio.shield(self._refreshing)

    async def _read(self) -> None:
        started = asyncio.get_running_loop().time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.time()
            pipe.get(keys.SHARD_VERSION)
            pipe.hgetall(keys.SHARD_OWNERS)
            pipe.zrange(keys.SHARD_MEMBERS, 0, -1, withscores=True)
            pipe.hgetall(keys.SHARD_ADDRESSES)
            now, version, owners, members, addresses = await pipe.execute()
        now_ms = redis_now_ms(now)
        deadlines = [deadline for _, deadline in members if deadline >= now_ms]
        live = {_text(m) for m, deadline in members if deadline >= now_ms}
        # Timed from before the read went out: never later than Redis's.
        ends_ms = min(deadlines, default=None)
        self.lease_ends = float("inf") if ends_ms is None else started + (ends_ms - now_ms) / 1000
        self.owners = {_text(m): _text(s) for m, s in owners.items()}
        addresses_now = {_text(s): _text(a) for s, a in addresses.items() if _text(s) in live}
        expired = addresses_now != self.addresses
        self.addresses = addresses_now
        new_version = int(version or 0)
        if new_version != self.version or expired:
            self.version = new_version
            if self._next is not None and not self._next.done():
                self._next.set_result(None)
            self._next = None

    async def wait_past(self, version: int, timeout_s: float) -> bool:
        """Wait until the map's version differs from `version` (a move the
        caller was told of is done); False if it did not within `timeout_s`."""
        if self.version == version:
            with contextlib.suppress(Exception):
                await self.refresh()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.version == version:
            if self._next is None or self._next.done():
                self._next = loop.create_future()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._next), min(left, self.poll_s / 4))
            if self.version == version:  # no message yet: read, a missed one costs a poll
                with contextlib.suppress(Exception):
                    await self.refresh()
        return True

    async def moved(self, model: str, address: str, timeout_s: float) -> bool:
        """Wait until `model` no longer routes to `address` (the scheduler that
        refused it) or its owner in the map changed (that scheduler took it
        after all); False if neither happened within `timeout_s`."""
        owner = self.owners.get(model)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.route(model) == address and self.owners.get(model) == owner:
            left = deadline - loop.time()
            if left <= 0 or not await self.wait_past(self.version, left):
                return False
        return True

    async def gone(self, address: str) -> None:
        """Return once `address`, a live scheduler's now, is no longer; never
        for an address that is not in the map now (--scheduler's fallback)."""
        if address not in self.addresses.values():
            await asyncio.get_running_loop().create_future()  # until cancelled
        while address in self.addresses.values():
            if self._next is None or self._next.done():
                self._next = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._next)

    # Following changes -----------------------------------------------------

    def start(self) -> None:
        if self._follower is None:
            self._follower = asyncio.create_task(self._follow_forever())

    async def _follow_forever(self) -> None:
        failures = 0
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            while True:
                try:
                    if not pubsub.subscribed:
                        await pubsub.subscribe(keys.SHARD_EVENTS)
                        await self.refresh()  # what changed while unsubscribed
                        failures = 0
                    message = await pubsub.get_message(timeout=self.poll_s)
                    if message is not None:
                        await self.refresh()
                    elif asyncio.get_running_loop().time() >= self.lease_ends:
                        await self.refresh()  # a lease ran out: drop its scheduler
                    else:
                        version = await self.redis.get(keys.SHARD_VERSION)
                        if int(version or 0) != self.version:
                            await self.refresh()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away: routing keeps the last map
                    if not failures:
                        log.warning("shard map unreadable", extra={"error": str(exc)})
                    failures += 1
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    await asyncio.sleep(min(self.poll_s * 2**failures, 5.0))
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def close(self) -> None:
        if self._follower is not None:
            await task_stop.stop(self._follower)
            self._follower = None
