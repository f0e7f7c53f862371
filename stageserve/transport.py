"""One transport for every internal stream between stages.

Every internal link (gateway -> scheduler, worker BLS -> scheduler,
scheduler -> worker) is one long-lived bidirectional gRPC stream that carries
many requests per message, matched to their responses by id. This module is
its only implementation:

- :class:`StreamLink`, the client end: ids, pending futures, an outbox whose
  writer packs everything queued since its last write into one message, a
  reader that resolves futures (and hands a decoupled model's earlier
  responses, ``more=True``, to a callback), and, when the stream breaks,
  every waiting call failed at once with the caller's error; the next call
  opens a new stream.
- :func:`serve_stream`, the server end's fan-in loop: every request of every
  message goes to a handler (in arrival order, or each as its own task), and
  responses are written, again packed, as they come.

Why streams and packing: one unary call per request cost 315/185 us of server
CPU at 1/64 in flight against 114/81 us on a stream (bench.stream_vs_unary);
each stream message has a fixed cost on both ends, so carrying several
requests in one message divides it between them. A link given a
:class:`~stageserve.write_hold.WriteHold` also waits a little for more
requests before a write, under load (write_hold.py has the rule and figures).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc

from stageserve.telemetry import STREAM_MESSAGES, STREAM_REQUESTS
from stageserve.write_hold import WriteHold

log = logging.getLogger(__name__)


class Message(Protocol):
    """What travels on an internal stream: every request and response has an
    id; a response with ``more`` set is a decoupled model's non-final one."""

    id: int


Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

#: Builds the error every waiting call gets when the stream breaks, from the
#: stream's status code and details (UNAVAILABLE "stream closed" when the peer
#: ended it, CANCELLED "shutting down" when this side closed it).
BreakError = Callable[[grpc.StatusCode, str], Exception]


class _Outbox(Generic[Req]):
    """Items queued for one stream; the writer takes all of them per wake-up.

    A list and a future, not an asyncio.Queue: the writer wants everything
    queued at once, and a put is one append plus, when the writer sleeps,
    one set_result."""

    def __init__(self) -> None:
        self.items: list[Req] = []
        self.closed = False
        self._wake: asyncio.Future[None] | None = None

    def put(self, item: Req) -> None:
        self.items.append(item)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def close(self) -> None:
        self.closed = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def take_all(self) -> list[Req]:
        """Everything queued (at least one item), or [] once closed."""
        while not self.items:
            if self.closed:
                return []
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
            self._wake = None
        return self.drain()

    def drain(self) -> list[Req]:
        """Everything queued now (maybe nothing), without waiting."""
        items, self.items = self.items, []
        return items


class StreamLink(Generic[Req, Resp]):
    """The client end of one internal stream.

    ``open_call(messages)`` starts the RPC with an async iterator of packed
    messages; ``pack(requests)`` builds one message from many requests and
    ``unpack(message)`` lists a response message's responses. ``ready``, when
    given, is awaited before a stream opens (e.g. the channel connecting with
    a deadline); a failed attempt answers every call that waited for it.
    ``hold``, when given, decides how long each write waits for more requests.
    """

    def __init__(
        self,
        *,
        name: str,
        open_call: Callable[[AsyncIterator[Any]], Any],
        pack: Callable[[list[Req]], Any],
        unpack: Callable[[Any], Iterable[Resp]],
        on_break: BreakError,
        ready: Callable[[], Awaitable[None]] | None = None,
        hold: WriteHold | None = None,
        orphan: Callable[[Resp], None] | None = None,
    ) -> None:
        self.name = name
        # the link's kind ("worker 127.0.0.1:5001" -> worker): one series per
        # kind of peer, not per address
        kind = name.split(" ", 1)[0]
        self._messages = STREAM_MESSAGES.labels(kind)
        self._carried = STREAM_REQUESTS.labels(kind)
        # Gets a final response whose caller is gone (cancelled): one that
        # holds resources (shared-memory slots) gives them back there.
        self._orphan = orphan
        self._hold = hold
        self._open_call = open_call
        self._pack = pack
        self._unpack = unpack
        self._on_break = on_break
        self._ready = ready
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Resp]] = {}
        self._on_more: dict[int, Callable[[Resp], None]] = {}
        self._outbox: _Outbox[Req] | None = None
        self._reader: asyncio.Task | None = None
        self._opening = asyncio.Lock()
        self._last_failure: tuple[float, Exception] | None = None
        self._down_logged = False  # a stream that got no answer was logged
        # Set when the stream broke (the peer died or went away), cleared by
        # the next message from the peer.
        self.broken = False

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _open(self) -> bool:
        return self._outbox is not None and self._reader is not None and not self._reader.done()

    async def _stream(self) -> _Outbox[Req]:
        if self._open():
            return self._outbox  # type: ignore[return-value]
        if self._ready is None:
            return self._start()
        # One stream at a time: concurrent first calls wait for the same
        # stream instead of each opening one (which would reorder them). A
        # failed attempt answers everyone who waited for it at once, so a
        # down peer costs each call one bounded wait, not one per waiter.
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        async with self._opening:
            if self._open():
                return self._outbox  # type: ignore[return-value]
            if self._last_failure is not None and self._last_failure[0] >= asked_at:
                raise self._last_failure[1]
            try:
                await self._ready()
            except Exception as exc:
                self._last_failure = (loop.time(), exc)
                raise
            return self._start()

    def _start(self) -> _Outbox[Req]:
        outbox: _Outbox[Req] = _Outbox()
        pack = self._pack

        # An async generator handed to the call rather than call.write() from
        # a writer task: bench.transport measured no difference beyond the
        # noise (client CPU per call at 1/16/64 in flight: 194-198/19-21/9-10 us
        # vs 175-193/19/10 us), and the generator needs no task of its own.
        async def messages() -> AsyncIterator[Any]:
            # Everything queued since the last write goes out as one message.
            while items := await outbox.take_all():
                if self._hold is not None:
                    items += await self._held(outbox, len(items))
                self._messages.inc()
                self._carried.inc(len(items))
                yield pack(items)

        call = self._open_call(messages())
        self._outbox = outbox
        self._reader = asyncio.create_task(self._read(call, outbox))
        return outbox

    async def _held(self, outbox: _Outbox[Req], queued: int) -> list[Req]:
        """What else was queued while the hold kept the write back."""
        hold = self._hold
        assert hold is not None
        first = time.monotonic_ns()
        more: list[Req] = []
        while True:
            now = time.monotonic_ns()
            at = hold.write_at(first, queued + len(more), len(self._pending), now)
            if at is None or outbox.closed:
                return more + outbox.drain()
            await asyncio.sleep((at - now) / 1e9)
            more += outbox.drain()

    def _fail_call(self, call_id: int, exc: Exception) -> None:
        """A `more` callback raised: that call fails with it; the stream and
        every other call on it go on."""
        log.exception("stream callback failed", exc_info=exc)
        self._on_more.pop(call_id, None)
        fut = self._pending.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    async def _read(self, call, outbox: _Outbox[Req]) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "stream closed"
        pending, on_more, unpack = self._pending, self._on_more, self._unpack
        answered = False
        try:
            async for message in call:
                answered = True
                self.broken = False
                for resp in unpack(message):
                    if resp.more:  # type: ignore[attr-defined]
                        callback = on_more.get(resp.id)
                        if callback is not None:
                            try:
                                callback(resp)
                            except Exception as exc:  # fails that call, not the stream
                                self._fail_call(resp.id, exc)
                        continue
                    fut = pending.pop(resp.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(resp)
                    elif self._orphan is not None:
                        self._orphan(resp)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or "stream failed"
            self.broken = code != grpc.StatusCode.CANCELLED
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "shutting down"
            raise
        finally:
            # While the peer is down every call opens a stream that fails at
            # once (seen: seven lines in one millisecond when the rate limiter
            # was killed): one line for the first such stream, none for the
            # next until a stream gets an answer again.
            quiet = not answered and self._down_logged
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "internal stream ended",
                extra={"link": self.name, "code": code.name, "details": details},
            )
            self._down_logged = not answered
            if self._outbox is outbox:
                self._outbox = None
            outbox.close()
            self._fail_pending(self._on_break(code, details))

    def _fail_pending(self, err: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def call(
        self,
        request: Req,
        *,
        on_more: Callable[[Resp], None] | None = None,
        timeout_s: float | None = None,
        on_timeout: Callable[[], Exception] | None = None,
    ) -> Resp:
        """The request's (final) response. ``on_more`` gets the earlier responses
        of a decoupled model as they arrive; after ``timeout_s`` the call fails
        with ``on_timeout()`` (TimeoutError without one)."""
        outbox = await self._stream()
        request.id = request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Resp] = loop.create_future()
        self._pending[request_id] = fut
        if on_more is not None:
            self._on_more[request_id] = on_more
        if self._hold is not None:
            self._hold.arrived(time.monotonic_ns(), len(self._pending))
        timer = None
        if timeout_s is not None:
            # A timer on the future, not asyncio.wait_for (which costs a task
            # per call on a path that runs once per batch).
            timer = loop.call_later(
                timeout_s, _expire, fut, on_timeout or (lambda: TimeoutError(timeout_s))
            )
        outbox.put(request)
        try:
            return await fut
        except asyncio.CancelledError:
            # cancelled after its answer came: the answer is an orphan too
            answered = fut.done() and not fut.cancelled() and fut.exception() is None
            if self._orphan is not None and answered:
                self._orphan(fut.result())
            raise
        finally:
            self._pending.pop(request_id, None)
            if on_more is not None:
                self._on_more.pop(request_id, None)
            if timer is not None:
                timer.cancel()

    async def send(self, request: Req) -> None:
        """Queue a request that gets no answer (id 0): it goes out with the
        next message, and is lost if the stream breaks first. For calls whose
        failure the caller could only log anyway (a rate-limiter release,
        whose lease ends on its own): no answer saves the peer a write and
        this end a read per call."""
        outbox = await self._stream()
        request.id = 0
        outbox.put(request)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


def _expire(fut: asyncio.Future, error: Callable[[], Exception]) -> None:
    if not fut.done():
        fut.set_exception(error())


# ----------------------------------------------------------------- server end

Respond = Callable[[Any], None]


async def serve_stream(
    request_iterator: AsyncIterator[Any],
    *,
    unpack: Callable[[Any], Iterable[Any]],
    handle: Callable[[Any, Respond], Awaitable[None] | None],
    pack: Callable[[list[Any]], Any] | None = None,
    concurrent: bool = False,
    on_error: Callable[[Any, Exception], Any] | None = None,
    on_message_end: Callable[[], None] | None = None,
) -> AsyncIterator[Any]:
    """The server end of a stream: an async generator to return from the RPC.

    ``handle(request, respond)`` is called for every request of every
    incoming message; ``respond`` may be called any number of times, from
    the event loop, until the stream ends. With ``concurrent`` each handler
    runs as its own task (cancelled when the stream ends); otherwise handlers
    run one after another in arrival order. A handler that raises is answered
    with ``on_error(request, exc)`` (logged) and the stream goes on. With
    ``pack``, every response queued since the last write goes out in one
    message; without it each response is its own message.
    ``on_message_end`` runs after the handlers of each incoming message were
    called (also when one raised or the stream ended mid-message).
    """
    outbox: _Outbox[Any] = _Outbox()
    respond = outbox.put
    tasks: set[asyncio.Task] = set()

    def failed(request: Any, exc: Exception) -> None:
        log.exception("request handler failed", exc_info=exc)
        if on_error is not None:
            respond(on_error(request, exc))

    async def guarded(request: Any, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed(request, exc)

    async def read() -> None:
        try:
            async for message in request_iterator:
                try:
                    for request in unpack(message):
                        try:
                            work = handle(request, respond)
                            if work is None:
                                continue
                            if concurrent:
                                task = asyncio.ensure_future(guarded(request, work))
                                tasks.add(task)
                                task.add_done_callback(tasks.discard)
                            elif inspect.isawaitable(work):
                                await work
                        except asyncio.CancelledError:
                            raise
                        except Exception as exc:  # one bad request must not end the stream
                            failed(request, exc)
                finally:
                    if on_message_end is not None:
                        on_message_end()
            if concurrent:
                while tasks:  # the peer half-closed: answer what it sent
                    await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            outbox.close()

    reader = asyncio.create_task(read())
    try:
        while items := await outbox.take_all():
            if pack is not None:
                yield pack(items)
            else:
                for item in items:
                    yield item
    finally:
        reader.cancel()
        for task in tasks:
            task.cancel()
