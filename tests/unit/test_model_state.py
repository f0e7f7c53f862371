"""stageserve/model_state.py against a real redis-server: restoring the record a
failed reload replaced, and never over a newer load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from stageserve import redis_keys as keys
from stageserve.generated import model_config_pb2 as mc
from stageserve.model_state import ModelStateStore


def _config(max_batch_size: int) -> mc.ModelConfig:
    return mc.ModelConfig(
        name="m",
        platform="onnxruntime_onnx",
        max_batch_size=max_batch_size,
        input=[mc.ModelInput(name="X", data_type=mc.TYPE_FP32, dims=[4])],
        output=[mc.ModelOutput(name="Y", data_type=mc.TYPE_FP32, dims=[4])],
    )


def run(url: str, body) -> None:
    async def main() -> None:
        r = aioredis.from_url(url)
        await r.flushdb()
        try:
            await body(ModelStateStore(r), r)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_restore_puts_back_the_serving_record_and_tells_the_workers(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        await store.publish_loaded(_config(8), (1,), Path("/repo/m"))
        serving = await store.get("m")
        assert serving is not None
        failed = await store.publish_loaded(_config(4), (1, 2), Path("/repo/m"))
        events = r.pubsub()
        await events.subscribe(keys.MODEL_EVENTS)
        await events.get_message(timeout=1)  # the subscribe confirmation
        assert await store.restore(serving, failed)
        restored = await store.get("m")
        assert restored == serving
        assert (await store.loaded())["m"].generation == serving.generation
        message = await events.get_message(timeout=1)
        assert message is not None and message["data"] == b"m"
        await events.aclose()

    run(redis_url, body)


def test_restore_never_overwrites_a_later_load(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        await store.publish_loaded(_config(8), (1,), Path("/repo/m"))
        serving = await store.get("m")
        assert serving is not None
        failed = await store.publish_loaded(_config(4), (1,), Path("/repo/m"))
        later = await store.publish_loaded(_config(2), (1,), Path("/repo/m"))  # another gateway
        assert not await store.restore(serving, failed)
        current = await store.get("m")
        assert current is not None
        assert current.generation == later and current.config.max_batch_size == 2

    run(redis_url, body)


def test_restore_after_an_unload_does_not_bring_the_model_back(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        await store.publish_loaded(_config(8), (1,), Path("/repo/m"))
        serving = await store.get("m")
        assert serving is not None
        failed = await store.publish_loaded(_config(4), (1,), Path("/repo/m"))
        await store.publish_unloaded("m")
        assert not await store.restore(serving, failed)
        assert await store.get("m") is None and await store.loaded() == {}

    run(redis_url, body)


def test_load_errors_name_each_worker_only_when_the_reasons_differ(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        await store.report_load_error("m", 1, "w-a", "bad file")
        await store.report_load_error("m", 1, "w-b", "bad file")
        await store.report_load_error("m", 2, "w-a", "bad file")
        await store.report_load_error("m", 2, "w-b", "no GPU 3 here")
        errors = await store.load_errors("m")
        assert errors[1] == "bad file"
        assert errors[2] == "worker w-a: bad file; worker w-b: no GPU 3 here"
        await store.clear_load_errors("m", "w-b")
        assert await store.load_errors("m") == {1: "bad file", 2: "bad file"}

    run(redis_url, body)


def test_publication_marks_renew_expire_and_withdraw(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        assert await store.publishers() == set()
        # renew_only never creates a mark: that is how a gateway notices a loss
        assert not await store.mark_published("gw-a", 5000, renew_only=True)
        assert await store.mark_published("gw-a", 5000, renew_only=False)
        assert await store.mark_published("gw-b", 100, renew_only=False)
        assert await store.publishers() == {"gw-a", "gw-b"}
        assert await store.mark_published("gw-a", 5000, renew_only=True)
        await asyncio.sleep(0.25)  # gw-b's lease ran out
        assert await store.publishers() == {"gw-a"}
        assert not await store.mark_published("gw-b", 100, renew_only=True)
        # the expired mark is dropped from Redis, not only hidden
        assert await r.zrange(keys.MODEL_PUBLISHERS, 0, -1) == [b"gw-a"]
        await store.withdraw_mark("gw-a")
        assert await store.publishers() == set()
        await store.mark_published("gw-a", 5000, renew_only=False)
        await r.flushdb()  # Redis lost its data
        assert not await store.mark_published("gw-a", 5000, renew_only=True)

    run(redis_url, body)


def test_republish_writes_back_only_what_redis_lost(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        generation = await store.publish_loaded(_config(8), (1,), Path("/repo/m"))
        served = await store.get("m")
        assert served is not None
        await r.flushdb()
        events = r.pubsub()
        await events.subscribe(keys.MODEL_EVENTS)
        await events.get_message(timeout=1)  # the subscribe confirmation
        await store.republish(served.config, served.versions, served.path, generation, served.files)
        assert await store.get("m") == served
        assert (await store.loaded())["m"].generation == generation
        message = await events.get_message(timeout=1)
        assert message is not None and message["data"] == b"m"
        # A record Redis holds (a later load by another gateway) is kept.
        newer = await store.publish_loaded(_config(4), (1, 2), Path("/repo/m"))
        await store.republish(served.config, served.versions, served.path, generation, served.files)
        newest = await store.get("m")
        assert newest is not None and newest.generation == newer
        assert newest.versions == (1, 2)
        await events.aclose()

    run(redis_url, body)


def test_adopt_takes_a_record_of_the_same_load_and_publishes_a_changed_one(redis_url) -> None:
    """Gateways applying one change (startup, poll mode) publish it once."""

    async def body(store: ModelStateStore, r) -> None:
        path = Path("/repo/m")
        first = await store.publish_loaded(_config(8), (1,), path, "files-a", adopt=True)
        same = await store.publish_loaded(
            _config(8), (1,), path, "files-a", adopt=True, match_files=True
        )
        assert same == first and int(await r.get(keys.GENERATION_COUNTER)) == first
        adopted = await store.get("m")
        assert adopted is not None and adopted.files == "files-a"
        # A model file rewritten: same config, new digest, reloaded when files count.
        assert await store.publish_loaded(_config(8), (1,), path, "files-b", adopt=True) == first
        rewritten = await store.publish_loaded(
            _config(8), (1,), path, "files-b", adopt=True, match_files=True
        )
        assert rewritten > first
        changed = await store.publish_loaded(_config(4), (1,), path, "files-b", adopt=True)
        assert changed > rewritten  # a config change is never adopted
        # Without adopt (an explicit load), always a new generation.
        assert await store.publish_loaded(_config(4), (1,), path, "files-b") > changed

        # Two gateways at once: one generation between them.
        await r.delete(keys.model("m"))
        both = await asyncio.gather(
            *(
                store.publish_loaded(_config(2), (1,), path, "c", adopt=True, match_files=True)
                for _ in range(2)
            )
        )
        assert both[0] == both[1]

    run(redis_url, body)


def test_draining_versions_are_published_and_ended_only_for_their_generation(redis_url) -> None:
    async def body(store: ModelStateStore, r) -> None:
        first = await store.publish_loaded(_config(8), (2,), Path("/repo/m"), draining=(1,))
        loaded = await store.get("m")
        assert loaded is not None and loaded.draining == (1,)
        assert loaded.served_versions == (2, 1)
        later = await store.publish_loaded(_config(4), (3,), Path("/repo/m"), draining=(1, 2))
        assert not await store.end_draining("m", first)  # a later load owns the record
        kept = await store.get("m")
        assert kept is not None and kept.draining == (1, 2)
        events = r.pubsub()
        await events.subscribe(keys.MODEL_EVENTS)
        await events.get_message(timeout=1)  # the subscribe confirmation
        assert await store.end_draining("m", later)
        ended = await store.get("m")
        assert (
            ended is not None
            and ended.draining == ()
            and ended.versions == (3,)
            and ended.generation == later
        )
        message = await events.get_message(timeout=1)
        assert message is not None and message["data"] == b"m"
        assert not await store.end_draining("m", later)  # nothing left to end
        await events.aclose()

    run(redis_url, body)


def test_loaded_decodes_a_record_again_only_when_it_changed(redis_url) -> None:
    """A worker reads every record at each reconcile: an unchanged one comes
    back as the object decoded before; any change, a draining-only one
    (generation unchanged) included, and an unload are seen."""

    async def body(store: ModelStateStore, r) -> None:
        generation = await store.publish_loaded(_config(8), (2,), Path("/repo/m"), draining=(1,))
        other = _config(4)
        other.name = "n"
        await store.publish_loaded(other, (1,), Path("/repo/n"))
        first = await store.loaded()
        again = await store.loaded()
        assert set(first) == {"m", "n"}
        assert again["m"] is first["m"] and again["n"] is first["n"]
        assert await store.end_draining("m", generation)
        ended = await store.loaded()
        assert ended["m"] is not first["m"] and ended["m"].draining == ()
        assert ended["m"].generation == generation and ended["n"] is first["n"]
        await store.publish_unloaded("n")
        assert set(await store.loaded()) == {"m"}
        await store.publish_unloaded("m")
        assert await store.loaded() == {}

    run(redis_url, body)
