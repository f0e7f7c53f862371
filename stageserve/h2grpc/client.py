"""A gRPC client for the internal streams, on stageserve/h2grpc/connection.py.

Why: every internal link is one long-lived bidirectional stream
(stageserve/transport.py), and grpc.aio's client spends ~200 us of CPU per
message round trip at one call in flight on it (`python -m bench.transport`,
2-core development VM), twice what the own server spends on the other end.
Here a message is one DATA frame built in place and one socket write, and an
answer one parse of the received bytes.

`H2Channel` has the part of `grpc.aio.Channel` the stages' stream links use:
`stream_stream` (so the generated stubs build on it unchanged, their other
methods refusing), `channel_ready` and `close`. A call's response iterator
raises `grpc.aio.AioRpcError` with the status the server sent, or UNAVAILABLE
when the connection fails or ends; a cancelled reader resets its stream. One
connection per channel carries its streams; a connection that failed, was
closed or got a GOAWAY is replaced by the next call. Keepalive as the
stages' grpc channels have it (stageserve/net.py GRPC_OPTIONS): a PING after
10 s without a frame from the server while a call is open, the connection
dropped when nothing answers within 5 s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc

from stageserve.h2grpc import wire
from stageserve.h2grpc.connection import (
    END,
    GOAWAY,
    MESSAGE,
    REQUEST,
    RESET,
    TRAILERS,
    ClientConnection,
    ProtocolError,
)

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
Status = tuple[grpc.StatusCode, str]


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6 address]:port"; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def connect_failure(address: str, exc: BaseException) -> str:
    """Why a connection attempt failed, as a status message: the system's
    words for it, never Python's text of the exception (it can reach a client
    in an UNAVAILABLE message)."""
    if isinstance(exc, ssl.SSLError):
        why = "the TLS handshake failed"
    elif isinstance(exc, TimeoutError):
        why = "timed out"
    elif isinstance(exc, OSError) and exc.errno:
        why = os.strerror(exc.errno)  # (asyncio's own strerror names the address tuple)
    else:
        why = "the connection failed"
    return f"failed to connect to {address}: {why}"


def _status_of(headers: list[tuple[bytes, bytes]] | None) -> Status:
    """The call's status from its trailers (or a trailers-only answer's headers)."""
    code: int | None = None
    message = b""
    for name, value in headers or ():
        if name == b"grpc-status":
            code = int(value) if value.isdigit() else None
        elif name == b"grpc-message":
            message = value
    if code is None:
        return grpc.StatusCode.UNKNOWN, "the server's answer carried no grpc-status"
    details = urllib.parse.unquote_to_bytes(message).decode("utf-8", "replace")
    return _CODES.get(code, grpc.StatusCode.UNKNOWN), details


def _http_status_error(headers: list[tuple[bytes, bytes]]) -> Status | None:
    """A response that is not gRPC's (HTTP status other than 200), as grpc maps it."""
    status = next((value for name, value in headers if name == b":status"), b"")
    if status == b"200":
        return None
    code = {
        b"400": grpc.StatusCode.INTERNAL,
        b"401": grpc.StatusCode.UNAUTHENTICATED,
        b"403": grpc.StatusCode.PERMISSION_DENIED,
        b"404": grpc.StatusCode.UNIMPLEMENTED,
        b"429": grpc.StatusCode.UNAVAILABLE,
        b"502": grpc.StatusCode.UNAVAILABLE,
        b"503": grpc.StatusCode.UNAVAILABLE,
        b"504": grpc.StatusCode.UNAVAILABLE,
    }.get(status, grpc.StatusCode.UNKNOWN)
    return code, f"Received http2 header with status: {status.decode('latin-1')}"


class _ClientProtocol(asyncio.Protocol):
    """One connection to the server: frames in, to the calls on it."""

    def __init__(self, keepalive_s: float, keepalive_timeout_s: float) -> None:
        self.conn = ClientConnection()
        self.calls: dict[int, StreamCall] = {}
        self.transport: asyncio.Transport | None = None
        self.going_away = False
        self._loop = asyncio.get_running_loop()
        self._window: asyncio.Future[None] | None = None  # writers waiting for window
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._last_in = self._loop.time()
        self._pinged_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.going_away

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # any loop's stream transport (asyncio's or uvloop's, which is not
        # an asyncio.Transport subclass)
        self.transport = cast("asyncio.Transport", transport)
        self.flush()
        self._timer = self._loop.call_later(self._keepalive_s, self._keepalive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
        errno = getattr(exc, "errno", None)
        details = os.strerror(errno) if errno else "Socket closed"  # grpc's words for it
        for call in list(self.calls.values()):
            call.finish((grpc.StatusCode.UNAVAILABLE, details))
        self._open_window()

    def data_received(self, data: bytes) -> None:
        self._last_in = self._loop.time()
        try:
            events = self.conn.receive(data)
        except ProtocolError as exc:
            log.warning("closing a server connection", extra={"error": str(exc)})
            self.conn.goaway(exc.code, str(exc).encode()[:200])
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        calls = self.calls
        for kind, sid, value in events:
            if kind == MESSAGE:
                call = calls.get(sid)
                if call is not None:
                    call.message(value)
            elif kind == REQUEST:
                call = calls.get(sid)
                if call is not None:
                    call.headers(value)
            elif kind == TRAILERS:
                call = calls.get(sid)
                if call is not None:
                    call.trailers = value
            elif kind == END:
                call = calls.get(sid)
                if call is not None:
                    call.ended()
            elif kind == RESET:
                call = calls.get(sid)
                if call is not None:
                    call.reset(value)
            elif kind == GOAWAY:
                self._goaway(*value)
        self.flush()
        if self._window is not None and not self.conn.waiting_for_window():
            self._open_window()

    def _goaway(self, last_sid: int, code: int) -> None:
        """No new calls here; those the server did not take end UNAVAILABLE."""
        self.going_away = True
        for sid, call in list(self.calls.items()):
            if sid > last_sid:
                call.finish((grpc.StatusCode.UNAVAILABLE, f"the server went away (GOAWAY {code})"))
        if not self.calls and self.transport is not None:
            self.transport.close()

    def flush(self) -> None:
        if self.transport is not None and self.conn.has_output():
            self.conn.write_to(self.transport)

    def forget(self, sid: int, rst: int | None) -> None:
        """A call is over: its stream is reset with `rst` while the server has
        not ended it, so its handler stops too (None: the server reset it)."""
        self.calls.pop(sid, None)
        if rst is not None and self.conn.unfinished(sid):
            self.conn.reset(sid, rst)
        else:
            self.conn.forget(sid)
        self.flush()
        if self._window is not None and not self.conn.waiting_for_window():
            self._open_window()  # what waited behind this stream's frames
        if self.going_away and not self.calls and self.transport is not None:
            self.transport.close()

    async def window_open(self) -> None:
        """Until the server's flow-control windows take what is queued."""
        while self.conn.waiting_for_window() and self.transport is not None:
            if self._window is None:
                self._window = self._loop.create_future()
            await asyncio.shield(self._window)

    def _open_window(self) -> None:
        window, self._window = self._window, None
        if window is not None and not window.done():
            window.set_result(None)

    def _keepalive(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        idle = self._loop.time() - self._last_in
        if not self.calls:  # nothing waits on the server: no ping
            self._timer = self._loop.call_later(self._keepalive_s, self._keepalive)
        elif idle >= self._keepalive_s:
            self.conn.ping()
            self.flush()
            self._pinged_at = self._loop.time()
            self._timer = self._loop.call_later(self._keepalive_timeout_s, self._ping_answered)
        else:
            self._timer = self._loop.call_later(self._keepalive_s - idle, self._keepalive)

    def _ping_answered(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        # Anything received since the ping answers it (its ACK, or other
        # frames first). A timer may fire late on a busy loop, so the check
        # is not how long ago the last frame came.
        if self._last_in < self._pinged_at:
            log.warning("a server stopped answering; its connection is dropped")
            self.transport.abort()
            return
        self._timer = self._loop.call_later(self._keepalive_s, self._keepalive)

    def close(self) -> None:
        for call in list(self.calls.values()):
            call.cancel()
        if self.transport is not None:
            self.transport.close()


class StreamCall:
    """One bidirectional streaming call: iterate it for the responses."""

    def __init__(
        self,
        channel: H2Channel,
        block: bytes,
        serialize: Callable[[Any], bytes],
        deserialize: Callable[[bytes], Any],
        requests: AsyncIterator[Any],
    ) -> None:
        self._channel = channel
        self._block = block
        self._serialize = serialize
        self._deserialize = deserialize
        self._requests = requests
        self._responses: deque[bytes] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._status: Status | None = None
        self._connection: _ClientProtocol | None = None
        self._writer: asyncio.Task[None] | None = None
        self.sid = 0
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self._first: list[tuple[bytes, bytes]] | None = None

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> Any:
        if self._connection is None and self._status is None:
            await self._start()
        responses = self._responses
        while not responses:
            status = self._status
            if status is not None:
                if status[0] is grpc.StatusCode.OK:
                    raise StopAsyncIteration
                raise rpc_error(*status)
            self._wake = wake = asyncio.get_running_loop().create_future()
            try:
                await wake
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self._wake = None
        data = responses.popleft()
        try:
            return self._deserialize(data)
        except Exception:
            self.cancel(grpc.StatusCode.INTERNAL, "a response could not be parsed")
            raise rpc_error(grpc.StatusCode.INTERNAL, "a response could not be parsed") from None

    async def _start(self) -> None:
        try:
            connection = await self._channel.connection()
        except asyncio.CancelledError:
            self.finish((grpc.StatusCode.CANCELLED, "cancelled"))
            raise
        except (OSError, ssl.SSLError) as exc:  # (TimeoutError is an OSError)
            self.finish((grpc.StatusCode.UNAVAILABLE, connect_failure(self._channel.address, exc)))
            return
        except grpc.aio.UsageError:
            self.finish((grpc.StatusCode.CANCELLED, "the channel is closed"))
            return
        if self._status is not None:  # cancelled while connecting
            return
        self._connection = connection
        self.sid = connection.conn.open_stream(self._block)
        connection.calls[self.sid] = self
        connection.flush()
        self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        connection = self._connection
        assert connection is not None
        conn, sid = connection.conn, self.sid
        try:
            async for message in self._requests:
                if self._status is not None:
                    return
                conn.send_message(sid, self._serialize(message))
                connection.flush()
                if conn.waiting_for_window():
                    await connection.window_open()
            if self._status is None:
                conn.end_stream(sid)
                connection.flush()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a stream's requests failed")
            self.cancel(grpc.StatusCode.UNKNOWN, "the requests of the call failed")

    # -- events from the connection -------------------------------------------

    def headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._first = headers
        failed = _http_status_error(headers)
        if failed is not None:
            self.finish(failed)

    def message(self, value: tuple[bool, bytes]) -> None:
        compressed, data = value
        if compressed:
            self.finish((grpc.StatusCode.INTERNAL, "a compressed response, never asked for"))
            return
        self._responses.append(data)
        self._wakeup()

    def ended(self) -> None:
        status = _status_of(self.trailers if self.trailers is not None else self._first)
        self.finish(status, rst=wire.NO_ERROR)

    def reset(self, code: int) -> None:
        if code == wire.CANCEL:
            status = grpc.StatusCode.CANCELLED
        elif code == wire.REFUSED_STREAM:
            status = grpc.StatusCode.UNAVAILABLE
        else:
            status = grpc.StatusCode.INTERNAL
        self.finish((status, f"Received RST_STREAM with error code {code}"), rst=None)

    # -- the end --------------------------------------------------------------

    def finish(self, status: Status, rst: int | None = wire.CANCEL) -> None:
        """The call's status; the responses already received are still read
        first. `rst`: the reset its stream gets if still open on this side."""
        if self._status is not None:
            return
        self._status = status
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        connection = self._connection
        if connection is not None:
            connection.forget(self.sid, rst)
        self._wakeup()

    def cancel(
        self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, details: str = "cancelled"
    ) -> None:
        """This side ends the call: its stream is reset."""
        self.finish((code, details))

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


def _as_is(message: Any) -> Any:
    return message


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise NotImplementedError("H2Channel carries streaming calls only")


class H2Channel:
    """The client end of one stage's address, for its streaming calls."""

    def __init__(
        self,
        address: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        keepalive_s: float = 10.0,
        keepalive_timeout_s: float = 5.0,
        connect_timeout_s: float = 20.0,
    ) -> None:
        """`connect_timeout_s`: the longest a connection attempt may take (a
        host that drops the handshake), as grpc's 20 s minimum connect timeout."""
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._host, self._port = split_address(address)
        self._ssl = ssl_context
        self._server_hostname = server_hostname
        self._keepalive = (keepalive_s, keepalive_timeout_s)
        self._connection: _ClientProtocol | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        scheme = b"\x87" if ssl_context is not None else b"\x86"  # :scheme https / http
        self._head = (
            b"\x83"  # :method POST
            + scheme
            + wire.hpack_literal(b":authority", address.encode("ascii"))
        )
        self._tail = (
            wire.hpack_literal(b"content-type", b"application/grpc")
            + wire.hpack_literal(b"te", b"trailers")
            + wire.hpack_literal(b"user-agent", b"stageserve-h2grpc")
        )

    async def connection(self) -> _ClientProtocol:
        """The channel's connection, opened when there is none to use."""
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        connection = self._connection
        if connection is not None and connection.usable:
            return connection
        async with self._lock:
            connection = self._connection
            if connection is None or not connection.usable:
                connection = await self._open()
                self._connection = connection
            return connection

    async def _open(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        keepalive_s, timeout_s = self._keepalive
        options: dict[str, Any] = {}
        if self._ssl is not None:
            options = {"ssl": self._ssl, "server_hostname": self._server_hostname or self._host}
        async with asyncio.timeout(self._connect_timeout_s):
            _, connection = await loop.create_connection(
                lambda: _ClientProtocol(keepalive_s, timeout_s), self._host, self._port, **options
            )
        return connection

    async def channel_ready(self) -> None:
        """Until a connection is open, redialling as the stages' grpc channels
        do (stageserve/net.py: from 100 ms, x1.6, at most 1 s apart)."""
        delay = 0.1
        while True:
            try:
                await self.connection()
                return
            except (OSError, ssl.SSLError):
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 1.6)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **_options: Any,
    ) -> Callable[[AsyncIterator[Any]], StreamCall]:
        """A streaming method; without (de)serializers its messages are bytes."""
        block = self._head + wire.hpack_literal(b":path", method.encode("ascii")) + self._tail
        serialize = request_serializer or _as_is
        deserialize = response_deserializer or _as_is

        def call(requests: AsyncIterator[Any]) -> StreamCall:
            return StreamCall(self, block, serialize, deserialize, requests)

        return call

    def unary_unary(self, *_args: Any, **_kwargs: Any) -> Callable[..., Any]:
        return _refuse

    unary_stream = stream_unary = unary_unary

    async def close(self) -> None:
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
