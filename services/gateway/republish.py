"""Put the model set back into a Redis that lost it (restarted empty, flushed).

The gateway is the one stage that knows what is loaded; the others read it
from Redis. Each gateway holds a publication mark there (keys.MODEL_PUBLISHERS,
a lease of GatewaySettings.publication_lease_ms renewed every
republish_check_s). When its mark is gone, Redis lost its data (or this
gateway stalled past its lease): it writes back the record
of each model it serves, with the generation it had, where Redis holds none,
then marks again. Workers keep every instance they host while a gateway they
saw has no mark (services/worker/publishers.py), so a gateway that marks
first, e.g. one restarting with nothing loaded at that very moment, cannot
make them unload the models another gateway serves. The generation counter
is raised to at least the highest generation republished, so a later reload
gets a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket

import redis.asyncio as aioredis

from services.gateway.model_lifecycle import ModelLifecycle
from stageserve import redis_keys as keys
from stageserve import task_stop
from stageserve.model_state import files_digest
from stageserve.settings import GatewaySettings

log = logging.getLogger(__name__)

_RAISE_COUNTER = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
"""


class Republisher:
    def __init__(
        self, models: ModelLifecycle, redis: aioredis.Redis, settings: GatewaySettings
    ) -> None:
        self.models = models
        # How soon a lost model set is noticed: a check is one script call.
        self.period_s = settings.republish_check_s
        self.lease_ms = settings.publication_lease_ms
        self.redis = redis
        # Unique per process: a restarted gateway is a new publisher.
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._raise_counter = redis.register_script(_RAISE_COUNTER)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever())

    async def close(self) -> None:
        if self._task is not None:
            await task_stop.stop(self._task)
        with contextlib.suppress(Exception):  # Redis away: the lease ends it
            await self.models.state.withdraw_mark(self.gateway_id)

    async def _run_forever(self) -> None:
        while True:
            try:
                await self.check()
            except Exception as exc:  # Redis away: try again next round
                log.warning("model set check failed", extra={"error": str(exc)})
            await asyncio.sleep(self.period_s)

    async def check(self) -> int:
        """Republish when this gateway's mark is gone; returns how many models were."""
        state = self.models.state
        if await state.mark_published(self.gateway_id, self.lease_ms, renew_only=True):
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
                path = e.path or self.models.repository / e.name
                await state.republish(
                    e.config,
                    tuple(sorted(e.versions)),
                    path,
                    e.generation,
                    files_digest(e.fingerprint),
                    client=pipe,
                )
            await pipe.execute()
        # Records first, then the mark: a worker that sees the mark sees them.
        await state.mark_published(self.gateway_id, self.lease_ms, renew_only=False)
        if entries:
            await self._raise_counter(
                keys=[keys.GENERATION_COUNTER], args=[max(e.generation for e in entries)]
            )
            log.warning(
                "publication mark was gone (Redis lost its data?); republished",
                extra={"models": sorted(e.name for e in entries), "gateway": self.gateway_id},
            )
        return len(entries)
