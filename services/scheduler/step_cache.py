"""The response cache inside an ensemble: a composing model that enables
`response_cache` answers a step from the cache, as Triton 2.51 does (checked:
tests/integration/test_response_cache.py, test_ensembles_match_triton).

The key is the one the gateway gives a request to that model
(stageserve/response_cache.py request_key), so a step hits what a direct
request stored, and the other way round. With a `redis` cache that is one
cache for the whole stack; a `local` cache is this scheduler's memory.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.response_cache import ResponseCache, decode_entry, encode_entry, request_key


class StepCache:
    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def run(
        self,
        request: pb.ScheduleRequest,
        spec: ModelSpec,
        stat: pb.StepStat,
        execute: Callable[[], Awaitable[pb.ScheduleResponse]],
    ) -> pb.ScheduleResponse:
        """The step's response: from the cache, or `execute`d and kept. `stat`
        says which (cache_hit, cache_miss) and what the cache cost (cache_ns)."""
        if not spec.response_cache:
            return await execute()
        looked = time.monotonic_ns()
        # every output named is the same entry as none named (all), as at the gateway
        named = set(request.outputs)
        outputs = [] if named == {t.name for t in spec.outputs} else list(request.outputs)
        key = request_key(
            spec.name, request.version, request.config_generation, request.inputs, outputs
        )
        data = await self.cache.lookup(key)
        hit = decode_entry(data) if data is not None else None
        lookup_ns = time.monotonic_ns() - looked
        if hit is not None:
            stat.cache_hit, stat.cache_ns = True, lookup_ns
            return pb.ScheduleResponse(id=request.id, outputs=hit)
        resp = await execute()
        if resp.failure:
            return resp
        inserted = time.monotonic_ns()
        await self.cache.insert(key, encode_entry(resp.outputs))
        stat.cache_miss = True
        stat.cache_ns = lookup_ns + time.monotonic_ns() - inserted
        return resp

    async def close(self) -> None:
        await self.cache.close()
