"""Audit of the rate limiter's and the sequence batcher's state in Redis.

One Lua script takes an atomic snapshot (the scripts that change this state
are atomic too, so the invariants hold at any instant, under load), and
Audit checks it: every registered instance is either free or held by one
live grant, never both, never twice; no grant outlived its lease (the sweep
releases them within 250 ms); no dead worker stays registered; every
sequence key expires (max_sequence_idle_microseconds) so a sequence that
lost its scheduler holds nothing for ever.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import redis

from stageserve import redis_keys as keys
from stageserve.tensor_region import slots_in_use
from stageserve.tensor_shm import stack_id

# A grant past its deadline by more than this is leaked (the sweep runs every 250 ms).
GRANT_GRACE_MS = 1000

_SNAPSHOT = """
local p, sp, op = ARGV[1], ARGV[2], ARGV[3]
local pools = {}
for _, key in ipairs(redis.call('KEYS', p .. 'pool:*')) do
  local pk = string.sub(key, #p + 6)
  local free = redis.call('LRANGE', p .. 'free:' .. pk, 0, -1)
  pools[#pools + 1] = {pk, redis.call('SMEMBERS', key), free}
end
local grants = {}
local zs = redis.call('ZRANGE', p .. 'grants', 0, -1, 'WITHSCORES')
for i = 1, #zs, 2 do
  local g = redis.call('HMGET', p .. 'grant:' .. zs[i], 'instance', 'model', 'version')
  grants[#grants + 1] = {zs[i], zs[i + 1], g[1] or '', (g[2] or '') .. ':' .. (g[3] or '')}
end
local dead = 0
for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  if redis.call('EXISTS', p .. 'worker:' .. wid) == 0 then dead = dead + 1 end
end
local forever, orphans = 0, 0
for _, key in ipairs(redis.call('KEYS', sp .. '*')) do
  if redis.call('PTTL', key) == -1 then forever = forever + 1 end
  if string.sub(key, -2) == ':q' then
    local head = redis.call('LINDEX', key, 0)
    if head and redis.call('EXISTS', op .. string.match(head, '^[^:]*')) == 0 then
      orphans = orphans + 1
    end
  end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {pools, grants, dead, forever, orphans, now_ms}
"""


@dataclass
class Audit:
    instances: int = 0  # registered, all models
    free: int = 0
    grants: int = 0
    lost_instances: int = 0  # registered, neither free nor granted: capacity gone for good
    double_booked: int = 0  # free and granted at once, or free twice, or granted twice
    stray: int = 0  # free entries or grants naming no registered instance
    expired_grants: int = 0  # past their lease beyond the sweep's reach
    dead_workers: int = 0  # registered without a liveness key
    sequence_keys_without_expiry: int = 0
    orphan_sequence_heads: int = 0  # owner gone; dropped at the next claim or on idle expiry
    problems: list[str] = field(default_factory=list)

    @property
    def leaked(self) -> int:
        return (
            self.lost_instances
            + self.double_booked
            + self.stray
            + self.expired_grants
            + self.dead_workers
            + self.sequence_keys_without_expiry
        )

    def summary(self) -> str:
        return (
            f"{self.instances} instances ({self.free} free, {self.grants} granted); "
            f"{self.orphan_sequence_heads} orphan sequence heads (expiring)"
            + ("; " + "; ".join(self.problems) if self.problems else "")
        )


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def audit_snapshot(snapshot: list) -> Audit:
    pools, grants, dead, forever, orphans, now_ms = snapshot
    audit = Audit(
        dead_workers=int(dead),
        sequence_keys_without_expiry=int(forever),
        orphan_sequence_heads=int(orphans),
    )
    granted: Counter[str] = Counter()
    registered_all: set[str] = set()
    for gid, deadline, iid, _pool in grants:
        audit.grants += 1
        if float(deadline) + GRANT_GRACE_MS < int(now_ms):
            audit.expired_grants += 1
            audit.problems.append(f"grant {_s(gid)} past its lease")
        if iid:
            granted[_s(iid)] += 1
    for pk, members, free in pools:
        registered = {_s(m) for m in members}
        registered_all |= registered
        free_ids = Counter(_s(f) for f in free)
        audit.instances += len(registered)
        audit.free += sum(free_ids.values())
        for iid in registered:
            holds = free_ids.get(iid, 0) + granted.get(iid, 0)
            if holds == 0:
                audit.lost_instances += 1
                audit.problems.append(f"{iid} neither free nor granted")
            elif holds > 1:
                audit.double_booked += 1
                audit.problems.append(f"{iid} free/granted {holds} times")
        for iid in free_ids:
            if iid not in registered:
                audit.stray += 1
                audit.problems.append(f"free entry {iid} of {_s(pk)} not registered")
    for iid in granted:
        if iid not in registered_all:
            audit.stray += 1
            audit.problems.append(f"grant on unregistered {iid}")
    if audit.dead_workers:
        audit.problems.append(f"{audit.dead_workers} dead workers registered")
    if audit.sequence_keys_without_expiry:
        audit.problems.append(f"{audit.sequence_keys_without_expiry} sequence keys never expire")
    return audit


def tensor_slots_in_use(redis_url: str) -> int:
    """Shared-memory tensor slots held in the stack's regions (tensor_shm on;
    stageserve/tensor_shm.py), after dead processes' regions and slots are
    reclaimed: 0 once the load stopped and its answers were taken, or a leak."""
    return sum(slots_in_use(stack_id(redis_url)).values())


def audit_redis(redis_url: str, attempts: int = 50) -> Audit:
    """Snapshot and audit; retried while Redis is (re)starting."""
    client = redis.Redis.from_url(redis_url)
    try:
        for attempt in range(attempts):
            try:
                snapshot = client.eval(
                    _SNAPSHOT,
                    0,
                    keys.RL_PREFIX,
                    keys.PREFIX + "seq:",
                    keys.sequence_owner(""),
                )
                return audit_snapshot(snapshot)
            except redis.ConnectionError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")
    finally:
        client.close()
