"""Put the model set back into a Redis that lost it (restarted empty, flushed).

The gateway is the one stage that knows what is loaded; the others read it
from Redis. A marker key (keys.MODELS_PUBLISHED) says that Redis holds the
gateway's model set: it is written here at startup and after every
republish, and Redis loses it with everything else. While it is missing,
workers keep the instances they host instead of reading "nothing is loaded"
(stageserve/model_state.py), and this loop, every PERIOD_S, publishes each
loaded model again with the generation it had, so workers keep those
instances and the gateway keeps counting statistics under the same load.
The generation counter is raised to at least the highest generation
republished, so a later reload gets a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from services.gateway.models import ModelManager
from stageserve import redis_keys as keys
from stageserve.settings import GATEWAY

log = logging.getLogger(__name__)

# How soon a lost model set is noticed: a check is one EXISTS.
PERIOD_S = GATEWAY.republish_check_s

_RAISE_COUNTER = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
"""


class Republisher:
    def __init__(self, models: ModelManager, redis: aioredis.Redis) -> None:
        self.models = models
        self.redis = redis
        self._raise_counter = redis.register_script(_RAISE_COUNTER)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run_forever(self) -> None:
        while True:
            try:
                await self.check()
            except Exception as exc:  # Redis away: try again next round
                log.warning("model set check failed", extra={"error": str(exc)})
            await asyncio.sleep(PERIOD_S)

    async def check(self) -> int:
        """Republish when the marker is gone; returns how many models were."""
        if await self.redis.exists(keys.MODELS_PUBLISHED):
            return 0
        # A model being (un)loaded right now publishes its own record.
        entries = [
            e
            for e in self.models.entries.values()
            if e.config is not None and e.versions and not self.models.is_busy(e.name)
        ]
        async with self.redis.pipeline(transaction=True) as pipe:
            for e in entries:
                assert e.config is not None
                pipe.hset(
                    keys.model(e.name),
                    mapping={
                        "config": e.config.SerializeToString(),
                        "versions": ",".join(str(v) for v in sorted(e.versions)),
                        "path": str(self.models.repository / e.name),
                        "generation": e.generation,
                    },
                )
                pipe.hset(keys.MODELS, e.name, e.generation)
            pipe.set(keys.MODELS_PUBLISHED, "1")
            for e in entries:
                pipe.publish(keys.MODEL_EVENTS, e.name)
            await pipe.execute()
        if entries:
            await self._raise_counter(
                keys=[keys.GENERATION_COUNTER], args=[max(e.generation for e in entries)]
            )
            log.warning(
                "Redis had lost the model set; republished it",
                extra={"models": sorted(e.name for e in entries)},
            )
        return len(entries)
