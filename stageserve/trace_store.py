"""The stack's trace settings in Redis, so every gateway answers and samples
by the same ones (stageserve/tracing.py holds the rules).

The settings are one JSON document; each setting's remaining count lives
apart in a hash, by the setting's uid, because sampling takes from it on
every traced request (a Lua decrement, atomic across gateways) while the
document changes only on a TraceSetting update (WATCH/MULTI, then a
publish on the events channel so the other gateways reload). Sampling by
rate is per gateway (every rate-th request each gateway sees): only a
sampled request touches Redis, never an untraced one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from stageserve import redis_keys as keys
from stageserve.tracing import TraceConfig, TraceState, Update

_TAKE = """
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c then return 0 end
c = tonumber(c)
if c < 0 then return 1 end
if c == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
return 1
"""


def new_uid() -> str:
    return uuid.uuid4().hex[:16]


def _uids():
    while True:
        yield new_uid()


class TraceStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._take = redis.register_script(_TAKE)

    async def seed(self, config: TraceConfig) -> None:
        """The startup settings, unless the stack has some already (another
        gateway's, or this one's before a restart: updates are kept)."""
        state = TraceState.initial(config, new_uid())
        doc = json.dumps(state.to_json())
        if await self.redis.set(keys.TRACE_STATE, doc, nx=True):
            await self.redis.hset(keys.TRACE_COUNTS, state.global_.uid, state.global_.values.count)

    async def load(self) -> TraceState | None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(keys.TRACE_STATE)
            pipe.hgetall(keys.TRACE_COUNTS)
            raw, counts = await pipe.execute()
        if raw is None:
            return None
        state = TraceState.from_json(json.loads(raw))
        return state.with_counts({_text(k): int(v) for k, v in counts.items()})

    async def update(self, model: str, update: Update) -> TraceState:
        """Apply one update atomically; TraceSettingError as Triton refuses it."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(keys.TRACE_STATE, keys.TRACE_COUNTS)
                    raw = await pipe.get(keys.TRACE_STATE)
                    counts = await pipe.hgetall(keys.TRACE_COUNTS)
                    if raw is None:
                        state = TraceState.initial(TraceConfig(), new_uid())
                    else:
                        state = TraceState.from_json(json.loads(raw))
                    state = state.with_counts({_text(k): int(v) for k, v in counts.items()})
                    after = state.apply(model, update, _uids())
                    old = {s.uid for s in state.settings()}
                    new = {s.uid: s.values.count for s in after.settings()}
                    pipe.multi()
                    pipe.set(keys.TRACE_STATE, json.dumps(after.to_json()))
                    gone = old - set(new)
                    if gone:
                        pipe.hdel(keys.TRACE_COUNTS, *gone)
                    pipe.hset(keys.TRACE_COUNTS, mapping=cast(Any, new))
                    pipe.publish(keys.TRACE_EVENTS, model)
                    await pipe.execute()
                    return after
                except WatchError:
                    continue

    async def take(self, uid: str) -> bool:
        """One trace from the setting's count: False when it ran out."""
        return bool(await self._take(keys=[keys.TRACE_COUNTS], args=[uid]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
