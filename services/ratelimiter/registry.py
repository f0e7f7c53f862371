"""Instance registry and execution grants, kept in Redis by atomic scripts.

One payload per instance at a time: an instance id sits in its model's free
list until a grant takes it, and goes back on release. Grants carry a lease
and workers a liveness key, so a crashed scheduler or worker leaks nothing:
the sweep releases expired grants and removes workers whose key expired.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from stageserve import redis_keys as keys
from stageserve import redis_scripts as scripts


@dataclass(frozen=True)
class Instance:
    instance_id: str
    model: str
    version: int
    kind: str
    device_id: int
    worker_id: str
    worker_address: str


@dataclass(frozen=True)
class Grant:
    grant_id: str
    instance: Instance


class NoInstances(Exception):
    """No instance of the model is registered at all (as opposed to all busy)."""


def now_ms() -> int:
    return int(time.time() * 1000)


class RedisRegistry:
    def __init__(self, redis: aioredis.Redis, prefix: str = keys.RL_PREFIX) -> None:
        self.redis = redis
        self.prefix = prefix
        self._register = redis.register_script(scripts.REGISTER)
        self._heartbeat = redis.register_script(scripts.HEARTBEAT)
        self._deregister = redis.register_script(scripts.DEREGISTER)
        self._acquire = redis.register_script(scripts.ACQUIRE)
        self._release = redis.register_script(scripts.RELEASE)
        self._sweep = redis.register_script(scripts.SWEEP)
        self._renew = redis.register_script(scripts.RENEW)

    async def register(
        self, worker_id: str, address: str, instances: list[Instance], lease_ms: int
    ) -> int:
        args: list[str | int] = [self.prefix, worker_id, address, lease_ms]
        for inst in instances:
            args += [inst.instance_id, inst.model, inst.version, inst.kind, inst.device_id, ""]
        return int(await self._register(args=args))

    async def heartbeat(self, worker_id: str, lease_ms: int) -> bool:
        return bool(await self._heartbeat(args=[self.prefix, worker_id, lease_ms]))

    async def deregister(self, worker_id: str) -> int:
        return int(await self._deregister(args=[self.prefix, worker_id]))

    async def try_acquire(self, model: str, version: int, lease_ms: int) -> Grant | None:
        """A grant on a free instance, None if all are busy; NoInstances if none exist."""
        grant_id = uuid.uuid4().hex
        res = await self._acquire(args=[self.prefix, model, version, grant_id, now_ms(), lease_ms])
        if res is None:
            return None
        if res == -1:
            raise NoInstances(f"no instance of model '{model}' version {version} is registered")
        iid, kind, device_id, worker_id, address = (x.decode() for x in res)
        return Grant(
            grant_id, Instance(iid, model, version, kind, int(device_id), worker_id, address)
        )

    async def release(self, grant_id: str, failed: bool = False) -> bool:
        return bool(await self._release(args=[self.prefix, grant_id, "1" if failed else "0"]))

    async def renew(self, grant_ids: list[str], lease_ms: int) -> list[str]:
        """Extend held grants' leases; returns the ids that are no longer held."""
        if not grant_ids:
            return []
        lost = await self._renew(args=[self.prefix, now_ms(), lease_ms, *grant_ids])
        return [g.decode() for g in lost]

    async def sweep(self) -> tuple[int, int]:
        expired, dead = await self._sweep(args=[self.prefix, now_ms()])
        return int(expired), int(dead)

    async def instances(self, model: str = "", version: int = 0) -> list[Instance]:
        out = []
        for wid in sorted(await self.redis.smembers(self.prefix + "workers")):
            for iid in sorted(
                await self.redis.smembers(f"{self.prefix}worker:{wid.decode()}:insts")
            ):
                f = await self.redis.hgetall(f"{self.prefix}inst:{iid.decode()}")
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

    async def busy_instance_ids(self) -> list[str]:
        gids = await self.redis.zrange(self.prefix + "grants", 0, -1)
        out = []
        for gid in gids:
            iid = await self.redis.hget(f"{self.prefix}grant:{gid.decode()}", "instance")
            if iid:
                out.append(iid.decode())
        return out
