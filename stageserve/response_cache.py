"""The response cache: a model's answers kept by request, so a repeated request
is answered by the gateway without reaching the scheduler, and a repeated
ensemble step by the scheduler without reaching a worker.

A model opts in with `response_cache { enable: true }` and the gateway holds a
cache when started with --cache-config (stageserve/cache_options.py):
`local` keeps an LRU of bytes in this gateway's memory, `redis` keeps it in
Redis, shared by every gateway of the stack.

The key (request_key) hashes what Triton's cache hashes (model name, version,
every input's name and bytes, inputs in name order) plus what makes two
requests' answers differ where Triton's key does not tell them apart: each
input's datatype and shape (Triton 2.51 answers a [2,2] request with the
[1,4] outputs cached for the same bytes sent as [1,4]), the requested outputs
(Triton 2.51 answers a request for OUTPUT1 with every output the first
request got) and the model's load generation (a reloaded model may compute
other answers). BLAKE2b-128 rather than Triton's 64-bit boost hash: a
collision would serve another request's answer.

An entry is the outputs (name, datatype, shape, bytes) as one serialized
ScheduleResponse, the message the scheduler answers with.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError

from stageserve import redis_keys as keys
from stageserve.cache_options import CacheConfig
from stageserve.generated import stageserve_pb2 as pb
from stageserve.redis_connect import connect, retry_options
from stageserve.settings import RedisClientSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheUsage:
    """A cache after an insertion: entries evicted by it, entries and bytes held."""

    evicted: int
    entries: int
    held: int


def request_key(
    model: str,
    version: int,
    generation: int,
    inputs: Iterable[pb.Tensor],
    outputs: Sequence[str],
) -> bytes:
    """The cache key of a request: 16 bytes. `outputs` are the requested output
    names ([] = all), in any order."""
    h = hashlib.blake2b(digest_size=16)

    def part(data: bytes) -> None:  # length-prefixed: no two field splits collide
        h.update(struct.pack("<Q", len(data)))
        h.update(data)

    part(model.encode())
    h.update(struct.pack("<qq", version, generation))
    tensors = sorted(inputs, key=lambda t: t.name)
    h.update(struct.pack("<Q", len(tensors)))
    for t in tensors:
        part(t.name.encode())
        part(t.datatype.encode())
        part(struct.pack(f"<{len(t.shape)}q", *t.shape))
        part(t.raw)
    names = sorted(set(outputs))
    h.update(struct.pack("<Q", len(names)))
    for name in names:
        part(name.encode())
    return h.digest()


def encode_entry(outputs: Iterable[pb.Tensor]) -> bytes:
    return pb.ScheduleResponse(outputs=outputs).SerializeToString()


def decode_entry(data: bytes) -> list[pb.Tensor] | None:
    """The outputs of an entry; None for bytes that are no entry (a foreign
    writer under our keys): the request then runs as a miss."""
    try:
        return list(pb.ScheduleResponse.FromString(data).outputs)
    except DecodeError:
        log.warning("response cache entry does not decode", extra={"bytes": len(data)})
        return None


class LruBytes:
    """Least recently used entries go first once the bytes held would pass
    `budget`; a value larger than the whole budget is not kept."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> bytes | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: bytes) -> bool:
        """False when the value is larger than the budget (not kept)."""
        size = len(value)
        if size > self.budget:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.held -= len(old)
        while self.held + size > self.budget:
            _, evicted = self._entries.popitem(last=False)
            self.held -= len(evicted)
            self.evictions += 1
        self._entries[key] = value
        self.held += size
        return True


class ResponseCache(Protocol):
    #: the budget, bytes
    size: int

    async def lookup(self, key: bytes) -> bytes | None: ...

    async def insert(self, key: bytes, value: bytes) -> CacheUsage | None:
        """Keep `value` (unless it is larger than the budget); the cache's
        usage after it, None when it cannot tell (a Redis error)."""
        ...

    async def close(self) -> None: ...


class LocalCache:
    """Triton's `local` cache: this gateway's memory, `size` bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lru = LruBytes(size)

    async def lookup(self, key: bytes) -> bytes | None:
        return self.lru.get(key)

    async def insert(self, key: bytes, value: bytes) -> CacheUsage:
        before = self.lru.evictions
        self.lru.put(key, value)
        return CacheUsage(self.lru.evictions - before, len(self.lru), self.lru.held)

    async def close(self) -> None:
        pass


# KEYS: entry prefix, recency zset, sizes hash, bytes held, clock. ARGV: key.
_LOOKUP = """
local value = redis.call('GET', KEYS[1] .. ARGV[1])
if value then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[1])
end
return value
"""
# ARGV: key, value, budget. Evicts least recently used entries until the value
# fits; returns {evicted, entries, bytes held} (evicted -1: a value over the
# budget, not kept).
_INSERT = """
local size = string.len(ARGV[2])
local budget = tonumber(ARGV[3])
if size > budget then
  return {-1, redis.call('ZCARD', KEYS[2]), tonumber(redis.call('GET', KEYS[4]) or '0')}
end
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then
  redis.call('DECRBY', KEYS[4], old)
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local held = tonumber(redis.call('GET', KEYS[4]) or '0')
local evicted = 0
while held + size > budget do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then held = 0; break end
  local bytes = tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('DEL', KEYS[1] .. oldest[1])
  redis.call('HDEL', KEYS[3], oldest[1])
  held = held - bytes
  evicted = evicted + 1
end
redis.call('SET', KEYS[1] .. ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[1])
redis.call('SET', KEYS[4], held + size)
return {evicted, redis.call('ZCARD', KEYS[2]), held + size}
"""


class RedisCache:
    """The cache in Redis under stageserve/redis_keys.py's response-cache keys,
    shared by every gateway that uses the same Redis. Its own accounting keeps
    the entries under `size` bytes (LRU by a Redis-side clock, one Lua script
    per lookup or insert, so gateways racing on one key stay consistent). A
    Redis error is a miss (lookup) or a skipped insert, logged, never a failed
    request."""

    def __init__(self, redis: aioredis.Redis, size: int, owned: bool = False) -> None:
        self.redis = redis
        self.size = size
        self.owned = owned  # a Redis of its own (--cache-config redis,host=...): closed here
        self._keys = [
            keys.CACHE_ENTRY_PREFIX,
            keys.CACHE_RECENCY,
            keys.CACHE_SIZES,
            keys.CACHE_BYTES,
            keys.CACHE_CLOCK,
        ]
        self._lookup = redis.register_script(_LOOKUP)
        self._insert = redis.register_script(_INSERT)

    async def lookup(self, key: bytes) -> bytes | None:
        try:
            value = await self._lookup(keys=self._keys, args=[key.hex()])
        except Exception as exc:  # Redis away: answer from the model
            log.warning("response cache lookup failed", extra={"error": str(exc)})
            return None
        return bytes(value) if value is not None else None

    async def insert(self, key: bytes, value: bytes) -> CacheUsage | None:
        try:
            evicted, entries, held = await self._insert(
                keys=self._keys, args=[key.hex(), value, self.size]
            )
        except Exception as exc:
            log.warning("response cache insert failed", extra={"error": str(exc)})
            return None
        return CacheUsage(max(int(evicted), 0), int(entries), int(held))

    async def held_bytes(self) -> int:
        return int(await self.redis.get(keys.CACHE_BYTES) or 0)

    async def close(self) -> None:
        if self.owned:
            await self.redis.aclose()


def open_cache(
    config: CacheConfig | None, stack_redis: aioredis.Redis, client: RedisClientSettings
) -> ResponseCache | None:
    """The cache --cache-config asks for: `stack_redis` (the stack's own) for a
    redis cache without a host."""
    if config is None:
        return None
    if config.kind == "local":
        return LocalCache(config.size)
    if not config.host:
        return RedisCache(stack_redis, config.size)
    return RedisCache(_own_redis(config, client), config.size, owned=True)


def _own_redis(config: CacheConfig, client: RedisClientSettings) -> aioredis.Redis:
    """The client of a cache's own Redis, with Triton's redis cache options:
    timeouts in ms (0: none), pool_size connections waited for up to
    wait_timeout ms (no pool_size: unbounded)."""
    options: dict[str, Any] = {
        "socket_connect_timeout": config.connect_timeout / 1000 or None,
        "socket_timeout": config.socket_timeout / 1000 or None,
    }
    if not config.pool_size:
        return connect(config.redis_url(), client, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        config.redis_url(),
        max_connections=config.pool_size,
        timeout=config.wait_timeout / 1000,
        **retry_options(client),
        **options,
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool
