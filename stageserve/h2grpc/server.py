"""An asyncio gRPC server on stageserve/h2grpc/connection.py, with the
surface of `grpc.aio.Server` that StageServe's fronts use.

Why: grpcio's Python servers spend ~290-370 us of CPU on every unary call
whatever the handler does (bench.ceiling's `direct`, 2-core development VM),
more than the whole gateway behind the HTTP front. This server answers the
same call for ~50-85 us (`h2-direct`), because a call is a few frames parsed
and built in place, one task, and one socket write shared by every answer
ready in the same loop turn. Figures: docs/benchmarks.md, "The public gRPC
front on its own HTTP/2 server".

What it takes from grpcio: the method handlers (`grpc.RpcMethodHandler`, so
the generated `add_*Servicer_to_server` functions register services
unchanged), `grpc.aio.ServerInterceptor`s, `grpc.StatusCode`, and
`grpc.aio.AbortError` as what `context.abort` raises. A handler gets a
context with grpc.aio's methods (abort, set_code/set_details,
invocation_metadata, peer, time_remaining, cancelled, write, read,
send_initial_metadata, set_trailing_metadata, add_done_callback).

Semantics as grpc.aio's, but for an unknown method, which answers
UNIMPLEMENTED without a message as Triton's C++ gRPC server does; a
handler's unexpected exception answers UNKNOWN (with a fixed text: no
exception text leaves the process); a client's reset or a passed
grpc-timeout cancels the handler's task (the latter answering
DEADLINE_EXCEEDED); `stop(grace)` refuses new calls (GOAWAY), lets calls in
flight finish for `grace` seconds, then cancels them. Requests compressed
with gzip or deflate are accepted; the answers of the methods given a
compression level (Triton's --grpc-infer-response-compression-level, for
ModelInfer and ModelStreamInfer) are compressed as Triton compresses them
(wire.response_encoding), the others are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import grpc

from stageserve.h2grpc import wire
from stageserve.h2grpc.connection import (
    END,
    GOAWAY,
    MESSAGE,
    REQUEST,
    RESET,
    ProtocolError,
    ServerConnection,
)

log = logging.getLogger(__name__)

#: grpc's hard limit on a request's header list (its default
#: GRPC_ARG_ABSOLUTE_MAX_METADATA_SIZE), which Triton 2.51's gRPC front
#: applies: a call over it fails RESOURCE_EXHAUSTED, the connection and its
#: other calls go on (tests/integration/test_grpc_metadata_limit.py).
METADATA_HARD_LIMIT = 16384


def metadata_size(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """A header list's size as HTTP/2 and grpc count it: name, value and 32
    bytes per field, pseudo-headers included."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


Metadata = tuple[tuple[str, str | bytes], ...]
#: Request headers that are the protocol's, not the caller's metadata.
_RESERVED = frozenset(
    {b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
_END = object()  # the client's end of stream, in a streaming call's queue
#: The status message of a call to a method nobody serves: none, as gRPC's C++
#: server answers (Triton 2.51 answers UNIMPLEMENTED with empty details;
#: grpc.aio says "Method not found!").
UNKNOWN_METHOD = ""


class HandlerCallDetails(NamedTuple):
    """What an interceptor sees of a call (grpc.HandlerCallDetails's fields)."""

    method: str
    invocation_metadata: Metadata


class _Abort(grpc.aio.AbortError):
    pass


class ServicerContext:
    """One call's context, with the grpc.aio.ServicerContext methods handlers use."""

    __slots__ = (
        "_call",
        "_code",
        "_details",
        "_trailing",
        "_callbacks",
    )

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._code: grpc.StatusCode = grpc.StatusCode.OK
        self._details = ""
        self._trailing: Metadata = ()
        self._callbacks: list[Callable[[ServicerContext], None]] = []

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()
    ) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort with StatusCode.OK")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise _Abort()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def invocation_metadata(self) -> Metadata:
        return self._call.metadata

    def peer(self) -> str:
        return self._call.connection.peer

    def time_remaining(self) -> float | None:
        deadline = self._call.deadline
        if deadline is None:
            return None
        return max(0.0, deadline - asyncio.get_running_loop().time())

    def cancelled(self) -> bool:
        return self._call.cancelled

    def done(self) -> bool:
        return self._call.finished

    def add_done_callback(self, callback: Callable[[ServicerContext], None]) -> None:
        self._callbacks.append(callback)

    async def send_initial_metadata(self, initial_metadata: Metadata) -> None:
        self._call.send_headers(wire.metadata_fields(initial_metadata))

    async def write(self, message: Any) -> None:
        self._call.send_message(message)

    async def read(self) -> Any:
        return await self._call.read()


class _Call:
    """One RPC on a connection: its handler, its request and its task."""

    __slots__ = (
        "connection",
        "sid",
        "method",
        "headers",
        "_metadata",
        "encoding",
        "compression",
        "deadline",
        "timer",
        "handler",
        "payload",
        "queue",
        "task",
        "context",
        "headers_sent",
        "cancelled",
        "finished",
        "expired",
    )

    def __init__(self, connection: _Connection, sid: int, method: str) -> None:
        self.connection = connection
        self.sid = sid
        self.method = method
        self.headers: list[tuple[bytes, bytes]] = []  # as received
        self._metadata: Metadata | None = None
        self.encoding = b"identity"
        self.compression: bytes | None = None  # the answers' algorithm (None: none)
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.handler: grpc.RpcMethodHandler | None = None
        self.payload: tuple[bool, bytes] | None = None
        self.queue: asyncio.Queue[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.context = ServicerContext(self)
        self.headers_sent = False
        self.cancelled = False
        self.finished = False
        self.expired = False

    @property
    def metadata(self) -> Metadata:
        """The caller's metadata (grpc.aio's invocation_metadata), built from the
        headers when first asked: most calls never ask."""
        if self._metadata is None:
            self._metadata = tuple(
                (key, wire.decode_metadata_value(key, value))
                for key, value in (
                    (name.decode("latin-1"), value)
                    for name, value in self.headers
                    if name[:1] != b":" and name not in _RESERVED
                )
            )
        return self._metadata

    # -- output ---------------------------------------------------------------

    def _response_headers(self) -> bytes:
        if self.compression is None:
            return wire.RESPONSE_HEADERS
        return wire.ENCODED_RESPONSE_HEADERS[self.compression]

    def send_headers(self, extra: bytes = b"") -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self.connection.conn.send_headers(self.sid, self._response_headers() + extra)
            self.connection.flush_soon()

    def send_message(self, message: Any) -> None:
        if self.finished or self.cancelled or self.expired:
            raise asyncio.InvalidStateError("the call is over")
        handler = self.handler
        assert handler is not None
        data = handler.response_serializer(message) if handler.response_serializer else message
        self.send_headers()
        self._send_data(data)
        self.connection.flush_soon()

    def _send_data(self, data: bytes | wire.MessageParts) -> None:
        if self.compression is not None:
            whole = b"".join(data) if isinstance(data, wire.MessageParts) else data
            packed = wire.compress(self.compression, whole)
            if packed is not None:
                self.connection.conn.send_message(self.sid, packed, compressed=True)
                return
        self.connection.conn.send_message(self.sid, data)

    def finish(
        self,
        code: grpc.StatusCode,
        message: str = "",
        response: bytes | wire.MessageParts | None = None,
    ) -> None:
        """The call's last frames: the response (if any) and its status."""
        if self.finished:
            return
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        if self.expired:
            # Past the deadline only DEADLINE_EXCEEDED goes out, as from grpc's
            # server: a handler can still end normally when it drops the cancel
            # `expire` sent (Python 3.11's wait_for does, CPython gh-86296).
            code, message, response = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None
        context = self.context
        if not self.cancelled and self.connection.conn.is_open(self.sid):
            try:
                self._send_end(code.value[0], message, context._trailing, response)
            except Exception:  # trailing metadata or an answer that cannot be encoded
                log.exception("a call's answer could not be encoded", extra={"method": self.method})
                self._send_end(grpc.StatusCode.INTERNAL.value[0], "answer not encodable", (), None)
            self.connection.flush_soon()
        self.connection.calls.pop(self.sid, None)
        for callback in context._callbacks:
            try:
                callback(context)
            except Exception:
                log.exception("a call's done callback failed", extra={"method": self.method})

    def _send_end(
        self,
        code: int,
        message: str,
        trailing: Metadata,
        response: bytes | wire.MessageParts | None,
    ) -> None:
        conn = self.connection.conn
        block = (
            wire.OK_TRAILERS
            if code == 0 and not trailing
            else wire.trailers(code, message, trailing)
        )
        if not self.headers_sent and response is None:
            # Trailers-only: one HEADERS frame carries status and trailers.
            conn.send_headers(self.sid, wire.TRAILERS_ONLY_HEADERS + block, end_stream=True)
            return
        if not self.headers_sent:
            self.headers_sent = True
            conn.send_headers(self.sid, self._response_headers())
        if response is not None:
            if isinstance(response, wire.MessageParts):
                self._send_data(response)
            elif isinstance(response, bytes | bytearray | memoryview):
                self._send_data(bytes(response))
            else:
                raise TypeError(f"the answer is {type(response).__name__}, not bytes")
        conn.send_headers(self.sid, block, end_stream=True)

    # -- input ----------------------------------------------------------------

    def request(self, compressed: bool, data: bytes) -> Any:
        handler = self.handler
        assert handler is not None
        if compressed:
            data = self._decompress(data)
        return handler.request_deserializer(data) if handler.request_deserializer else data

    def _decompress(self, data: bytes) -> bytes:
        if self.encoding == b"gzip":
            return zlib.decompress(data, 31)
        if self.encoding == b"deflate":
            return zlib.decompress(data)
        raise _Unsupported(self.encoding.decode("latin-1"))

    async def read(self) -> Any:
        assert self.queue is not None
        item = await self.queue.get()
        if item is _END:
            self.queue.put_nowait(_END)
            return grpc.aio.EOF
        return self.request(*item)

    async def requests(self) -> AsyncIterator[Any]:
        while True:
            item = await self.read()
            if item is grpc.aio.EOF:
                return
            yield item

    # -- lifecycle ------------------------------------------------------------

    def cancel(self) -> None:
        """The client reset the stream or went away: no more frames for it."""
        if self.finished:
            return
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()
        else:
            self.finish(grpc.StatusCode.CANCELLED)

    def expire(self) -> None:
        self.timer = None
        if self.finished:
            return
        self.expired = True
        if self.task is not None:
            self.task.cancel()
        else:
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class _Unsupported(Exception):
    pass


class _Connection(asyncio.Protocol):
    """One client connection: frames in, calls started, answers out."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.conn = ServerConnection()
        self.calls: dict[int, _Call] = {}
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self._flush_pending = False
        self._loop = asyncio.get_running_loop()
        self.closing = False
        self.going_away = False  # past its max age: new calls are refused
        self._aging: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # any loop's stream transport (asyncio's or uvloop's, which is not
        # an asyncio.Transport subclass)
        self.transport = cast("asyncio.Transport", transport)
        self.peer = _peer(transport.get_extra_info("peername"))
        _keepalive(transport.get_extra_info("socket"))
        self.server._connections.add(self)
        if self.server._stopping:
            self.conn.goaway()
        self.transport.write(self.conn.data_to_send())
        age = self.server._max_age_s
        if age is not None:
            # grpc's +-10 % jitter: connections made together do not all end together
            self._aging = self._loop.call_later(age * random.uniform(0.9, 1.1), self._aged)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        self.transport = None
        if self._aging is not None:
            self._aging.cancel()
        for call in list(self.calls.values()):
            call.cancel()

    def _aged(self) -> None:
        """The connection reached its max age (Triton's --grpc-max-connection-age),
        ended as grpc's C++ server ends it (tests/integration/test_grpc_connection_age.py):
        a GOAWAY announcing the end, a PING, a GOAWAY naming the last stream
        taken; new calls are refused, calls in flight finish (cancelled once
        the grace, if given, is over), then the connection closes."""
        self._aging = None
        if self.transport is None or self.going_away:
            return
        self.going_away = True
        self.conn.goaway(last_stream_id=2**31 - 1)
        self.conn.ping()
        self.conn.goaway()
        self.closing = True
        self.flush()
        grace = self.server._max_age_grace_s
        if grace is not None and self.calls:
            self._loop.call_later(grace, self._grace_over)

    def _grace_over(self) -> None:
        for call in list(self.calls.values()):
            call.cancel()
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive(data)
        except ProtocolError as exc:
            log.info("closing a client connection", extra={"peer": self.peer, "error": str(exc)})
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
                    self._message(call, value)
            elif kind == REQUEST:
                self._request(sid, value)
            elif kind == END:
                call = calls.get(sid)
                if call is not None:
                    self._end(call)
            elif kind == RESET:
                call = calls.get(sid)
                if call is not None:
                    call.cancel()
            elif kind == GOAWAY:
                self.closing = True
        self.flush()

    def flush_soon(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        if self.transport is not None and self.conn.has_output():
            self.conn.write_to(self.transport)
            if self.closing and not self.calls:
                self.transport.close()

    # -- calls ----------------------------------------------------------------

    def _request(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        server = self.server
        if server._stopping or self.going_away:
            self.conn.reset(sid, wire.REFUSED_STREAM)
            return
        path = b""
        timeout = encoding = accepted = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-accept-encoding":
                accepted = value
        call = _Call(self, sid, path.decode("latin-1"))
        call.headers = headers
        size = metadata_size(headers)
        if size > METADATA_HARD_LIMIT:
            self.calls[sid] = call
            call.finish(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"received metadata size exceeds hard limit ({size} vs. {METADATA_HARD_LIMIT})",
            )
            return
        if encoding is not None:
            call.encoding = encoding
        level = server._compression.get(path)
        if level is not None:
            call.compression = wire.response_encoding(level, accepted)
        self.calls[sid] = call
        if timeout is not None:
            seconds = wire.parse_timeout(timeout.decode("latin-1"))
            if seconds is not None:
                call.deadline = self._loop.time() + seconds
                call.timer = self._loop.call_later(seconds, call.expire)
        if server._interceptors:  # the handler is known once they have run
            call.queue = asyncio.Queue()
            call.task = self._loop.create_task(self._intercepted(call))
            return
        call.handler = server._registered.get(path) or server._generic_handler(
            HandlerCallDetails(call.method, call.metadata)
        )
        if call.handler is None:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, UNKNOWN_METHOD)
        elif call.handler.request_streaming:
            self._start_streaming(call)

    def _start_streaming(self, call: _Call) -> None:
        call.queue = asyncio.Queue()
        call.task = self._loop.create_task(_run(call, call.requests()))

    def _message(self, call: _Call, value: tuple[bool, bytes]) -> None:
        if call.queue is not None:
            call.queue.put_nowait(value)
        elif call.payload is None:
            call.payload = value
        elif call.task is None:  # a second message for a unary request
            call.finish(grpc.StatusCode.INTERNAL, "more than one request message")

    def _end(self, call: _Call) -> None:
        if call.queue is not None:
            call.queue.put_nowait(_END)
        elif call.handler is not None and call.task is None and not call.finished:
            call.task = self._loop.create_task(_run_unary_request(call))

    async def _intercepted(self, call: _Call) -> None:
        """Resolve the handler through the interceptors, then run the call on
        what the queue gathered meanwhile."""
        queue = call.queue
        assert queue is not None
        try:
            call.handler = await self.server._intercept(
                HandlerCallDetails(call.method, call.metadata)
            )
            if call.handler is None:
                call.finish(grpc.StatusCode.UNIMPLEMENTED, UNKNOWN_METHOD)
                return
            if call.handler.request_streaming:
                await _run(call, call.requests())
                return
            first = await queue.get()
            if first is _END:
                call.finish(grpc.StatusCode.INTERNAL, "request message missing")
                return
            if await queue.get() is not _END:
                call.finish(grpc.StatusCode.INTERNAL, "more than one request message")
                return
            call.payload = first
        except asyncio.CancelledError:
            _cancelled(call)
            return
        call.queue = None
        await _run_unary_request(call)


async def _run_unary_request(call: _Call) -> None:
    if call.payload is None:
        call.finish(grpc.StatusCode.INTERNAL, "request message missing")
        return
    try:
        request = call.request(*call.payload)
    except _Unsupported as exc:
        call.finish(grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm '{exc}' not supported")
        return
    except Exception:
        call.finish(grpc.StatusCode.INTERNAL, "Exception deserializing request!")
        return
    await _run(call, request)


async def _run(call: _Call, request: Any) -> None:
    """Run the handler on `request` (a message, or an async iterator of them)
    and end the call with its answer and status."""
    handler = call.handler
    assert handler is not None
    context = call.context
    try:
        if handler.unary_unary is not None or handler.stream_unary is not None:
            behavior = handler.unary_unary or handler.stream_unary
            response = await behavior(request, context)
            code = context._code
            if code != grpc.StatusCode.OK:
                call.finish(code, context._details)
                return
            data = (
                handler.response_serializer(response) if handler.response_serializer else response
            )
            call.finish(code, context._details, data)
            return
        behavior = handler.unary_stream or handler.stream_stream
        answers = behavior(request, context)
        if hasattr(answers, "__aiter__"):
            async for answer in answers:
                call.send_message(answer)
        else:
            await answers  # writes through context.write
        call.finish(context._code, context._details)
    except grpc.aio.AbortError:
        call.finish(context._code, context._details)
    except asyncio.CancelledError:
        _cancelled(call)
    except _Unsupported as exc:
        call.finish(grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm '{exc}' not supported")
    except Exception:
        log.exception("a gRPC handler raised", extra={"method": call.method})
        call.finish(grpc.StatusCode.UNKNOWN, "Unexpected error in the handler")


def _cancelled(call: _Call) -> None:
    if not call.expired:  # past its deadline, finish answers DEADLINE_EXCEEDED
        call.cancelled = True
    call.finish(grpc.StatusCode.CANCELLED)


class H2GrpcServer:
    """The `grpc.aio.Server` surface StageServe's fronts use, on this module's HTTP/2."""

    def __init__(
        self,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        compression: Mapping[str, str] | None = None,
    ) -> None:
        """`compression`: method path -> Triton's compression level for its
        answers ("none", "low", "medium", "high"); others go uncompressed."""
        self._compression = {
            path.encode(): level
            for path, level in (compression or {}).items()
            if level in wire.COMPRESSING_LEVELS
        }
        given = dict(options)
        self._reuse_port = bool(given.get("grpc.so_reuseport", 1))
        # grpc's channel arguments for Triton's --grpc-max-connection-age(-grace), in ms
        age_ms = given.get("grpc.max_connection_age_ms")
        grace_ms = given.get("grpc.max_connection_age_grace_ms")
        self._max_age_s: float | None = None if age_ms is None else age_ms / 1000
        self._max_age_grace_s: float | None = None if grace_ms is None else grace_ms / 1000
        self._interceptors = list(interceptors)
        self._registered: dict[bytes, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._listeners: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[_Connection] = set()
        self._stopping = False
        self._terminated: asyncio.Event | None = None

    # -- registration -----------------------------------------------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        for name, handler in method_handlers.items():
            self._registered[f"/{service}/{name}".encode()] = handler

    def _generic_handler(self, details: HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def _intercept(self, details: HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        async def lookup(d: HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            return self._registered.get(d.method.encode("latin-1")) or self._generic_handler(d)

        continuation: Callable[[HandlerCallDetails], Any] = lookup
        for interceptor in reversed(self._interceptors):
            continuation = _chain(interceptor, continuation)
        return await continuation(details)

    # -- ports ------------------------------------------------------------------

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        return self._bind(address, context)

    def _bind(self, address: str, context: ssl.SSLContext | None) -> int:
        host, port = _split(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            # Accepted connections inherit it (asyncio sets it only on sockets
            # made with proto IPPROTO_TCP, not on these). Without it a message
            # written while an earlier one is unacknowledged waits for the
            # peer's delayed ACK: on an internal stream, calls stalled ~40-45 ms
            # once or twice a second (docs/benchmarks.md, "The worker's stream
            # on the own HTTP/2 server").
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot bind {address}: {exc.strerror}") from exc
        sock.setblocking(False)
        self._listeners.append((sock, context))
        return int(sock.getsockname()[1])

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._terminated = asyncio.Event()
        for sock, context in self._listeners:
            server = await loop.create_server(
                lambda: _Connection(self), sock=sock, ssl=context, backlog=1024
            )
            self._servers.append(server)

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls, let those in flight finish within `grace` seconds,
        then cancel what is left and close every connection."""
        if self._stopping:
            if self._terminated is not None:
                await self._terminated.wait()
            return
        self._stopping = True
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.conn.goaway()
            connection.flush()
        if grace:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_calls_done(), grace)
        for connection in list(self._connections):
            for call in list(connection.calls.values()):
                call.cancel()
            connection.flush()
            if connection.transport is not None:
                connection.transport.close()
        for server in self._servers:
            await server.wait_closed()
        if self._terminated is not None:
            self._terminated.set()

    async def _all_calls_done(self) -> None:
        """No call running, and no answer waiting for the client's flow-control window."""
        while any(c.calls or c.conn.waiting_for_window() for c in self._connections):
            await asyncio.sleep(0.02)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        assert self._terminated is not None, "start() first"
        try:
            await asyncio.wait_for(self._terminated.wait(), timeout)
        except TimeoutError:
            return False
        return True


def tls_context(
    cert: Path,
    key: Path,
    *,
    ca_file: Path | None = None,
    ca_pem: bytes | None = None,
    require_client_cert: bool = False,
) -> ssl.SSLContext:
    """The server's TLS: its certificate and key, the CA clients' certificates
    are checked against (a file or PEM bytes), client certificates required
    or not; TLS 1.2 at least, ALPN h2 (which gRPC clients insist on)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if ca_file is not None:
        context.load_verify_locations(ca_file)
    if ca_pem is not None:
        context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


def _chain(
    interceptor: grpc.aio.ServerInterceptor, continuation: Callable[..., Any]
) -> Callable[..., Any]:
    async def intercepted(details: HandlerCallDetails) -> Any:
        return await interceptor.intercept_service(continuation, details)

    return intercepted


#: A client gone without closing (its host down, the network cut) is found by
#: TCP keepalive within ~20 s and its calls cancelled: the role grpc.aio's
#: HTTP/2 keepalive pings had (10 s, 5 s timeout; stageserve/net.py).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 2


def _keepalive(sock: Any) -> None:
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    except (OSError, AttributeError):  # not TCP, or a platform without these options
        pass


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "*"):
        host = "0.0.0.0"
    return host, int(port)


def _peer(name: Any) -> str:
    if isinstance(name, tuple) and len(name) >= 2:
        host, port = name[0], name[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return str(name or "")
