"""Triton's cache-wide metrics (the `nv_cache_*` gauges without labels) for
the gateway's response cache.

Triton 2.51 with `--cache-config local,size=...` exposes these from its
start, all 0 (checked, tests/integration/test_response_cache.py diffs them):

* nv_cache_num_lookups, nv_cache_num_hits, nv_cache_num_misses: lookups of
  requests to models that enable the cache, and how they ended;
* nv_cache_lookup_duration, nv_cache_insertion_duration: their total time
  (lookups hit and miss; insertions, one per miss), microseconds;
* nv_cache_num_evictions: entries removed to make room;
* nv_cache_num_entries, nv_cache_util: what the cache holds now, and its
  bytes over its size (0.0 to 1.0).

Counts and durations are this gateway's. Entries and utilization are the
cache's: with a `redis` cache, shared by every gateway on that Redis, the
whole stack's entries as the last insertion through this gateway left them.
"""

from __future__ import annotations

from stageserve.response_cache import CacheUsage
from stageserve.telemetry import CACHE_COUNTS, CACHE_STATE, TRITON, TritonMetrics


class CacheMetrics:
    """Keeps the cache-wide gauges of a cache of `size` bytes."""

    def __init__(self, size: int, metrics: TritonMetrics = TRITON) -> None:
        self.size = size
        self.metrics = metrics
        for name in (*CACHE_COUNTS, *CACHE_STATE):
            metrics.set(name, (), 0.0)

    def looked_up(self, hit: bool, ns: int) -> None:
        inc = self.metrics.inc
        inc("nv_cache_num_lookups", ())
        inc("nv_cache_num_hits" if hit else "nv_cache_num_misses", ())
        inc("nv_cache_lookup_duration", (), ns // 1000)

    def inserted(self, usage: CacheUsage | None, ns: int) -> None:
        """An insertion that took `ns`; `usage` None: the cache could not tell
        (a Redis error), the entries and utilization stay as they were."""
        self.metrics.inc("nv_cache_insertion_duration", (), ns // 1000)
        if usage is None:
            return
        self.metrics.inc("nv_cache_num_evictions", (), usage.evicted)
        self.metrics.set("nv_cache_num_entries", (), float(usage.entries))
        self.metrics.set("nv_cache_util", (), usage.held / self.size if self.size else 0.0)
