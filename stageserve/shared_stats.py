"""ModelStatistics across every gateway: each one publishes its own figures
to Redis about once a second, and answers ModelStatistics with its live
figures plus the others' latest.

Several gateways behind one address (SO_REUSEPORT, a Kubernetes Service)
each see part of the traffic; a client asking any of them gets the model's
totals, at most GatewaySettings.stats_publish_s behind for the other gateways'
share. Figures are kept per model load (generation): a reload starts them afresh, and a gateway
that stops leaves its share in the totals until then, as counts since the
model was loaded should.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import redis.asyncio as aioredis

from stageserve import redis_keys as keys
from stageserve import task_stop
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.statistics import StatsBook, merge

log = logging.getLogger(__name__)

# A model load's figures outlive it by this much (a later load uses new keys).
KEEP_MS = 7 * 24 * 3600 * 1000


class SharedStats:
    def __init__(self, redis: aioredis.Redis, book: StatsBook, publish_s: float) -> None:
        self.redis = redis
        self.publish_s = publish_s
        self.book = book
        self.gateway_id = uuid.uuid4().hex
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._publish_loop())

    async def close(self) -> None:
        if self._task is not None:
            await task_stop.stop(self._task)
        with contextlib.suppress(Exception):  # last figures, on a clean stop
            await self.publish()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.publish_s)
            try:
                await self.publish()
            except Exception as exc:  # Redis away: try again next round
                log.warning("publishing statistics failed", extra={"error": str(exc)})

    async def publish(self) -> None:
        items = self.book.items()
        if not items:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, version, generation, stats in items:
                key = keys.model_stats(model, generation, version)
                data = stats.to_pb(model, version).SerializeToString()
                pipe.hset(key, self.gateway_id, data)
                pipe.pexpire(key, KEEP_MS)
            await pipe.execute()

    async def totals(self, wanted: list[tuple[str, int, int]]) -> list[gs.ModelStatistics]:
        """(model, version, generation) -> this gateway's live figures plus
        every other gateway's latest, added up."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, version, generation in wanted:
                pipe.hgetall(keys.model_stats(model, generation, version))
            published = await pipe.execute()
        out = []
        for (model, version, _), others in zip(wanted, published, strict=True):
            parts = [self.book.of(model, version).to_pb(model, version)]
            for gateway, data in others.items():
                if gateway.decode() != self.gateway_id:
                    parts.append(gs.ModelStatistics.FromString(data))
            out.append(merge(parts))
        return out
