"""Instance registry, execution grants and resource counts, kept in Redis by
atomic scripts.

One payload per instance at a time: an instance id sits in its model's free
list until a grant takes it, and goes back on release. With
`--rate-limit=execution_count` a grant also takes the instance's
rate_limiter resources (Triton's rate limiter; see lua.ACQUIRE).
Grants carry a lease and workers a liveness key, so a crashed scheduler or
worker leaks nothing: the sweep releases expired grants (and their
resources) and removes workers whose key expired. A grant's id begins with
its holder ("<scheduler id>/<incarnation>") when the scheduler gives it, so
the next process of that scheduler id ends what a killed one held at once
(`release_holder`) instead of after the leases.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis

from services.ratelimiter import lua as scripts
from services.ratelimiter.options import OFF, RATE_LIMIT_MODES
from stageserve import redis_keys as keys
from stageserve.settings import RateLimiterSettings

# How long an Acquire's demand counts when other pools weigh their scaled
# priority against it: longer than the gap between a scheduler's release and
# its next Acquire (a few ms), short enough that a pool whose traffic stopped
# delays the others by at most this once.
DEMAND_TTL_MS = 100
# How long a busy answer keeps the asking rate limiter in the pool's waiting
# set (refreshed by each busy answer): above the longest gap between two
# looks of a waiting Acquire (RateLimiterSettings.acquire_poll_s).
WAITING_TTL_MS = 2000


@dataclass(frozen=True)
class Busy:
    """Nothing can run now; look again on a release signal or after `recheck_s`."""

    recheck_s: float


@dataclass(frozen=True)
class Gone:
    """None of the instances the grant had to name is registered any more."""

    instances: tuple[str, ...]


@dataclass(frozen=True)
class Resource:
    """One rate_limiter resource an instance needs to run a payload."""

    name: str
    count: int
    is_global: bool = False


@dataclass(frozen=True)
class Instance:
    instance_id: str
    model: str
    version: int
    kind: str
    device_id: int
    worker_id: str
    worker_address: str
    priority: int = 0
    resources: tuple[Resource, ...] = field(default=())


@dataclass(frozen=True)
class Grant:
    grant_id: str
    instance: Instance
    holds_resources: bool = False


class NoInstances(Exception):
    """No instance of the model is registered at all (as opposed to all busy)."""


class NeverRunnable(NoInstances):
    """Every instance needs more of a resource than is available."""


def now_ms() -> int:
    return int(time.time() * 1000)


def predecessor_prefixes(holder: str) -> tuple[str, str]:
    """For `holder` ("<scheduler id>/<incarnation>"): the prefix of every grant
    id of its scheduler id, and of its own grant ids; a grant with the first
    and not the second is an earlier process's."""
    scheduler_id = holder.rpartition("/")[0]
    return f"{scheduler_id}/", f"{holder}/"


class RedisRegistry:
    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str = keys.RL_PREFIX,
        mode: str = OFF,
        origin: str | None = None,
        waiting_ttl_ms: int = WAITING_TTL_MS,
        *,
        settings: RateLimiterSettings,
    ) -> None:
        if mode not in RATE_LIMIT_MODES:
            raise ValueError(f"rate limit mode '{mode}' is not one of {RATE_LIMIT_MODES}")
        self.redis = redis
        self.prefix = prefix
        self.mode = mode
        #: this rate limiter process, as the waiting sets and channels name it
        self.origin = origin or uuid.uuid4().hex[:12]
        self.waiting_ttl_ms = waiting_ttl_ms
        #: Every instance (or a resource it needs) is busy: a release signals it
        #: (the freeing process wakes its own waiters, Redis tells the other
        #: rate limiters), so the look-again period is only a safety net.
        self.busy = Busy(settings.acquire_poll_s)
        #: A pool with a lower scaled priority goes first. Nothing signals the
        #: end of that wait (its demand lapses after DEMAND_TTL_MS): look again soon.
        self.deferred = Busy(settings.deferred_poll_s)
        #: where Redis tells this process that another one freed something
        #: (message: "{model}:{version}", or "*" for any pool)
        self.freed_channel = keys.rl_freed_channel(prefix, self.origin)
        self._set_overrides = redis.register_script(scripts.SET_OVERRIDES)
        self._register = redis.register_script(scripts.REGISTER)
        self._heartbeat = redis.register_script(scripts.HEARTBEAT)
        self._deregister = redis.register_script(scripts.DEREGISTER)
        self._acquire = redis.register_script(scripts.ACQUIRE)
        self._release = redis.register_script(scripts.RELEASE)
        self._sweep = redis.register_script(scripts.SWEEP)
        self._renew = redis.register_script(scripts.RENEW)
        self._release_holder = redis.register_script(scripts.RELEASE_HOLDER)
        self._notify_all = redis.register_script(scripts.NOTIFY_ALL)
        self._overrides: dict[str, int] = {}

    async def register(
        self, worker_id: str, address: str, instances: list[Instance], lease_ms: int
    ) -> int:
        # Redis restarted empty (workers register again then): the overrides
        # went with it, and counts would fall back to the largest need.
        if self._overrides and not await self.redis.exists(self.prefix + "res:override"):
            await self.set_overrides(self._overrides)
        args: list[str | int] = [self.prefix, worker_id, address, lease_ms]
        for inst in instances:
            res = json.dumps([[r.name, int(r.is_global), r.count] for r in inst.resources])
            args += [
                inst.instance_id,
                inst.model,
                inst.version,
                inst.kind,
                inst.device_id,
                inst.priority,
                res,
            ]
        added = int(await self._register(args=args))
        await self._registry_changed()
        return added

    async def set_overrides(self, overrides: dict[str, int]) -> None:
        """The --rate-limit-resource counts ("name" or "name@device" -> count).
        Every rate limiter sharing the Redis must be given the same ones."""
        self._overrides = dict(overrides)
        args: list[str | int] = [self.prefix]
        for name, count in sorted(overrides.items()):
            args += [name, count]
        await self._set_overrides(args=args)

    async def heartbeat(self, worker_id: str, lease_ms: int) -> bool:
        return bool(await self._heartbeat(args=[self.prefix, worker_id, lease_ms]))

    async def deregister(self, worker_id: str) -> int:
        removed = int(await self._deregister(args=[self.prefix, worker_id]))
        await self._registry_changed()
        return removed

    async def _registry_changed(self) -> None:
        """Other rate limiters' waiting Acquires look again (new instances, or
        none left: NoInstances). Rare (registrations), so its own round trip."""
        await self._notify_all(args=[self.prefix, self.origin, now_ms()])

    async def attempt(
        self,
        model: str,
        version: int,
        lease_ms: int,
        only: Sequence[str] = (),
        other_than: Sequence[str] = (),
        holder: str = "",
    ) -> Grant | Busy | Gone:
        """A grant on a free instance, else how to wait; NoInstances if none
        exist. `only`: the grant names one of these instances (Gone when none
        of them is registered); `other_than`: none of these while the pool
        has another instance. `holder`: the asking scheduler process
        ("<scheduler id>/<incarnation>"), which the grant's id begins with
        (release_holder)."""
        grant_id = f"{holder}/{uuid.uuid4().hex}" if holder else uuid.uuid4().hex
        args: list[str | int] = [
            self.prefix,
            model,
            version,
            grant_id,
            now_ms(),
            lease_ms,
            self.mode,
        ]
        args += [DEMAND_TTL_MS, self.origin, self.waiting_ttl_ms]
        if only or other_than:
            args += [len(only), *only, *other_than]
        res = await self._acquire(args=args)
        if res is None:
            return self.busy
        if res == -3:
            return self.deferred
        if res == -1:
            raise NoInstances(f"no instance of model '{model}' version {version} is registered")
        if res[0] == -4:
            return Gone(tuple(x.decode() for x in res[1:]))
        if res[0] == -2:
            raise NeverRunnable(
                f"no instance of model '{model}' version {version} can ever run: {res[1].decode()}"
            )
        iid, kind, device_id, worker_id, address, holds, prio = (x.decode() for x in res)
        inst = Instance(
            iid, model, version, kind, int(device_id), worker_id, address, int(prio or 0)
        )
        return Grant(grant_id, inst, holds == "1")

    async def release(self, grant_id: str, failed: bool = False) -> bool:
        """Whether the grant was held (its resources, if any, went back)."""
        failed_flag = "1" if failed else "0"
        args: list[str | int] = [self.prefix, grant_id, failed_flag, self.origin, now_ms()]
        return bool(await self._release(args=args))

    async def release_holder(self, holder: str) -> int:
        """End every grant an earlier process of `holder`'s scheduler id
        holds (`holder`'s own grants stay); how many."""
        args: list[str | int] = [self.prefix, self.origin, now_ms(), *predecessor_prefixes(holder)]
        return int(await self._release_holder(args=args))

    async def renew(self, grant_ids: list[str], lease_ms: int) -> list[str]:
        """Extend held grants' leases; returns the ids that are no longer held."""
        if not grant_ids:
            return []
        lost = await self._renew(args=[self.prefix, now_ms(), lease_ms, *grant_ids])
        return [g.decode() for g in lost]

    async def sweep(self) -> tuple[int, int]:
        expired, dead = await self._sweep(args=[self.prefix, now_ms(), self.origin])
        return int(expired), int(dead)

    async def instances(self, model: str = "", version: int = 0) -> list[Instance]:
        # No decode_responses on our clients: Redis answers bytes.
        out = []
        workers = cast("set[bytes]", await self.redis.smembers(self.prefix + "workers"))
        for wid in sorted(workers):
            insts = cast(
                "set[bytes]",
                await self.redis.smembers(f"{self.prefix}worker:{wid.decode()}:insts"),
            )
            for iid in sorted(insts):
                f = cast(
                    "dict[bytes, bytes]",
                    await self.redis.hgetall(f"{self.prefix}inst:{iid.decode()}"),
                )
                if not f:
                    continue
                inst = Instance(
                    iid.decode(),
                    f[b"model"].decode(),
                    int(f[b"version"]),
                    f[b"kind"].decode(),
                    int(f[b"device_id"]),
                    f[b"worker_id"].decode(),
                    f[b"worker_address"].decode(),
                    int(f.get(b"prio", b"0") or 0),
                )
                if (not model or inst.model == model) and (not version or inst.version == version):
                    out.append(inst)
        return out

    async def usage(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(model, version) -> (free, busy) instance counts."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        pool_prefix = self.prefix + "pool:"
        async for key in self.redis.scan_iter(match=pool_prefix + "*", count=500):
            pool = key.decode()[len(pool_prefix) :]
            model, _, version = pool.rpartition(":")
            registered = await self.redis.scard(key)
            free = await self.redis.llen(self.prefix + "free:" + pool)
            out[(model, int(version))] = (free, max(0, registered - free))
        return out

    async def resources(self) -> dict[str, tuple[int, int]]:
        """Resource field ("name@global" or "name@{worker}/{device}") -> (held,
        available count)."""
        caps = cast("dict[bytes, bytes]", await self.redis.hgetall(self.prefix + "res:cap"))
        held = cast("dict[bytes, bytes]", await self.redis.hgetall(self.prefix + "res:held"))
        out = {}
        for key in set(caps) | set(held):
            out[key.decode()] = (int(held.get(key, 0)), int(caps.get(key, 0)))
        return out

    async def busy_instance_ids(self) -> list[str]:
        gids = cast("list[bytes]", await self.redis.zrange(self.prefix + "grants", 0, -1))
        out = []
        for gid in gids:
            iid = cast(
                "bytes | None",
                await self.redis.hget(f"{self.prefix}grant:{gid.decode()}", "instance"),
            )
            if iid:
                out.append(iid.decode())
        return out
