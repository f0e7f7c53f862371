"""stageserve/h2grpc/client.py: H2Channel calling real servers.

Every test runs its servers in-process, on the same asyncio loop as the
client (asyncio.run per test), against both servers an internal stage may
serve with (stageserve/net.py `stage_server`): StageServe's own HTTP/2 server
("h2") and grpc.aio's ("grpcio"). The client goes through the generated
`SchedulerStub`, as the stages' stream links do. Every wait is bounded, so a
client that hangs fails its test instead of the run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeAlias, TypeVar

import grpc
import pytest

from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.h2grpc import client as h2client
from stageserve.h2grpc.client import H2Channel
from stageserve.h2grpc.server import H2GrpcServer
from stageserve.net import SERVER_OPTIONS, free_port, stage_server
from stageserve.transport import serve_stream
from tests.unit.scheduler_links import Broken, scheduler_link

T = TypeVar("T")

SERVERS = ["h2", "grpcio"]
#: The bound on one step of a test (a response, a server start or stop).
STEP = 5.0
ABORT_DETAILS = "bad: naïve 100%"

Server: TypeAlias = grpc.aio.Server | H2GrpcServer


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run a test's body on a fresh loop, failing (not hanging) past `timeout`."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def step(awaitable: Awaitable[T], timeout: float = STEP) -> T:
    return await asyncio.wait_for(awaitable, timeout)


class Echo(pb_grpc.SchedulerServicer):
    """`Schedule` answers each ScheduleBatch with one ScheduleResponses: per
    request its id, its request_id as message and its inputs as outputs. A
    request of model "abort" aborts the call instead; after one of model
    "hold" the handler does not end when the requests do (it waits to be
    cancelled).

    It records what the tests look at: the request_ids in arrival order, and
    how each call's handler ended (`ended`: "ok", "cancelled", "aborted",
    "held")."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.ended: list[str] = []
        self.ended_event = asyncio.Event()

    async def Schedule(
        self, request_iterator: AsyncIterator[pb.ScheduleBatch], context: Any
    ) -> AsyncIterator[pb.ScheduleResponses]:
        how = "ok"
        hold = False
        try:
            async for batch in request_iterator:
                for request in batch.requests:
                    self.seen.append(request.request_id)
                    hold = hold or request.model == "hold"
                    if request.model == "abort":
                        how = "aborted"
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, ABORT_DETAILS)
                yield pb.ScheduleResponses(
                    responses=[
                        pb.ScheduleResponse(id=r.id, message=r.request_id, outputs=r.inputs)
                        for r in batch.requests
                    ]
                )
            if hold:
                how = "held"
                await asyncio.sleep(30)
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        finally:
            self.ended.append(how)
            self.ended_event.set()


@contextlib.asynccontextmanager
async def serving(kind: str, servicer: Any, port: int = 0) -> AsyncIterator[tuple[Server, int]]:
    """A started server of `kind` with `servicer` on 127.0.0.1 (`port` 0: a
    free one) and its port; stopped without grace on exit (again if the test
    already stopped it)."""
    server, bound = await start(kind, servicer, port)
    try:
        yield server, bound
    finally:
        await step(server.stop(None))


async def start(kind: str, servicer: Any, port: int) -> tuple[Server, int]:
    """`kind`: stage_server's ("h2", "grpcio"), or "grpcio-64k": grpc.aio's
    server keeping HTTP/2's default 64 KiB windows (grpc 1.85 announces 4 MiB
    ones in its first SETTINGS, and BDP probing grows them; without the
    probing, the lookahead sets the windows)."""
    server: Server
    if kind == "grpcio-64k":
        small = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65535)]
        server = grpc.aio.server(options=[*SERVER_OPTIONS, *small])
    else:
        server = stage_server(kind)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound > 0
    await step(server.start())
    return server, bound


class Requests:
    """A call's request iterator the test feeds: `put` a message, `end` them."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.ScheduleBatch | None] = asyncio.Queue()

    def put(self, *request_ids: str, model: str = "echo", raw: bytes = b"") -> None:
        inputs = [pb.Tensor(name="IN", datatype="UINT8", shape=[len(raw)], raw=raw)] if raw else []
        batch = pb.ScheduleBatch(
            requests=[
                pb.ScheduleRequest(model=model, request_id=r, inputs=inputs) for r in request_ids
            ]
        )
        self._queue.put_nowait(batch)

    def end(self) -> None:
        self._queue.put_nowait(None)

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> pb.ScheduleBatch:
        batch = await self._queue.get()
        if batch is None:
            raise StopAsyncIteration
        return batch


def schedule(channel: H2Channel, requests: AsyncIterator[pb.ScheduleBatch]) -> Any:
    """The Schedule call of the generated stub, built on `channel`."""
    return pb_grpc.SchedulerStub(channel).Schedule(requests)


async def next_response(call: Any, timeout: float = STEP) -> pb.ScheduleResponses:
    return await step(anext(call), timeout)


async def expect_error(call: Any, timeout: float = STEP) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await next_response(call, timeout)
    return info.value


def messages(answer: pb.ScheduleResponses) -> list[str]:
    return [r.message for r in answer.responses]


async def round_trip(channel: H2Channel, text: str) -> None:
    """A call that sends `text`, gets it back, and ends normally."""
    requests = Requests()
    call = schedule(channel, requests)
    requests.put(text)
    assert messages(await next_response(call)) == [text]
    requests.end()
    with pytest.raises(StopAsyncIteration):
        await next_response(call)


# -- 1. a bidi echo ---------------------------------------------------------------


@pytest.mark.parametrize("kind", SERVERS)
def test_a_bidi_stream_echoes_in_order_and_ends_normally(kind: str) -> None:
    async def body() -> None:
        servicer = Echo()
        async with serving(kind, servicer) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            try:
                requests = Requests()
                call = schedule(channel, requests)
                # one at a time: each answer before the next request
                for i in range(5):
                    requests.put(f"a{i}", f"b{i}")
                    assert messages(await next_response(call)) == [f"a{i}", f"b{i}"]
                # several queued before any is read: answered in order
                for i in range(10):
                    requests.put(f"c{i}")
                for i in range(10):
                    assert messages(await next_response(call)) == [f"c{i}"]
                requests.end()
                # the requests ended, the server finished OK: the iteration ends
                with pytest.raises(StopAsyncIteration):
                    await next_response(call)
                # and stays ended
                with pytest.raises(StopAsyncIteration):
                    await next_response(call)
                expected = [x for i in range(5) for x in (f"a{i}", f"b{i}")]
                assert servicer.seen == expected + [f"c{i}" for i in range(10)]
                await step(servicer.ended_event.wait())
                assert servicer.ended == ["ok"]
                # `async for` over the call, as StreamLink reads it
                requests = Requests()
                for i in range(3):
                    requests.put(f"d{i}")
                requests.end()
                got = []
                async with asyncio.timeout(STEP):
                    async for answer in schedule(channel, requests):
                        got += messages(answer)
                assert got == ["d0", "d1", "d2"]
            finally:
                await channel.close()

    run(body())


# -- 2. the server's status ------------------------------------------------------


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("answered_first", [False, True], ids=["trailers-only", "after-a-message"])
def test_an_abort_reaches_the_client_with_its_code_and_exact_details(
    kind: str, answered_first: bool
) -> None:
    """Details with non-ASCII and '%' survive grpc-message's percent-encoding,
    in a trailers-only answer and in trailers after a message."""

    async def body() -> None:
        async with serving(kind, Echo()) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            try:
                requests = Requests()  # left open: the server ends the call
                call = schedule(channel, requests)
                if answered_first:
                    requests.put("first")
                    assert messages(await next_response(call)) == ["first"]
                requests.put("x", model="abort")
                error = await expect_error(call)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details() == ABORT_DETAILS
                # the error stays the call's answer
                again = await expect_error(call)
                assert again.code() == grpc.StatusCode.INVALID_ARGUMENT
            finally:
                await channel.close()

    run(body())


# -- 3. flow control -------------------------------------------------------------


@pytest.mark.parametrize("kind", [*SERVERS, "grpcio-64k"])
def test_messages_far_above_the_default_window_go_both_ways_intact(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 MB messages each way, far above HTTP/2's default 64 KiB windows: the
    client waits for the server's WINDOW_UPDATEs instead of overrunning the
    windows or stalling. Against "grpcio-64k" (windows kept at 64 KiB) every
    request waits for them; against the others a message may also be written
    before the server's SETTINGS open the windows (the connection starts at
    64 KiB)."""
    waits = 0
    window_open = h2client._ClientProtocol.window_open

    async def counted(self: Any) -> None:
        nonlocal waits
        waits += 1
        await window_open(self)

    monkeypatch.setattr(h2client._ClientProtocol, "window_open", counted)

    async def body() -> None:
        async with serving(kind, Echo()) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            try:
                requests = Requests()
                call = schedule(channel, requests)
                payloads = [os.urandom(3_000_000) for _ in range(4)]
                # one alone, then three queued together (12 MB in all: above
                # even grpc's 4 MiB windows, the later ones wait behind the
                # first for window)
                requests.put("big0", raw=payloads[0])
                answer = await next_response(call, 10)
                assert messages(answer) == ["big0"]
                assert answer.responses[0].outputs[0].raw == payloads[0]
                for i in (1, 2, 3):
                    requests.put(f"big{i}", raw=payloads[i])
                for i in (1, 2, 3):
                    answer = await next_response(call, 10)
                    assert messages(answer) == [f"big{i}"]
                    assert answer.responses[0].outputs[0].raw == payloads[i]
                # a small message after them still gets through
                requests.put("small")
                assert messages(await next_response(call)) == ["small"]
                requests.end()
                with pytest.raises(StopAsyncIteration):
                    await next_response(call)
            finally:
                await channel.close()

    run(body(), timeout=40)
    if kind == "grpcio-64k":
        # the path under test was taken: the writer waited for window
        assert waits > 0


# -- 4. nothing listening, then a server --------------------------------------------


@pytest.mark.parametrize("kind", SERVERS)
def test_a_refused_connection_fails_at_once_and_channel_ready_waits_for_the_server(
    kind: str,
) -> None:
    async def body() -> None:
        port = free_port()
        channel = H2Channel(f"127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        try:
            begun = loop.time()
            error = await expect_error(schedule(channel, Requests()))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert loop.time() - begun < 0.5
            # the system's words, not Python's text of the exception
            assert error.details() == f"failed to connect to 127.0.0.1:{port}: Connection refused"
            # channel_ready redials until a server listens there
            ready = asyncio.ensure_future(step(channel.channel_ready()))
            await asyncio.sleep(0.3)
            assert not ready.done()
            async with serving(kind, Echo(), port):
                await ready
                await round_trip(channel, "after")
        finally:
            await channel.close()

    run(body())


def test_channel_ready_of_a_closed_channel_fails_instead_of_redialling_forever() -> None:
    """grpc.aio's channel_ready() on a closed channel raises (UsageError
    "Channel is closed."); a caller bounding it (StreamLink's `ready`,
    stageserve/scheduler_link.py) should not wait out its whole timeout, as
    it would if a closed channel counted as a server not listening yet."""

    async def body() -> None:
        channel = H2Channel(f"127.0.0.1:{free_port()}")
        await channel.close()
        with pytest.raises(Exception) as info:
            await step(channel.channel_ready(), 1.0)
        assert not isinstance(info.value, TimeoutError), "channel_ready() redialled for 1 s"
        # a call on it fails at once, CANCELLED as a call its channel's close
        # ended (StreamLink does not count that as a broken peer)
        error = await expect_error(schedule(channel, Requests()), 1.0)
        assert error.code() == grpc.StatusCode.CANCELLED

    run(body())


# -- 5. the server goes away ----------------------------------------------------


@pytest.mark.parametrize("kind", SERVERS)
def test_a_server_gone_mid_stream_is_unavailable_and_the_channel_redials(kind: str) -> None:
    async def body() -> None:
        port = free_port()
        channel = H2Channel(f"127.0.0.1:{port}")
        try:
            async with serving(kind, Echo(), port) as (server, _):
                requests = Requests()
                call = schedule(channel, requests)
                requests.put("before")
                assert messages(await next_response(call)) == ["before"]
                # a read in progress when the server goes (without grace)
                pending = asyncio.ensure_future(anext(call))
                await asyncio.sleep(0.05)
                assert not pending.done()
                await step(server.stop(None))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await step(pending, 2)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # the same channel, a server back on the same port
            async with serving(kind, Echo(), port):
                await round_trip(channel, "again")
        finally:
            await channel.close()

    run(body())


# -- 6. cancelling the reader -------------------------------------------------------


async def _read_all(call: Any) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize("kind", SERVERS)
def test_cancelling_the_reading_task_cancels_the_servers_handler(kind: str) -> None:
    """The reset reaches the handler: the own server cancels its task; grpc.aio
    first ends its request iterator (the client never ended its requests),
    then cancels it. The handler holds on after its requests, so only a
    cancel ends it: it must end "cancelled", not "ok" nor by the test's
    timeout."""

    async def body() -> None:
        servicer = Echo()
        async with serving(kind, servicer) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            try:
                requests = Requests()  # open: the handler waits for more
                call = schedule(channel, requests)
                requests.put("one", model="hold")
                assert messages(await next_response(call)) == ["one"]
                reader = asyncio.ensure_future(_read_all(call))
                await asyncio.sleep(0.05)
                reader.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await step(reader)
                await step(servicer.ended_event.wait(), 1.0)
                assert servicer.ended == ["cancelled"]
                # the channel goes on
                await round_trip(channel, "next")
            finally:
                await channel.close()

    run(body())


@pytest.mark.parametrize("kind", SERVERS)
def test_cancelling_the_reader_after_the_requests_ended_still_cancels_the_handler(
    kind: str,
) -> None:
    """The client half-closed the stream (its requests ended) and the server
    is still working on the call: a cancel must still reset the stream, as
    grpc's client does (RST_STREAM CANCEL), or the handler runs on for nobody.
    (A reset sent only while this side's half was open would miss it.)"""

    async def body() -> None:
        servicer = Echo()
        async with serving(kind, servicer) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            try:
                requests = Requests()
                call = schedule(channel, requests)
                requests.put("one", model="hold")
                assert messages(await next_response(call)) == ["one"]
                requests.end()
                reader = asyncio.ensure_future(_read_all(call))
                await asyncio.sleep(0.1)  # the END_STREAM is out, the handler holds
                assert not reader.done()
                reader.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await step(reader)
                await step(servicer.ended_event.wait(), 1.0)
                assert servicer.ended == ["cancelled"]
            finally:
                await channel.close()

    run(body())


# -- 7. keepalive -------------------------------------------------------------


def test_keepalive_drops_a_connection_whose_peer_never_answers() -> None:
    """A peer that accepts and reads but never writes (a hung process, a
    half-dead network path): an open call fails UNAVAILABLE once a PING goes
    unanswered, instead of waiting forever."""

    async def body() -> None:
        closed = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while await reader.read(65536):
                    pass
            except ConnectionError:
                pass
            finally:
                closed.set()
                writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = H2Channel(f"127.0.0.1:{port}", keepalive_s=0.2, keepalive_timeout_s=0.2)
        loop = asyncio.get_running_loop()
        try:
            requests = Requests()
            call = schedule(channel, requests)
            requests.put("hello?")
            begun = loop.time()
            error = await expect_error(call, timeout=3)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert loop.time() - begun < 2
            await step(closed.wait(), 2)  # the client dropped the connection
        finally:
            await channel.close()
            server.close()
            await step(server.wait_closed())

    run(body())


def test_keepalive_keeps_a_connection_whose_server_answers_on_a_late_loop() -> None:
    """A server that answers every PING keeps its connection, however late the
    client's loop runs the check: a busy loop (here: blocked 120 ms at a time)
    fires the check long after the ACK came, which must not count as no
    answer. (A check of how long ago the last frame came dropped such
    connections, and a scheduler then took its workers for dead.)"""

    async def body() -> None:
        async with serving("h2", Echo()) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}", keepalive_s=0.1, keepalive_timeout_s=0.05)
            busy = True

            async def block_the_loop() -> None:
                while busy:
                    time.sleep(0.12)  # the loop can run nothing meanwhile
                    await asyncio.sleep(0.01)

            try:
                requests = Requests()
                call = schedule(channel, requests)
                requests.put("before")
                assert messages(await next_response(call)) == ["before"]
                blocker = asyncio.ensure_future(block_the_loop())
                await asyncio.sleep(1.5)  # idle: a PING every 0.1 s
                busy = False
                await step(blocker)
                requests.put("after")
                assert messages(await next_response(call)) == ["after"]
                requests.end()
                with pytest.raises(StopAsyncIteration):
                    await next_response(call)
            finally:
                await channel.close()

    run(body())


def test_an_idle_connection_without_calls_does_not_spin_the_keepalive_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After its calls ended, a connection stays open (the next call reuses it)
    and idle: the keepalive timer should sleep, not run every loop turn (a
    timer re-armed with a delay of 0 once the connection has been idle for
    keepalive_s would burn a core until a frame arrives). Bounded here: 0.3 s."""
    runs = 0
    keepalive = h2client._ClientProtocol._keepalive

    def counted(self: Any) -> None:
        nonlocal runs
        runs += 1
        keepalive(self)

    monkeypatch.setattr(h2client._ClientProtocol, "_keepalive", counted)

    async def body() -> None:
        async with serving("h2", Echo()) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}", keepalive_s=0.1, keepalive_timeout_s=0.1)
            try:
                await round_trip(channel, "only")
                before = runs
                await asyncio.sleep(0.3)
                # every 0.1 s at most: 3 or 4 runs; allow plenty of slack
                assert runs - before < 20, f"the keepalive timer ran {runs - before} times"
            finally:
                await channel.close()

    run(body())


# -- 8. StreamLink over the channel -----------------------------------------------------


class LinkEcho(pb_grpc.SchedulerServicer):
    """serve_stream's echo (as in tests/unit/test_transport.py): each request
    answered with its request_id, model "slow" after a pause, "never" never;
    concurrently."""

    async def _handle(self, request: pb.ScheduleRequest, respond: Any) -> None:
        if request.model == "never":
            return
        if request.model == "slow":
            await asyncio.sleep(0.02 * (int(request.request_id) % 5))
        respond(pb.ScheduleResponse(id=request.id, message=request.request_id))

    async def Schedule(
        self, request_iterator: AsyncIterator[pb.ScheduleBatch], context: Any
    ) -> AsyncIterator[pb.ScheduleResponses]:
        async for message in serve_stream(
            request_iterator,
            unpack=lambda message: message.requests,
            handle=self._handle,
            pack=lambda responses: pb.ScheduleResponses(responses=responses),
            concurrent=True,
        ):
            yield message


@pytest.mark.parametrize("kind", SERVERS)
def test_a_stream_link_over_the_channel_matches_concurrent_calls_by_id(kind: str) -> None:
    async def body() -> None:
        async with serving(kind, LinkEcho()) as (_, port):
            channel = H2Channel(f"127.0.0.1:{port}")
            link = scheduler_link(channel, ready=channel.channel_ready)
            try:
                tags = [str(i) for i in range(200)]
                # slow ones answered out of order: matched by id, not by position
                calls = [
                    link.call(pb.ScheduleRequest(model="slow" if i % 3 else "echo", request_id=t))
                    for i, t in enumerate(tags)
                ]
                answers = await step(asyncio.gather(*calls))
                assert [a.message for a in answers] == tags
                assert link.in_flight == 0
                # more rounds on the same stream
                for round_ in range(3):
                    more = [f"{round_}-{i}" for i in range(20)]
                    got = await step(
                        asyncio.gather(
                            *(
                                link.call(pb.ScheduleRequest(model="echo", request_id=t))
                                for t in more
                            )
                        )
                    )
                    assert [a.message for a in got] == more
            finally:
                await step(link.close())
                await channel.close()

    run(body())


@pytest.mark.parametrize("kind", SERVERS)
def test_a_stream_link_fails_waiting_calls_when_the_server_goes_then_reopens(kind: str) -> None:
    """The server stops under calls in flight: each fails with the link's
    break error (UNAVAILABLE, from the channel); once a server is back on the
    address, the next call opens a new stream on the same channel."""

    async def body() -> None:
        port = free_port()
        channel = H2Channel(f"127.0.0.1:{port}")
        link = scheduler_link(channel, ready=channel.channel_ready)
        try:
            async with serving(kind, LinkEcho(), port) as (server, _):
                assert (await step(link.call(pb.ScheduleRequest(request_id="up")))).message == "up"
                waiting = [
                    asyncio.ensure_future(link.call(pb.ScheduleRequest(model="never")))
                    for _ in range(3)
                ]
                await asyncio.sleep(0.05)
                assert link.in_flight == 3
                await step(server.stop(None))
                for call in waiting:
                    with pytest.raises(Broken) as info:
                        await step(call, 2)
                    assert info.value.code == grpc.StatusCode.UNAVAILABLE
            async with serving(kind, LinkEcho(), port):
                answer = await step(link.call(pb.ScheduleRequest(request_id="back")))
                assert answer.message == "back"
        finally:
            await step(link.close())
            await channel.close()

    run(body())
