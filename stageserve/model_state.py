"""Which models are loaded, as published in Redis by the gateway.

The gateway owns the repository and decides what is loaded; workers load
instances for every published model and schedulers read batching settings
from it. A generation number bumps on every (re)load, so readers can cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from stageserve import redis_keys as keys
from stageserve.config import ModelSpec, to_spec
from stageserve.generated import model_config_pb2 as mc


@dataclass(frozen=True)
class LoadedModel:
    name: str
    generation: int
    versions: tuple[int, ...]
    path: Path
    config: mc.ModelConfig
    spec: ModelSpec


def _decode(name: str, fields: dict[bytes, bytes]) -> LoadedModel | None:
    if not fields or b"config" not in fields:
        return None
    config = mc.ModelConfig.FromString(fields[b"config"])
    return LoadedModel(
        name=name,
        generation=int(fields[b"generation"]),
        versions=tuple(int(v) for v in fields[b"versions"].decode().split(",") if v),
        path=Path(fields[b"path"].decode()),
        config=config,
        spec=to_spec(config),
    )


class ModelStateStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def publish_loaded(
        self, config: mc.ModelConfig, versions: tuple[int, ...], path: Path
    ) -> int:
        name = config.name
        generation = int(await self.redis.incr(keys.GENERATION_COUNTER))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.model_errors(name))
            pipe.hset(
                keys.model(name),
                mapping={
                    "config": config.SerializeToString(),
                    "versions": ",".join(str(v) for v in versions),
                    "path": str(path),
                    "generation": generation,
                },
            )
            pipe.hset(keys.MODELS, name, generation)
            pipe.publish(keys.MODEL_EVENTS, name)
            await pipe.execute()
        return generation

    async def restore(self, previous: LoadedModel, failed_generation: int) -> bool:
        """Put back the record a failed reload replaced, generation and all, so
        workers keep (and schedulers configure) the instances still serving
        instead of retrying the broken files. Only while the failed
        generation is still the published one: a later load wins. Returns
        whether it restored."""
        record = keys.model(previous.name)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(record)
                current = await pipe.hget(record, "generation")
                if current is None or int(current) != failed_generation:
                    return False
                pipe.multi()
                pipe.hset(
                    record,
                    mapping={
                        "config": previous.config.SerializeToString(),
                        "versions": ",".join(str(v) for v in previous.versions),
                        "path": str(previous.path),
                        "generation": previous.generation,
                    },
                )
                pipe.hset(keys.MODELS, previous.name, previous.generation)
                pipe.publish(keys.MODEL_EVENTS, previous.name)
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def publish_unloaded(self, name: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(keys.MODELS, name)
            pipe.delete(keys.model(name), keys.model_errors(name))
            pipe.publish(keys.MODEL_EVENTS, name)
            await pipe.execute()

    async def model_set_known(self) -> bool:
        """False after Redis lost its data, until the gateway republished the
        model set (services/gateway/republish.py): "no model" then means
        "not known", not "unload everything"."""
        return bool(await self.redis.exists(keys.MODELS_PUBLISHED))

    async def loaded(self) -> dict[str, LoadedModel]:
        out: dict[str, LoadedModel] = {}
        for raw in await self.redis.hkeys(keys.MODELS):
            name = raw.decode()
            model = await self.get(name)
            if model is not None:
                out[name] = model
        return out

    async def get(self, name: str) -> LoadedModel | None:
        return _decode(name, await self.redis.hgetall(keys.model(name)))

    async def report_load_error(self, name: str, version: int, worker: str, message: str) -> None:
        await self.redis.hset(keys.model_errors(name), f"{version}@{worker}", message)

    async def clear_load_errors(self, name: str, worker: str) -> None:
        errors = await self.redis.hkeys(keys.model_errors(name))
        mine = [e for e in errors if e.decode().endswith(f"@{worker}")]
        if mine:
            await self.redis.hdel(keys.model_errors(name), *mine)

    async def load_errors(self, name: str) -> dict[int, str]:
        """Why each failed version did not load. Workers that failed alike are
        reported once; different reasons are each named with their worker."""
        raw = await self.redis.hgetall(keys.model_errors(name))
        by_version: dict[int, dict[str, list[str]]] = {}
        for k, v in raw.items():
            version, worker = k.decode().split("@", 1)
            by_version.setdefault(int(version), {}).setdefault(v.decode(), []).append(worker)
        return {version: _join_reasons(reasons) for version, reasons in by_version.items()}


def _join_reasons(reasons: dict[str, list[str]]) -> str:
    if len(reasons) == 1:
        return next(iter(reasons))
    return "; ".join(
        f"worker {', '.join(sorted(workers))}: {message}"
        for message, workers in sorted(reasons.items(), key=lambda kv: sorted(kv[1]))
    )
