"""Which models are loaded, as published in Redis by the gateway.

The gateway owns the repository and decides what is loaded; workers load
instances for every published model and schedulers read batching settings
from it. A generation number bumps on every (re)load, so readers can cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import WatchError
from redis.typing import EncodableT

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
    files: str = ""  # files_digest of the folder the publishing gateway read
    # Versions a reload removed while requests for them were still admitted:
    # workers keep their old instances (registered, never loaded anew) until
    # the gateway publishes the record again without them (Triton unloads a
    # removed version only after its queued requests finished).
    draining: tuple[int, ...] = ()

    @property
    def served_versions(self) -> tuple[int, ...]:
        """The versions whose instances may still answer an admitted request."""
        return (*self.versions, *self.draining)


def files_digest(fingerprint: tuple) -> str:
    """A model folder's fingerprint (repository.fingerprint) in a record: two
    gateways reading the same folder agree on it."""
    return hashlib.sha256(repr(fingerprint).encode()).hexdigest()[:32]


def _versions_field(versions: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in versions)


def _parse_versions(raw: bytes) -> tuple[int, ...]:
    return tuple(int(v) for v in raw.decode().split(",") if v)


def _record(
    config: mc.ModelConfig,
    versions: tuple[int, ...],
    path: Path,
    generation: int,
    files: str,
    draining: tuple[int, ...] = (),
) -> dict[EncodableT, EncodableT]:
    """A model's record (keys.model) as the gateway publishes it."""
    return {
        "config": config.SerializeToString(),
        "versions": _versions_field(versions),
        "path": str(path),
        "generation": generation,
        "files": files,
        "draining": _versions_field(draining),
    }


# Marks expire in Redis time, so gateways' and workers' clocks need not agree.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: publishers; ARGV: gateway, lease ms, renew only (1/0). Drops expired
# marks on the way, so a killed gateway's leaves nothing behind.
_MARK = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
if ARGV[3] == '1' and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""
)

_PUBLISHERS = _NOW_MS + "return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')"

# KEYS: model record, models, events; ARGV: name, generation, record fields.
_REPUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PUBLISH', KEYS[3], ARGV[1])
return 1
"""


def _decode(name: str, fields: dict[bytes, bytes]) -> LoadedModel | None:
    """`fields`: a record as Redis answers it (our clients have no
    decode_responses: bytes)."""
    if not fields or b"config" not in fields:
        return None
    config = mc.ModelConfig.FromString(fields[b"config"])
    return LoadedModel(
        name=name,
        generation=int(fields[b"generation"]),
        versions=_parse_versions(fields[b"versions"]),
        path=Path(fields[b"path"].decode()),
        config=config,
        spec=to_spec(config),
        files=fields.get(b"files", b"").decode(),
        draining=_parse_versions(fields.get(b"draining", b"")),
    )


class ModelStateStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._republish = redis.register_script(_REPUBLISH)
        self._mark = redis.register_script(_MARK)
        self._publishers = redis.register_script(_PUBLISHERS)
        # loaded()'s records as last decoded: a worker reads every record each
        # WorkerSettings.reconcile_s and at every model event, and decoding them
        # (protobuf parse + to_spec) was 8% of a worker's CPU at c=64 on the example
        # repository (py-spy); an unchanged record is not decoded again.
        self._decoded: dict[str, tuple[dict[bytes, bytes], LoadedModel | None]] = {}

    async def publish_loaded(
        self,
        config: mc.ModelConfig,
        versions: tuple[int, ...],
        path: Path,
        files: str = "",
        adopt: bool = False,
        match_files: bool = False,
        draining: tuple[int, ...] = (),
    ) -> int:
        """Publish a load under a new generation; returns the generation. With
        `adopt`, a record that already is this load (same config, versions,
        path and, with `match_files`, folder digest `files`: another gateway
        published it) is taken as it is, no new generation; checked and
        written atomically, so gateways applying the same change at once
        (startup, poll mode) make workers load it once. `draining`: versions
        the load removes that keep their instances (LoadedModel.draining)."""
        name = config.name
        record = keys.model(name)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(record)
                    if adopt:
                        fields = cast("dict[bytes, bytes]", await pipe.hgetall(record))
                        current = _decode(name, fields)
                        if (
                            current is not None
                            and current.config == config
                            and current.versions == versions
                            and current.path == path
                            and (not match_files or current.files == files)
                        ):
                            return current.generation
                    # Taken outside the transaction: a publish that loses the
                    # race (WatchError) leaves a gap in the numbers, which is
                    # harmless (generations need only be new and increasing).
                    generation = int(await self.redis.incr(keys.GENERATION_COUNTER))
                    pipe.multi()
                    pipe.delete(keys.model_errors(name))
                    pipe.hset(
                        record, mapping=_record(config, versions, path, generation, files, draining)
                    )
                    pipe.hset(keys.MODELS, name, generation)
                    pipe.publish(keys.MODEL_EVENTS, name)
                    await pipe.execute()
                    return generation
                except WatchError:  # another gateway published meanwhile: look again
                    continue

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
                    mapping=_record(
                        previous.config,
                        previous.versions,
                        previous.path,
                        previous.generation,
                        previous.files,
                        previous.draining,
                    ),
                )
                pipe.hset(keys.MODELS, previous.name, previous.generation)
                pipe.publish(keys.MODEL_EVENTS, previous.name)
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def end_draining(self, name: str, generation: int) -> bool:
        """Publish the record again without its draining versions, so workers
        unload them. Only while `generation` is the published one: a later
        load published its own draining set. Returns whether it changed."""
        record = keys.model(name)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(record)
                current, draining = await pipe.hmget(record, "generation", "draining")
                if current is None or int(current) != generation or not draining:
                    return False
                pipe.multi()
                pipe.hset(record, "draining", "")
                pipe.publish(keys.MODEL_EVENTS, name)
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

    async def republish(
        self,
        config: mc.ModelConfig,
        versions: tuple[int, ...],
        path: Path,
        generation: int,
        files: str,
        client: aioredis.Redis | None = None,
    ) -> None:
        """Write a served model's record back, generation and all, unless Redis
        holds one: after a loss the first gateway to write it wins, and a mark
        that only lapsed (a stalled gateway) never rolls a newer load back.
        `client`: a pipeline to queue it on."""
        await self._republish(
            keys=[keys.model(config.name), keys.MODELS, keys.MODEL_EVENTS],
            args=[
                config.name,
                generation,
                *(
                    x
                    for kv in _record(config, versions, path, generation, files).items()
                    for x in kv
                ),
            ],
            client=client,
        )

    async def mark_published(self, gateway: str, lease_ms: int, renew_only: bool) -> bool:
        """Set (or, with `renew_only`, renew while it holds) `gateway`'s
        publication mark for `lease_ms`; returns whether it is set."""
        return bool(
            await self._mark(
                keys=[keys.MODEL_PUBLISHERS], args=[gateway, lease_ms, int(renew_only)]
            )
        )

    async def withdraw_mark(self, gateway: str) -> None:
        await self.redis.zrem(keys.MODEL_PUBLISHERS, gateway)

    async def publishers(self) -> set[str]:
        """The gateways whose publication mark holds now."""
        return {raw.decode() for raw in await self._publishers(keys=[keys.MODEL_PUBLISHERS])}

    async def loaded(self) -> dict[str, LoadedModel]:
        raw_names = cast("list[bytes]", await self.redis.hkeys(keys.MODELS))
        names = [raw.decode() for raw in raw_names]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(keys.model(name))
            records = await pipe.execute() if names else []
        out: dict[str, LoadedModel] = {}
        decoded: dict[str, tuple[dict[bytes, bytes], LoadedModel | None]] = {}
        for name, fields in zip(names, records, strict=True):
            cached = self._decoded.get(name)
            model = (
                cached[1] if cached is not None and cached[0] == fields else _decode(name, fields)
            )
            decoded[name] = (fields, model)
            if model is not None:
                out[name] = model
        self._decoded = decoded
        return out

    async def get(self, name: str) -> LoadedModel | None:
        fields = cast("dict[bytes, bytes]", await self.redis.hgetall(keys.model(name)))
        return _decode(name, fields)

    async def report_load_error(self, name: str, version: int, worker: str, message: str) -> None:
        await self.redis.hset(keys.model_errors(name), f"{version}@{worker}", message)

    async def clear_load_errors(self, name: str, worker: str) -> None:
        errors = cast("list[bytes]", await self.redis.hkeys(keys.model_errors(name)))
        mine = [e for e in errors if e.decode().endswith(f"@{worker}")]
        if mine:
            await self.redis.hdel(keys.model_errors(name), *mine)

    async def load_errors(self, name: str) -> dict[int, str]:
        """Why each failed version did not load. Workers that failed alike are
        reported once; different reasons are each named with their worker."""
        raw = cast("dict[bytes, bytes]", await self.redis.hgetall(keys.model_errors(name)))
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
