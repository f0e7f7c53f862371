"""One pipelined Redis connection for a stage's hottest script calls.

A sequence batch's commit is one Lua script call (sequence_lua.py) on every
batch. Through redis-py's client that call costs the caller 218-230 us of
CPU on the 2-core VM (the commit of four sequences, `python -m
bench.script_lane`), most of it the client's layers around one write and
one read: the command wrappers, the pool's checkout, the retry wrapper, the
stream reader. This lane keeps one connection open, writes the packed
command and hands the replies back in order as hiredis parses them: 87-99
us per call in the same run. Concurrent calls pipeline on it.

A lane talks to the server its client talks to, as the same user, to the
same database, with the same timeouts, and retries as the client does (a
broken or timed-out connection is closed and the next try reopens it;
stageserve/redis_connect.py says why the retried scripts allow it). Clients
it cannot follow (TLS, a credential provider) get no lane (`of` returns
None) and their callers keep redis-py's own script calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.typing import EncodableT


def _packed(args: Sequence[EncodableT]) -> bytes:
    return hiredis.pack_command(tuple(args))  # type: ignore[arg-type]  # (its stub: one item)


class _Replies(asyncio.Protocol):
    """The connection's reading side: replies to the waiting calls, in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=rex.ResponseError)
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # any loop's stream transport (asyncio's or uvloop's, which is not
        # an asyncio.Transport subclass)
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                waiter = self.waiting.popleft()
                if not waiter.done():  # (a cancelled caller's reply is dropped)
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError):  # bytes no call can be answered with
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(rex.ConnectionError("Connection closed by server."))


class ScriptLane:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        host: str = "",
        port: int = 0,
        path: str = "",
        hello: Sequence[Sequence[EncodableT]] = (),
        timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._hello = [tuple(c) for c in hello]  # AUTH, SELECT: before the first call
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._retry = client.get_retry()
        self._replies: _Replies | None = None
        self._opening: asyncio.Task[_Replies] | None = None

    @classmethod
    def of(cls, client: aioredis.Redis) -> ScriptLane | None:
        """A lane to the server `client` talks to, or None when the lane
        cannot connect as the client does."""
        conn = client.connection_pool.make_connection()
        if isinstance(conn, SSLConnection) or getattr(conn, "credential_provider", None):
            return None
        hello: list[tuple[EncodableT, ...]] = []
        if conn.password:
            auth = (conn.username, conn.password) if conn.username else (conn.password,)
            hello.append(("AUTH", *auth))
        if int(conn.db):
            hello.append(("SELECT", int(conn.db)))
        options = {
            "hello": hello,
            "timeout_s": conn.socket_timeout,
            "connect_timeout_s": conn.socket_connect_timeout,
        }
        if isinstance(conn, UnixDomainSocketConnection):
            return cls(client, path=conn.path, **options)
        return cls(client, host=conn.host, port=int(conn.port), **options)

    def script(self, text: str) -> LaneScript:
        return LaneScript(self, text)

    def close(self) -> None:
        replies = self._replies
        self._replies = None
        if replies is not None and replies.transport is not None:
            replies.transport.close()

    async def call(self, *args: EncodableT) -> Any:
        """One command's reply (an error reply raised as ResponseError),
        retried as the client retries."""
        if self._retry is None:
            return await self._once(args)
        return await self._retry.call_with_retry(
            lambda: self._once(args), lambda _err: self._broken()
        )

    async def _broken(self) -> None:
        self.close()

    async def _once(self, args: Sequence[EncodableT]) -> Any:
        replies = self._replies
        if replies is None or replies.transport is None:
            replies = await self._open()
        assert replies.transport is not None
        waiter = asyncio.get_running_loop().create_future()
        replies.waiting.append(waiter)
        replies.transport.write(_packed(args))
        reply = await self._reply(waiter)
        if isinstance(reply, rex.ResponseError):
            raise reply
        return reply

    async def _reply(self, waiter: asyncio.Future[Any]) -> Any:
        if self._timeout_s is None:
            return await waiter
        try:
            async with asyncio.timeout(self._timeout_s):
                return await waiter
        except TimeoutError as exc:
            self.close()  # a late reply would answer the next call
            raise rex.TimeoutError("Timeout reading from Redis") from exc

    async def _open(self) -> _Replies:
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._path:
                    _, replies = await loop.create_unix_connection(_Replies, self._path)
                else:
                    _, replies = await loop.create_connection(_Replies, self._host, self._port)
        except (OSError, TimeoutError) as exc:
            raise rex.ConnectionError(f"Error connecting to Redis: {exc}") from exc
        waiters = []
        for command in self._hello:
            waiter = loop.create_future()
            replies.waiting.append(waiter)
            assert replies.transport is not None
            replies.transport.write(_packed(command))
            waiters.append(waiter)
        for waiter in waiters:
            reply = await waiter
            if isinstance(reply, rex.ResponseError):
                if replies.transport is not None:
                    replies.transport.close()
                raise rex.ConnectionError(f"Redis refused the connection: {reply}")
        self._replies = replies
        return replies


class LaneScript:
    """A Lua script called through a lane: EVALSHA, and EVAL when the server
    does not know the script (it restarted empty), which caches it again.
    Called as redis-py's registered scripts are."""

    def __init__(self, lane: ScriptLane, text: str) -> None:
        self.lane = lane
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(
        self, keys: Sequence[EncodableT] = (), args: Sequence[EncodableT] = ()
    ) -> Any:
        try:
            return await self.lane.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except rex.ResponseError as err:
            if not str(err).startswith("NOSCRIPT"):
                raise
        return await self.lane.call("EVAL", self.text, len(keys), *keys, *args)
