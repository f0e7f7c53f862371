"""The Acquire's instance filters (services/ratelimiter/lua.py ACQUIRE) against
a real redis-server, in both rate-limit modes: `only` names the instances a
sequence model's pinned groups need, `other_than` the ones a new group
should avoid while the pool has another."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.ratelimiter.options import EXECUTION_COUNT, OFF
from services.ratelimiter.registry import Busy, Gone, Grant, Instance, RedisRegistry
from stageserve.settings import RateLimiterSettings

P = "test:rlf:"
LONG = 60_000


def run(url: str, mode: str, body):
    async def main():
        r = aioredis.from_url(url)
        try:
            await r.flushdb()
            reg = RedisRegistry(r, P, mode=mode, settings=RateLimiterSettings())
            for worker, iids in (("w1", ("a", "b")), ("w2", ("c",))):
                insts = [
                    Instance(i, "m", 1, "KIND_CPU", -1, worker, f"addr-{worker}") for i in iids
                ]
                await reg.register(worker, f"addr-{worker}", insts, LONG)
            return await body(reg, r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def granted(got: Grant | Busy | Gone) -> str:
    assert isinstance(got, Grant), got
    return got.instance.instance_id


@pytest.mark.parametrize("mode", [OFF, EXECUTION_COUNT])
def test_only_names_one_of_the_instances_asked_for_or_says_they_are_gone(redis_url, mode):
    async def body(reg: RedisRegistry, r) -> None:
        assert granted(await reg.attempt("m", 1, LONG, only=["b"])) == "b"
        assert isinstance(await reg.attempt("m", 1, LONG, only=["b"]), Busy)  # b is busy
        assert granted(await reg.attempt("m", 1, LONG, only=["zz", "c"])) == "c"
        assert await reg.attempt("m", 1, LONG, only=["zz", "yy"]) in (
            Gone(("zz", "yy")),
            Gone(("yy", "zz")),
        )
        assert granted(await reg.attempt("m", 1, LONG)) == "a"  # unfiltered: what is left
        await r.delete(f"{P}worker:w2")  # w2's liveness key ran out
        assert await reg.attempt("m", 1, LONG, only=["c"]) == Gone(("c",))

    run(redis_url, mode, body)


@pytest.mark.parametrize("mode", [OFF, EXECUTION_COUNT])
def test_other_than_is_avoided_while_another_instance_is_there(redis_url, mode):
    async def body(reg: RedisRegistry, r) -> None:
        assert granted(await reg.attempt("m", 1, LONG, other_than=["a", "b"])) == "c"
        # every free one is excluded, c is registered (busy): wait for it
        assert isinstance(await reg.attempt("m", 1, LONG, other_than=["a", "b"]), Busy)
        await r.delete(f"{P}worker:w2")  # c's worker died: only a and b are there
        assert granted(await reg.attempt("m", 1, LONG, other_than=["a", "b"])) in ("a", "b")

    run(redis_url, mode, body)
