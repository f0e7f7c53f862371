"""bench/script_lane.py runs both ways against a real redis-server, and the
commit it measures keeps what it says it keeps."""

from __future__ import annotations

import asyncio

import redis

from bench.script_lane import measure


def test_both_ways_are_measured_and_the_commit_lands(redis_url: str) -> None:
    results = asyncio.run(measure(redis_url, calls=20, rounds=1, rows=3))
    assert [name for name, _, _ in results] == ["redis-py", "lane"]
    assert all(cpu > 0 and wall > 0 for _, cpu, wall in results)
    r = redis.Redis.from_url(redis_url)
    try:
        for i in range(3):
            assert r.hget(f"ss:bench:i:{i}", "st:ACC_OUT") == b"\x01\0\0\0"
            assert 0 < r.pttl(f"ss:bench:i:{i}") <= 5000
            assert r.hget(f"ss:bench:i:{i}", "slot") == str(i).encode()  # from its START
    finally:
        r.close()
