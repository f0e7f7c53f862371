"""The response cache's pure core (key, entry encoding, LRU by bytes, the
--cache-config parser, the load refusals) and its Redis store on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.gateway.cache_metrics import CacheMetrics
from stageserve import redis_keys as keys
from stageserve.cache_options import DEFAULT_REDIS_SIZE, CacheConfig, parse_cache_config
from stageserve.config import ConfigError, parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.response_cache import (
    CacheUsage,
    LocalCache,
    LruBytes,
    RedisCache,
    decode_entry,
    encode_entry,
    request_key,
)
from stageserve.settings import Settings
from stageserve.statistics import ModelVersionStats
from stageserve.telemetry import TritonMetrics


def _t(name: str, raw: bytes, shape=(1, 4), dtype: str = "FP32") -> pb.Tensor:
    return pb.Tensor(name=name, datatype=dtype, shape=list(shape), raw=raw)


RAW = bytes(range(16))


# ------------------------------------------------------------------------ key


def test_key_is_stable_and_ignores_input_order() -> None:
    a = request_key("m", 1, 3, [_t("A", RAW), _t("B", b"x" * 4, (1, 1))], [])
    b = request_key("m", 1, 3, [_t("B", b"x" * 4, (1, 1)), _t("A", RAW)], [])
    assert a == b and len(a) == 16


@pytest.mark.parametrize(
    "other",
    [
        dict(model="n"),
        dict(version=2),
        dict(generation=4),
        dict(inputs=[_t("A", RAW[:-1] + b"\xff")]),
        dict(inputs=[_t("B", RAW)]),
        dict(inputs=[_t("A", RAW, shape=(2, 2))]),  # same bytes, other shape
        dict(inputs=[_t("A", RAW, dtype="INT32")]),  # same bytes, other datatype
        dict(outputs=["OUTPUT1"]),
    ],
)
def test_every_part_of_the_request_changes_the_key(other: dict) -> None:
    base = dict(model="m", version=1, generation=3, inputs=[_t("A", RAW)], outputs=[])
    assert request_key(**base) != request_key(**{**base, **other})  # type: ignore[arg-type]


def test_requested_outputs_key_by_set_not_order() -> None:
    inputs = [_t("A", RAW)]
    k1 = request_key("m", 1, 0, inputs, ["O1", "O0"])
    assert k1 == request_key("m", 1, 0, inputs, ["O0", "O1"])
    assert k1 != request_key("m", 1, 0, inputs, ["O0"])


def test_names_do_not_run_into_each_other() -> None:
    # "ab" + "c" and "a" + "bc": length-prefixed fields keep them apart
    assert request_key("m", 1, 0, [_t("ab", b"c")], []) != request_key(
        "m", 1, 0, [_t("a", b"bc")], []
    )


def test_entry_round_trips_names_datatypes_shapes_bytes() -> None:
    outs = [_t("O0", RAW), _t("O1", b"\x00\x01", (1, 2), "BYTES")]
    assert decode_entry(encode_entry(outs)) == outs
    assert decode_entry(b"\xff\xff\xff") is None  # not an entry: a miss


# ------------------------------------------------------------------- LRU bytes


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    lru = LruBytes(10)
    assert lru.put(b"a", b"1234") and lru.put(b"b", b"1234")
    assert lru.get(b"a") == b"1234"  # a is now the most recent
    assert lru.put(b"c", b"1234")  # 12 > 10: b goes
    assert lru.get(b"b") is None and lru.get(b"a") == b"1234" and lru.get(b"c") == b"1234"
    assert lru.held == 8 and lru.evictions == 1


def test_lru_refuses_a_value_over_the_budget_and_keeps_the_rest() -> None:
    lru = LruBytes(10)
    lru.put(b"a", b"12345")
    assert not lru.put(b"big", b"x" * 11)
    assert lru.get(b"big") is None and lru.get(b"a") == b"12345" and lru.held == 5


def test_lru_replacing_a_key_counts_its_bytes_once() -> None:
    lru = LruBytes(10)
    lru.put(b"a", b"123456")
    lru.put(b"a", b"1234567")
    assert lru.held == 7 and len(lru) == 1


def test_local_cache_is_the_lru() -> None:
    async def body() -> None:
        cache = LocalCache(8)
        assert await cache.insert(b"k", b"12345678") == CacheUsage(0, 1, 8)
        assert await cache.lookup(b"k") == b"12345678"
        assert await cache.insert(b"k2", b"1") == CacheUsage(1, 1, 1)
        assert await cache.lookup(b"k") is None  # evicted: 9 bytes > 8

    asyncio.run(body())


# ---------------------------------------------------------------- Redis store


def test_redis_cache_evicts_by_bytes_and_shares_between_clients(redis_url: str) -> None:
    async def body() -> None:
        r1, r2 = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
        try:
            await r1.delete(keys.CACHE_RECENCY, keys.CACHE_SIZES, keys.CACHE_BYTES)
            one, two = RedisCache(r1, 10), RedisCache(r2, 10)  # two gateways
            assert await one.insert(b"a", b"1234") == CacheUsage(0, 1, 4)
            assert await two.insert(b"b", b"1234") == CacheUsage(0, 2, 8)  # the shared count
            assert await two.lookup(b"a") == b"1234"  # a is now the most recent
            # 12 > 10: b (least recent) goes
            assert await one.insert(b"c", b"1234") == CacheUsage(1, 2, 8)
            assert await one.lookup(b"b") is None
            assert await two.lookup(b"c") == b"1234"
            assert await one.held_bytes() == 8
            # over the budget: not kept, nothing evicted
            assert await one.insert(b"big", b"x" * 11) == CacheUsage(0, 2, 8)
            assert await one.lookup(b"big") is None and await one.held_bytes() == 8
            await one.insert(b"a", b"123")  # replaced: counted once
            assert await one.held_bytes() == 7
            assert await r1.zcard(keys.CACHE_RECENCY) == 2
        finally:
            await r1.aclose()
            await r2.aclose()

    asyncio.run(body())


def test_own_redis_with_triton_options_serves_the_cache(redis_url: str) -> None:
    """--cache-config redis,host=...,port=... with a bounded pool and timeouts."""
    from urllib.parse import urlparse

    from stageserve.response_cache import open_cache
    from stageserve.settings import RedisClientSettings

    where = urlparse(redis_url)
    config = parse_cache_config(
        [
            f"redis,host={where.hostname},port={where.port},db=3,pool_size=2,wait_timeout=500",
            "redis,connect_timeout=1000,socket_timeout=1000,size=100",
        ]
    )

    async def body() -> None:
        stack = aioredis.from_url(redis_url)
        db3 = aioredis.from_url(f"redis://{where.hostname}:{where.port}/3")
        await db3.flushdb()
        cache = open_cache(config, stack, RedisClientSettings())
        assert isinstance(cache, RedisCache) and cache.owned
        await asyncio.gather(*(cache.insert(bytes([i]), b"v" * 10) for i in range(5)))
        got = await asyncio.gather(*(cache.lookup(bytes([i])) for i in range(5)))
        assert got == [b"v" * 10] * 5
        assert await db3.get(keys.CACHE_BYTES) == b"50"  # in db 3, as configured
        await cache.close()
        await stack.aclose()
        await db3.aclose()

    asyncio.run(body())


def test_redis_cache_unreachable_is_a_miss_not_an_error() -> None:
    async def body() -> None:
        dead = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        cache = RedisCache(dead, 100, owned=True)
        await cache.insert(b"k", b"v")
        assert await cache.lookup(b"k") is None
        await cache.close()

    asyncio.run(body())


# --------------------------------------------------------------- --cache-config


def test_cache_config_local_and_redis_as_triton_writes_them() -> None:
    assert parse_cache_config([]) is None
    assert parse_cache_config(["local,size=1048576"]) == CacheConfig("local", 1048576)
    redis = parse_cache_config(["redis,host=h", "redis,port=7000", "redis,password=pw"])
    assert redis == CacheConfig("redis", DEFAULT_REDIS_SIZE, "h", 7000, "", "pw", 0)
    assert parse_cache_config(["redis,host=h,port=7000,password=pw"]) == redis
    assert redis.redis_url() == "redis://:pw@h:7000/0"
    # Triton's redis cache keys; a value may hold commas (one key per flag in Triton)
    full = parse_cache_config(
        [
            "redis,host=h,user=u,password=a,b=c",
            "redis,connect_timeout=100,socket_timeout=200,pool_size=4,wait_timeout=50",
        ]
    )
    assert full == CacheConfig(
        "redis", DEFAULT_REDIS_SIZE, "h", 6379, "u", "a,b=c", 0, 100, 200, 4, 50
    )
    assert full.redis_url() == "redis://u:a%2Cb%3Dc@h:6379/0"
    assert parse_cache_config(["redis,host=h,username=u"]) == CacheConfig(
        "redis", DEFAULT_REDIS_SIZE, "h", user="u"
    )
    stack = parse_cache_config(["redis"])
    assert stack is not None and stack.host == "" and stack.size == DEFAULT_REDIS_SIZE


def test_cache_config_argv_round_trips() -> None:
    for values in (
        ["local,size=99"],
        ["redis,host=h,port=1,db=2,size=5,user=u,password=p,w", "redis,pool_size=3"],
        ["redis"],
    ):
        config = parse_cache_config(values)
        assert config is not None
        assert parse_cache_config(config.argv()[1::2]) == config


@pytest.mark.parametrize(
    "values, message",
    [
        (["memcached,size=1"], "unknown cache 'memcached'"),
        (["local"], "local needs size"),
        (["local,size=abc"], "expected a whole number"),
        (["local,size=-1"], "must not be negative"),
        (["local,host=h"], "key one of size"),
        (["local,size=1", "redis,host=h"], "one cache only"),
    ],
)
def test_cache_config_errors(values: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cache_config(values)


# ------------------------------------------------------------ model config


CONFIG = """name: "{name}" backend: "python" max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
response_cache {{ enable: true }}
{extra}
"""


def test_model_enabling_the_cache_is_read() -> None:
    assert to_spec(parse_config_text(CONFIG.format(name="m", extra=""))).response_cache
    plain = CONFIG.format(name="m", extra="").replace("response_cache { enable: true }", "")
    assert not to_spec(parse_config_text(plain)).response_cache


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "model_transaction_policy { decoupled: true }",
            "Response Cache does not currently support model m with 'decoupled' transaction "
            "policy. Please disable the response cache.",
        ),
        (
            "sequence_batching { }",
            "Response Cache does not currently support model m with sequence batching "
            "scheduler. Please disable the response cache.",
        ),
    ],
)
def test_decoupled_and_sequence_models_with_the_cache_are_refused_as_triton(
    extra: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        to_spec(parse_config_text(CONFIG.format(name="m", extra=extra)))
    assert str(err.value) == message


# ------------------------------------------------------------------ statistics


def test_hit_counts_as_triton_counts_it() -> None:
    st = ModelVersionStats()
    st.record_cache_hit(request_ns=500, queue_ns=0, lookup_ns=100)
    got = st.to_pb("m", 1)
    assert got.inference_stats.success.count == 1 and got.inference_stats.success.ns == 500
    assert got.inference_stats.queue.count == 1
    assert (got.inference_stats.cache_hit.count, got.inference_stats.cache_hit.ns) == (1, 100)
    assert got.inference_count == 0 and got.execution_count == 0 and got.last_inference == 0
    assert got.inference_stats.compute_infer.count == 0


def test_miss_adds_lookup_and_insert_to_the_request() -> None:
    st = ModelVersionStats()
    st.record_success(1000, 1, pb.Timing(batch_leader=True, batch_size=1))
    st.record_cache_miss(70)
    got = st.to_pb("m", 1)
    assert (got.inference_stats.success.count, got.inference_stats.success.ns) == (1, 1070)
    assert (got.inference_stats.cache_miss.count, got.inference_stats.cache_miss.ns) == (1, 70)


# ---------------------------------------------------------------- the flag


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_cache_config_flag_reaches_the_gateway_settings(command: str) -> None:
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    extra = ["--model-repository", "/m", "--redis-url", "redis://r"] if command == "gateway" else []
    flags = ["--cache-config", "redis,host=h", "--cache-config", "redis,size=100"]
    settings = _settings(parser, parser.parse_args([command, *extra, *flags]), Settings())
    assert settings.gateway.response_cache == CacheConfig("redis", 100, "h")
    none = _settings(parser, parser.parse_args([command, *extra]), Settings())
    assert none.gateway.response_cache is None
    with pytest.raises(SystemExit):
        _settings(parser, parser.parse_args([command, *extra, "--cache-config", "x"]), Settings())


def test_cache_config_flag_reaches_the_scheduler_settings() -> None:
    """A scheduler keeps the cache of ensemble steps (services/scheduler/step_cache.py)."""
    from stageserve.cli import _settings, build_parser

    parser = build_parser()
    extra = ["--redis-url", "redis://r"]
    config = CacheConfig("local", 4096)
    args = parser.parse_args(["scheduler", *extra, *config.argv()])
    assert _settings(parser, args, Settings()).scheduler.response_cache == config
    plain = parser.parse_args(["scheduler", *extra])
    assert _settings(parser, plain, Settings()).scheduler.response_cache is None


# ------------------------------------------------------------ ensemble steps


def _step_spec(cache: bool):
    text = (
        'name: "m" platform: "onnxruntime_onnx" max_batch_size: 8 '
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, '
        '{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        + ("response_cache { enable: true }" if cache else "")
    )
    return to_spec(parse_config_text(text))


def test_a_step_hits_what_a_direct_request_stored_and_marks_its_stat() -> None:
    from services.scheduler.step_cache import StepCache

    async def body() -> None:
        local = LocalCache(1 << 20)
        steps = StepCache(local)
        spec = _step_spec(cache=True)
        inputs = [_t("IN", b"\x00" * 16)]
        runs: list[int] = []

        async def execute() -> pb.ScheduleResponse:
            runs.append(1)
            return pb.ScheduleResponse(outputs=[_t("A", b"a" * 16), _t("B", b"b" * 16)])

        def step(outputs: list[str]) -> pb.ScheduleRequest:
            return pb.ScheduleRequest(
                model="m", version=1, config_generation=3, inputs=inputs, outputs=outputs
            )

        # every output named: the entry of a direct request for all (the gateway's key)
        await local.insert(request_key("m", 1, 3, inputs, []), encode_entry([_t("A", b"x" * 16)]))
        stat = pb.StepStat()
        got = await steps.run(step(["A", "B"]), spec, stat, execute)
        assert [t.raw for t in got.outputs] == [b"x" * 16] and not runs
        assert stat.cache_hit and not stat.cache_miss and stat.cache_ns > 0
        # another set of outputs: a miss, run and kept
        stat = pb.StepStat()
        await steps.run(step(["B"]), spec, stat, execute)
        assert runs == [1] and stat.cache_miss and not stat.cache_hit
        stat = pb.StepStat()
        await steps.run(step(["B"]), spec, stat, execute)
        assert runs == [1] and stat.cache_hit
        # a model without response_cache: always run, nothing marked
        stat = pb.StepStat()
        await steps.run(step(["B"]), _step_spec(cache=False), stat, execute)
        assert runs == [1, 1] and not (stat.cache_hit or stat.cache_miss)

    asyncio.run(body())


# ------------------------------------------------------------------ metrics


def test_hit_and_miss_move_statistics_and_triton_counters_together() -> None:
    from stageserve.recorder import RequestRecorder
    from stageserve.statistics import StatsBook
    from stageserve.telemetry import TritonMetrics, model_labels

    book, metrics = StatsBook(), TritonMetrics()
    rec = RequestRecorder(book, metrics)
    model = "cache_metrics_model"  # REGISTRY's phase histograms are process-wide
    rec.success(model, 1, 4_000_000, 1, pb.Timing(batch_leader=True, batch_size=1))
    rec.cache_miss(model, 1, 30_000)
    rec.cache_hit(model, 1, 500_000, 0, 20_000)
    labels = model_labels(model, 1)
    got = {
        name: metrics.get(name, labels)
        for name in (
            "nv_inference_request_success",
            "nv_inference_count",
            "nv_inference_exec_count",
            "nv_inference_request_duration_us",
            "nv_cache_num_hits_per_model",
            "nv_cache_hit_duration_per_model",
            "nv_cache_num_misses_per_model",
            "nv_cache_miss_duration_per_model",
        )
    }
    assert got == {
        "nv_inference_request_success": 2,  # a hit is a success
        "nv_inference_count": 1,  # not an inference
        "nv_inference_exec_count": 1,
        "nv_inference_request_duration_us": 4000 + 30 + 500,
        "nv_cache_num_hits_per_model": 1,
        "nv_cache_hit_duration_per_model": 20,
        "nv_cache_num_misses_per_model": 1,
        "nv_cache_miss_duration_per_model": 30,
    }
    st = book.of(model, 1).to_pb(model, 1).inference_stats
    assert (st.success.count, st.cache_hit.count, st.cache_miss.count) == (2, 1, 1)
    assert "nv_cache_num_hits_per_model{" in metrics.render()


def test_cache_wide_metrics_count_as_tritons() -> None:
    """Triton 2.51's nv_cache_* gauges: present (0) once the cache is, lookups
    split into hits and misses, durations in microseconds, entries and
    utilization as the last insertion left the cache."""
    metrics = TritonMetrics()
    cache = CacheMetrics(1000, metrics)
    text = metrics.render()
    for name in ("nv_cache_util", "nv_cache_num_entries", "nv_cache_num_lookups"):
        assert f"# TYPE {name} gauge\n{name} 0\n" in text
    cache.looked_up(False, 2_500)
    cache.inserted(CacheUsage(evicted=0, entries=1, held=250), 4_000)
    cache.looked_up(True, 1_500)
    cache.inserted(CacheUsage(evicted=2, entries=3, held=500), 1_000)
    cache.inserted(None, 3_000)  # Redis away: the state stays as it was
    got = {n: metrics.get(n, ()) for n in (
        "nv_cache_num_lookups", "nv_cache_num_hits", "nv_cache_num_misses",
        "nv_cache_lookup_duration", "nv_cache_insertion_duration", "nv_cache_num_evictions",
        "nv_cache_num_entries", "nv_cache_util",
    )}  # fmt: skip
    assert got == {
        "nv_cache_num_lookups": 2,
        "nv_cache_num_hits": 1,
        "nv_cache_num_misses": 1,
        "nv_cache_lookup_duration": 3,  # each in whole microseconds: 2 + 1
        "nv_cache_insertion_duration": 8,
        "nv_cache_num_evictions": 2,
        "nv_cache_num_entries": 3,
        "nv_cache_util": 0.5,
    }
