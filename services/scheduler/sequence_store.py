"""Sequence routing and implicit state in Redis.

A sequence (one correlation id of one model version) lives in a Redis hash
that expires after max_sequence_idle_microseconds of inactivity: its slot
and the latest value of every implicit state. A short-lived busy key makes
sure only one request of a sequence executes at a time, across any number of
scheduler processes. Because nothing about a sequence stays only in memory,
a restarted scheduler (or a second one) continues it with the right state.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from stageserve import redis_keys as keys
from stageserve import redis_scripts as scripts

CLAIMED, UNKNOWN, BUSY = 0, 1, 2


def sequence_key(sequence_id: int, sequence_id_str: str) -> str:
    return f"s:{sequence_id_str}" if sequence_id_str else f"i:{sequence_id}"


@dataclass
class Claim:
    status: int
    slot: int = -1
    states: dict[str, bytes] = field(default_factory=dict)  # state output name -> raw


class SequenceStore:
    def __init__(self, redis: aioredis.Redis, model: str, version: int, idle_ms: int) -> None:
        self.redis = redis
        self.prefix = keys.sequence_prefix(model, version)
        self.owner = uuid.uuid4().hex
        self.idle_ms = max(1, idle_ms)
        self._claim = redis.register_script(scripts.SEQUENCE_CLAIM)

    async def claim(
        self, items: list[tuple[str, bool, int]], lease_ms: int = 60_000
    ) -> list[Claim]:
        """Claim (cid, start, slot) sequences for one execution each."""
        args: list[str | int] = [self.prefix, self.owner, lease_ms, self.idle_ms]
        for cid, start, slot in items:
            args += [cid, "1" if start else "0", slot]
        out = []
        for status, slot, fields in await self._claim(args=args):
            states = {}
            for k, v in zip(fields[::2], fields[1::2], strict=True):
                name = k.decode()
                if name.startswith("st:"):
                    states[name[3:]] = v
            out.append(Claim(int(status), int(slot), states))
        return out

    async def commit(self, results: list[tuple[str, bool, dict[str, bytes] | None]]) -> None:
        """After execution: keep each sequence's new states (None: unchanged), end
        the ones whose request had END, and free them for their next request."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for cid, end, states in results:
                key = self.prefix + cid
                if end:
                    pipe.delete(key)
                elif states:
                    pipe.hset(key, mapping={f"st:{k}": v for k, v in states.items()})
                    pipe.pexpire(key, self.idle_ms)
                pipe.delete(key + ":busy")
            await pipe.execute()
