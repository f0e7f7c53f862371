"""stageserve/h2grpc/server.py: H2GrpcServer answering real grpcio clients.

Every test starts the server in-process on a free port and calls it through
grpc.aio channels, on one asyncio loop per test (asyncio.run); every wait is
bounded, so a server that hangs fails the test instead of the run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import hpack
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc
from stageserve.h2grpc import wire
from stageserve.h2grpc.server import H2GrpcServer

T = TypeVar("T")

SERVICE = "test.Svc"
#: Client channel options: messages far above grpc's 4 MiB default.
OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
#: The bound on one client call.
CALL_TIMEOUT = 10.0


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run a test's body on a fresh loop, failing (not hanging) past `timeout`."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(
    *handlers: grpc.GenericRpcHandler,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    setup: Callable[[H2GrpcServer], None] | None = None,
) -> AsyncIterator[tuple[H2GrpcServer, str]]:
    """A started H2GrpcServer on 127.0.0.1 and its address; stopped on exit."""
    server = H2GrpcServer(interceptors=interceptors)
    server.add_generic_rpc_handlers(handlers)
    if setup is not None:
        setup(server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await asyncio.wait_for(server.stop(0), 5)


def channel(address: str, **kwargs: Any) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS, **kwargs)


def service(**methods: grpc.RpcMethodHandler) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def unary(fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(fn)


def path(method: str) -> str:
    return f"/{SERVICE}/{method}"


async def echo(request: bytes, context: Any) -> bytes:
    return request


async def upper_each(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request.upper()


async def expect_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, CALL_TIMEOUT)
    return info.value


async def wait(event: asyncio.Event, timeout: float = 5.0) -> None:
    await asyncio.wait_for(event.wait(), timeout)


class Inference(gs_grpc.GRPCInferenceServiceServicer):
    """Two methods of the generated service, registered by the generated
    add_GRPCInferenceServiceServicer_to_server."""

    async def ServerLive(self, request: gs.ServerLiveRequest, context: Any) -> Any:
        return gs.ServerLiveResponse(live=True)

    async def ModelInfer(self, request: gs.ModelInferRequest, context: Any) -> Any:
        return gs.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            raw_output_contents=[c[::-1] for c in request.raw_input_contents],
        )


def add_inference(server: H2GrpcServer) -> None:
    gs_grpc.add_GRPCInferenceServiceServicer_to_server(Inference(), server)


# -- 1. unary calls ------------------------------------------------------------


def test_a_unary_call_round_trips_bytes_and_protobuf() -> None:
    async def body() -> None:
        async with (
            serving(service(Echo=unary(echo)), setup=add_inference) as (_, address),
            channel(address) as ch,
        ):
            assert await ch.unary_unary(path("Echo"))(b"hello", timeout=CALL_TIMEOUT) == b"hello"
            assert await ch.unary_unary(path("Echo"))(b"", timeout=CALL_TIMEOUT) == b""
            stub = gs_grpc.GRPCInferenceServiceStub(ch)
            live = await stub.ServerLive(gs.ServerLiveRequest(), timeout=CALL_TIMEOUT)
            assert live == gs.ServerLiveResponse(live=True)
            answer = await stub.ModelInfer(
                gs.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"abc", b"xy"]),
                timeout=CALL_TIMEOUT,
            )
            assert (answer.model_name, answer.id) == ("m", "7")
            assert list(answer.raw_output_contents) == [b"cba", b"yx"]

    run(body())


def test_200_concurrent_calls_on_one_channel_all_get_their_own_answer() -> None:
    async def body() -> None:
        async with (
            serving(service(Echo=unary(echo)), setup=add_inference) as (_, address),
            channel(address) as ch,
        ):
            call = ch.unary_unary(path("Echo"))
            stub = gs_grpc.GRPCInferenceServiceStub(ch)
            raw = [
                call(f"request {i}".encode() * (i + 1), timeout=CALL_TIMEOUT) for i in range(100)
            ]
            infer = [
                stub.ModelInfer(
                    gs.ModelInferRequest(model_name=f"m{i}", id=str(i)), timeout=CALL_TIMEOUT
                )
                for i in range(100)
            ]
            answers = await asyncio.gather(*raw, *infer)
            for i, answer in enumerate(answers[:100]):
                assert answer == f"request {i}".encode() * (i + 1)
            for i, answer in enumerate(answers[100:]):
                assert (answer.model_name, answer.id) == (f"m{i}", str(i))

    run(body())


# -- 2. status codes and messages ------------------------------------------------


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, "go away"),
        (grpc.StatusCode.INVALID_ARGUMENT, "naïve % 100"),
        (grpc.StatusCode.NOT_FOUND, "模型 \u00e9\t%20 ✓"),
    ],
)
def test_abort_reaches_the_client_with_its_code_and_exact_message(
    code: grpc.StatusCode, message: str
) -> None:
    async def aborting(request: bytes, context: Any) -> bytes:
        await context.abort(code, message)
        raise AssertionError("abort returned")

    async def body() -> None:
        async with serving(service(Abort=unary(aborting))) as (_, address), channel(address) as ch:
            error = await expect_error(ch.unary_unary(path("Abort"))(b"x", timeout=CALL_TIMEOUT))
            assert error.code() == code
            assert error.details() == message

    run(body())


def test_set_code_and_set_details_without_abort() -> None:
    async def failing(request: bytes, context: Any) -> bytes:
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("too many: naïve % 100")
        return b"ignored"

    async def detailed_ok(request: bytes, context: Any) -> bytes:
        context.set_details("all fine")
        return b"answer"

    async def body() -> None:
        handlers = service(Fail=unary(failing), Fine=unary(detailed_ok))
        async with serving(handlers) as (_, address), channel(address) as ch:
            error = await expect_error(ch.unary_unary(path("Fail"))(b"x", timeout=CALL_TIMEOUT))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "too many: naïve % 100"
            call = ch.unary_unary(path("Fine"))(b"x", timeout=CALL_TIMEOUT)
            assert await call == b"answer"
            assert await call.code() == grpc.StatusCode.OK

    run(body())


# -- 3. a handler's exception ----------------------------------------------------------


def test_a_handler_exception_is_unknown_without_its_text() -> None:
    async def broken(request: bytes, context: Any) -> bytes:
        raise RuntimeError("secret detail /etc/passwd")

    async def broken_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        raise KeyError("secret stream detail")

    async def body() -> None:
        handlers = service(
            Broken=unary(broken),
            BrokenStream=grpc.unary_stream_rpc_method_handler(broken_stream),
        )
        async with serving(handlers) as (_, address), channel(address) as ch:
            error = await expect_error(ch.unary_unary(path("Broken"))(b"x", timeout=CALL_TIMEOUT))
            assert error.code() == grpc.StatusCode.UNKNOWN
            assert "secret" not in (error.details() or "")
            assert "RuntimeError" not in (error.details() or "")

            call = ch.unary_stream(path("BrokenStream"))(b"x", timeout=CALL_TIMEOUT)
            assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == b"first"
            assert await asyncio.wait_for(call.code(), CALL_TIMEOUT) == grpc.StatusCode.UNKNOWN
            assert "secret" not in (await call.details() or "")

    run(body())


def test_invalid_trailing_metadata_still_ends_the_call() -> None:
    """A handler's trailing metadata that cannot go on the wire (a non-ASCII
    value under a non -bin key) must not leave the call open until the
    client's deadline: grpc.aio answers INTERNAL at once."""

    async def bad_trailer(request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("x-bad", "naïve"),))
        return b"ok"

    async def body() -> None:
        handlers = service(Bad=unary(bad_trailer), Echo=unary(echo))
        async with serving(handlers) as (_, address), channel(address) as ch:
            loop = asyncio.get_running_loop()
            begun = loop.time()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await asyncio.wait_for(ch.unary_unary(path("Bad"))(b"x", timeout=3), 5)
            # an answer (any code), not the client giving up at its 3 s deadline
            elapsed = loop.time() - begun
            assert elapsed < 2, f"no answer for {elapsed:.1f} s: the call was left open"
            assert await ch.unary_unary(path("Echo"))(b"next", timeout=CALL_TIMEOUT) == b"next"

    run(body())


# -- 4. unknown methods ----------------------------------------------------------------


def test_an_unknown_method_is_unimplemented() -> None:
    async def body() -> None:
        async with (
            serving(service(Echo=unary(echo)), setup=add_inference) as (_, address),
            channel(address) as ch,
        ):
            for name in (path("Nope"), "/no.Such/Service", "/inference.GRPCInferenceService/X"):
                error = await expect_error(ch.unary_unary(name)(b"x", timeout=CALL_TIMEOUT))
                assert error.code() == grpc.StatusCode.UNIMPLEMENTED, name
                assert error.details() == "", name  # Triton's answer: no message
            stream = ch.stream_stream(path("NopeStream"))(timeout=CALL_TIMEOUT)
            assert await asyncio.wait_for(stream.code(), CALL_TIMEOUT) == (
                grpc.StatusCode.UNIMPLEMENTED
            )
            # the connection is still good afterwards
            assert await ch.unary_unary(path("Echo"))(b"ok", timeout=CALL_TIMEOUT) == b"ok"

    run(body())


# -- 5. metadata ----------------------------------------------------------------------


def test_request_metadata_reaches_the_handler_and_response_metadata_the_client() -> None:
    seen: list[tuple[tuple[str, Any], ...]] = []
    peers: list[str] = []

    async def with_metadata(request: bytes, context: Any) -> bytes:
        seen.append(tuple(context.invocation_metadata()))
        peers.append(context.peer())
        await context.send_initial_metadata((("x-initial", "early"), ("x-initial-bin", b"\x01")))
        context.set_trailing_metadata((("x-trailer", "late"), ("x-trailer-bin", b"\xfe\x00\xff")))
        return request

    async def abort_with_trailers(request: bytes, context: Any) -> bytes:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, "no", trailing_metadata=(("x-why", "because"),)
        )
        return b""

    async def body() -> None:
        handlers = service(Meta=unary(with_metadata), AbortMeta=unary(abort_with_trailers))
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_unary(path("Meta"))(
                b"payload",
                metadata=(("x-plain", "hello world"), ("x-data-bin", b"\x00\x01\xfe\xff\n")),
                timeout=CALL_TIMEOUT,
            )
            assert await call == b"payload"
            received = dict(seen[0])
            assert received["x-plain"] == "hello world"
            assert received["x-data-bin"] == b"\x00\x01\xfe\xff\n"
            assert "grpc-timeout" not in received and "content-type" not in received
            assert peers[0].startswith("ipv4:127.0.0.1:")
            initial = await call.initial_metadata()
            assert initial.get("x-initial") == "early"
            assert initial.get("x-initial-bin") == b"\x01"
            trailing = await call.trailing_metadata()
            assert trailing.get("x-trailer") == "late"
            assert trailing.get("x-trailer-bin") == b"\xfe\x00\xff"

            aborted = ch.unary_unary(path("AbortMeta"))(b"x", timeout=CALL_TIMEOUT)
            error = await expect_error(aborted)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error.details() == "no"
            assert error.trailing_metadata().get("x-why") == "because"

    run(body())


# -- 6, 7. deadlines and cancellation ------------------------------------------------


class Slow:
    """A handler that sleeps until cancelled, and records what it saw."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.done_callback = asyncio.Event()
        self.remaining: list[float | None] = []
        self.context_cancelled: list[bool] = []

    async def __call__(self, request: bytes, context: Any) -> bytes:
        self.remaining.append(context.time_remaining())
        context.add_done_callback(lambda _: self.done_callback.set())
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.context_cancelled.append(context.cancelled())
            self.cancelled.set()
            raise
        return b"too late"


def test_a_passed_deadline_is_deadline_exceeded_and_cancels_the_handler() -> None:
    async def body() -> None:
        slow = Slow()
        handlers = service(Slow=unary(slow), Echo=unary(echo))
        async with serving(handlers) as (_, address), channel(address) as ch:
            error = await expect_error(ch.unary_unary(path("Slow"))(b"x", timeout=0.5))
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait(slow.cancelled)
            await wait(slow.done_callback)
            remaining = slow.remaining[0]
            assert remaining is not None and 0 < remaining <= 0.6  # grpc rounds the header up
            assert await ch.unary_unary(path("Echo"))(b"after", timeout=CALL_TIMEOUT) == b"after"

    run(body())


async def raw_unary(
    address: str, method: str, body: bytes, timeout: str
) -> list[tuple[int, int, int, bytes]]:
    """One unary call played by hand on a socket (no grpc client, which stops
    reading at its own deadline): every frame the server sends on stream 1
    until the stream ends."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", method),
        (":authority", address),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", timeout),
    ]
    message = b"\0" + len(body).to_bytes(4, "big") + body
    writer.write(
        wire.PREFACE
        + wire.frame(wire.SETTINGS, 0, 0, b"")
        + wire.frame(wire.HEADERS, wire.END_HEADERS, 1, hpack.Encoder().encode(headers))
        + wire.frame(wire.DATA, wire.END_STREAM, 1, message)
    )
    seen: list[tuple[int, int, int, bytes]] = []
    try:
        while True:
            head = await asyncio.wait_for(reader.readexactly(9), CALL_TIMEOUT)
            length = int.from_bytes(head[:3], "big")
            kind, flags = head[3], head[4]
            sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = await asyncio.wait_for(reader.readexactly(length), CALL_TIMEOUT)
            if sid == 1:
                seen.append((kind, flags, sid, payload))
                if flags & wire.END_STREAM or kind == wire.RST_STREAM:
                    return seen
    finally:
        writer.close()


def test_a_handler_that_drops_its_deadline_cancel_still_ends_deadline_exceeded() -> None:
    """A handler that ends normally after its deadline passed (it swallowed the
    cancel, as Python 3.11's wait_for can) answers nothing: the call's only
    status is DEADLINE_EXCEEDED, as from grpc's server."""
    finished = asyncio.Event()

    async def stubborn(request: bytes, context: Any) -> bytes:
        with contextlib.suppress(asyncio.CancelledError):  # the cancel dropped
            await asyncio.sleep(30)
        finished.set()
        return b"too late"

    async def body() -> None:
        async with serving(service(Stubborn=unary(stubborn))) as (_, address):
            frames = await raw_unary(address, path("Stubborn"), b"x", "200m")
            await wait(finished)
        assert not any(kind == wire.DATA for kind, *_ in frames)
        kind, flags, _, _ = frames[-1]
        assert kind == wire.HEADERS and flags & wire.END_STREAM
        decoder = hpack.Decoder()  # blocks decode in order: they share HPACK's table
        blocks = [dict(decoder.decode(p, raw=True)) for k, _, _, p in frames if k == wire.HEADERS]
        trailers = blocks[-1]
        assert trailers[b"grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]).encode()
        assert trailers[b"grpc-message"] == b"Deadline Exceeded"

    run(body())


def test_time_remaining_is_none_without_a_deadline() -> None:
    remaining: list[float | None] = []

    async def no_deadline(request: bytes, context: Any) -> bytes:
        remaining.append(context.time_remaining())
        return b""

    async def body() -> None:
        async with serving(service(R=unary(no_deadline))) as (_, address), channel(address) as ch:
            await asyncio.wait_for(ch.unary_unary(path("R"))(b""), CALL_TIMEOUT)
            assert remaining == [None]

    run(body())


def test_a_client_cancel_cancels_the_handler() -> None:
    async def body() -> None:
        slow = Slow()
        handlers = service(Slow=unary(slow), Echo=unary(echo))
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_unary(path("Slow"))(b"x", timeout=CALL_TIMEOUT)
            await wait(slow.started)
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(call, CALL_TIMEOUT)
            await wait(slow.cancelled)
            await wait(slow.done_callback)
            assert slow.context_cancelled == [True]
            assert await ch.unary_unary(path("Echo"))(b"after", timeout=CALL_TIMEOUT) == b"after"

    run(body())


def test_a_client_cancel_cancels_a_streaming_handler() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def endless(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"one"
            started.set()
            await asyncio.sleep(30)
            yield b"never"
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def body() -> None:
        handlers = service(Endless=grpc.unary_stream_rpc_method_handler(endless))
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_stream(path("Endless"))(b"x", timeout=CALL_TIMEOUT)
            assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == b"one"
            await wait(started)
            assert call.cancel()
            await wait(cancelled)

    run(body())


# -- 8. streaming ---------------------------------------------------------------------


def test_server_streaming_with_an_async_generator_and_with_context_write() -> None:
    async def generated(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield b"gen %d" % i

    async def written(request: bytes, context: Any) -> None:
        for i in range(int(request)):
            await context.write(b"write %d" % i)

    async def empty(request: bytes, context: Any) -> None:
        return None

    async def body() -> None:
        handlers = service(
            Gen=grpc.unary_stream_rpc_method_handler(generated),
            Write=grpc.unary_stream_rpc_method_handler(written),
            Empty=grpc.unary_stream_rpc_method_handler(empty),
        )
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_stream(path("Gen"))(b"50", timeout=CALL_TIMEOUT)
            got = [m async for m in call]
            assert got == [b"gen %d" % i for i in range(50)]
            assert await call.code() == grpc.StatusCode.OK
            call = ch.unary_stream(path("Write"))(b"50", timeout=CALL_TIMEOUT)
            got = [m async for m in call]
            assert got == [b"write %d" % i for i in range(50)]
            assert await call.code() == grpc.StatusCode.OK
            call = ch.unary_stream(path("Empty"))(b"", timeout=CALL_TIMEOUT)
            assert [m async for m in call] == []
            assert await call.code() == grpc.StatusCode.OK

    run(body())


def test_protobuf_server_streaming() -> None:
    async def infer_stream(request: gs.ModelInferRequest, context: Any) -> AsyncIterator[Any]:
        for i in range(3):
            yield gs.ModelStreamInferResponse(
                infer_response=gs.ModelInferResponse(model_name=request.model_name, id=str(i))
            )

    async def body() -> None:
        handlers = service(
            Stream=grpc.unary_stream_rpc_method_handler(
                infer_stream,
                request_deserializer=gs.ModelInferRequest.FromString,
                response_serializer=gs.ModelStreamInferResponse.SerializeToString,
            )
        )
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_stream(
                path("Stream"),
                request_serializer=gs.ModelInferRequest.SerializeToString,
                response_deserializer=gs.ModelStreamInferResponse.FromString,
            )(gs.ModelInferRequest(model_name="m"), timeout=CALL_TIMEOUT)
            got = [(m.infer_response.model_name, m.infer_response.id) async for m in call]
            assert got == [("m", "0"), ("m", "1"), ("m", "2")]

    run(body())


def test_bidi_streaming_interleaves_requests_and_responses() -> None:
    async def by_read(requests: AsyncIterator[bytes], context: Any) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                await context.write(b"bye")
                return
            await context.write(request[::-1])

    async def body() -> None:
        handlers = service(
            Upper=grpc.stream_stream_rpc_method_handler(upper_each),
            ByRead=grpc.stream_stream_rpc_method_handler(by_read),
        )
        async with serving(handlers) as (_, address), channel(address) as ch:
            for method, expected, last in (
                ("Upper", lambda m: m.upper(), None),
                ("ByRead", lambda m: m[::-1], b"bye"),
            ):
                call = ch.stream_stream(path(method))(timeout=CALL_TIMEOUT)
                for i in range(20):
                    message = b"message %d abc" % i
                    await asyncio.wait_for(call.write(message), CALL_TIMEOUT)
                    # the answer comes while the request stream is still open
                    assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == expected(message)
                await asyncio.wait_for(call.done_writing(), CALL_TIMEOUT)
                if last is not None:
                    assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == last
                assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) is grpc.aio.EOF
                assert await asyncio.wait_for(call.code(), CALL_TIMEOUT) == grpc.StatusCode.OK

    run(body())


def test_client_streaming_sums_the_requests() -> None:
    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"%d" % sum([len(r) async for r in requests])

    async def body() -> None:
        handlers = service(Total=grpc.stream_unary_rpc_method_handler(total))
        async with serving(handlers) as (_, address), channel(address) as ch:
            answer = await ch.stream_unary(path("Total"))(
                iter([b"a" * i for i in range(10)]), timeout=CALL_TIMEOUT
            )
            assert answer == b"45"

    run(body())


def test_accepted_connections_send_without_nagle() -> None:
    """Every accepted connection has TCP_NODELAY: with Nagle on, an answer
    written while an earlier one is unacknowledged waits for the client's
    delayed ACK (~40 ms). asyncio sets it only on sockets made with proto
    IPPROTO_TCP, which the server's own listening socket is not."""

    async def body() -> None:
        handlers = service(Upper=grpc.stream_stream_rpc_method_handler(upper_each))
        async with serving(handlers) as (server, address), channel(address) as ch:
            call = ch.stream_stream(path("Upper"))(timeout=CALL_TIMEOUT)
            await asyncio.wait_for(call.write(b"x"), CALL_TIMEOUT)
            assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == b"X"
            transports = [c.transport for c in server._connections]
            sockets = [t.get_extra_info("socket") for t in transports if t is not None]
            assert sockets
            for sock in sockets:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            call.cancel()

    run(body())


# -- 9. large messages and flow control -----------------------------------------------


def test_8_mib_request_and_8_mib_response() -> None:
    async def reverse(request: bytes, context: Any) -> bytes:
        return request[::-1]

    async def body() -> None:
        request = os.urandom(8 << 20)
        async with serving(service(Reverse=unary(reverse))) as (_, address), channel(address) as ch:
            answer = await ch.unary_unary(path("Reverse"))(request, timeout=CALL_TIMEOUT)
            assert len(answer) == len(request)
            assert answer == request[::-1]

    run(body())


def test_20_concurrent_1_mib_responses_on_one_channel() -> None:
    blobs = [os.urandom(1 << 20) for _ in range(20)]

    async def blob(request: bytes, context: Any) -> bytes:
        return blobs[int(request)]

    async def body() -> None:
        async with serving(service(Blob=unary(blob))) as (_, address), channel(address) as ch:
            call = ch.unary_unary(path("Blob"))
            answers = await asyncio.gather(
                *(call(b"%d" % i, timeout=CALL_TIMEOUT) for i in range(20))
            )
            for i, answer in enumerate(answers):
                assert answer == blobs[i], i

    run(body())


def test_a_bidi_stream_carries_24_mib_each_way() -> None:
    """More than the 16 MiB stream window the server opens, in both directions."""
    messages = [os.urandom(6 << 20) for _ in range(4)]

    async def reverse_each(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request[::-1]

    async def body() -> None:
        handlers = service(Reverse=grpc.stream_stream_rpc_method_handler(reverse_each))
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.stream_stream(path("Reverse"))(timeout=CALL_TIMEOUT)
            for message in messages:
                await asyncio.wait_for(call.write(message), CALL_TIMEOUT)
                assert await asyncio.wait_for(call.read(), CALL_TIMEOUT) == message[::-1]
            await asyncio.wait_for(call.done_writing(), CALL_TIMEOUT)
            assert await asyncio.wait_for(call.code(), CALL_TIMEOUT) == grpc.StatusCode.OK

    run(body())


def test_large_streamed_responses() -> None:
    blobs = [os.urandom(3 << 20) for _ in range(3)]

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for b in blobs:
            yield b

    async def body() -> None:
        handlers = service(Stream=grpc.unary_stream_rpc_method_handler(stream))
        async with serving(handlers) as (_, address), channel(address) as ch:
            call = ch.unary_stream(path("Stream"))(b"", timeout=CALL_TIMEOUT)
            assert [m async for m in call] == blobs

    run(body())


@pytest.mark.parametrize("compressed", [False, True])
def test_an_answer_in_parts_arrives_as_the_parts_joined(compressed: bool) -> None:
    """A serializer's MessageParts go out as one message: empty, small, across
    the 16 KiB frames grpc's client takes (pieces larger and smaller than a
    frame, a piece ending on a frame's edge, small pieces then a large one
    as an answer with one large output is), and past the windows (8 MiB,
    the parts joined for the frames waiting there); with the call's answers
    compressed (gzip) too."""
    edge = wire.DEFAULT_MAX_FRAME - 5
    answers = {
        b"empty": [b""],
        b"small": [b"a", b"", b"bc"],
        b"edge": [os.urandom(edge), os.urandom(3)],
        b"mixed": [os.urandom(20), os.urandom(49152), b"\x32\x80\x80\x03", os.urandom(49152)],
        b"answer": [os.urandom(60), b"\x32\x80\x80\x03", os.urandom(49152)],
        b"lead-near-edge": [os.urandom(edge - 1), os.urandom(49152)],
        b"lead-short": [os.urandom(10), os.urandom(edge - 10)],
        b"large": [os.urandom(3 << 20), os.urandom(5 << 20)],
    }

    async def parts(request: bytes, context: Any) -> wire.MessageParts:
        return wire.MessageParts(answers[request])

    async def body() -> None:
        level = {path("Parts"): "high"} if compressed else {}
        server = H2GrpcServer(compression=level)
        server.add_generic_rpc_handlers([service(Parts=unary(parts))])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary(path("Parts"))
                got = await asyncio.gather(*(call(k, timeout=CALL_TIMEOUT) for k in answers))
                for key, answer in zip(answers, got, strict=True):
                    assert answer == b"".join(answers[key]), key
        finally:
            await asyncio.wait_for(server.stop(0), 5)

    run(body())


# -- 10. request compression ----------------------------------------------------------


@pytest.mark.parametrize(
    ("compression", "encoding"),
    [(grpc.Compression.Gzip, b"gzip"), (grpc.Compression.Deflate, b"deflate")],
)
def test_compressed_requests_are_decompressed(
    compression: grpc.Compression, encoding: bytes
) -> None:
    encodings: list[bytes] = []

    async def echo_encoding(request: bytes, context: Any) -> bytes:
        encodings.append(context._call.encoding)
        return request

    async def joined(requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"|".join([r async for r in requests])

    async def body() -> None:
        handlers = service(
            Echo=unary(echo_encoding), Join=grpc.stream_unary_rpc_method_handler(joined)
        )
        request = b"compress me please " * 50_000
        async with (
            serving(handlers) as (_, address),
            channel(address, compression=compression) as ch,
        ):
            answer = await ch.unary_unary(path("Echo"))(request, timeout=CALL_TIMEOUT)
            assert answer == request
            assert encodings == [encoding]
            parts = [b"part %d " % i * 1000 for i in range(5)]
            answer = await ch.stream_unary(path("Join"))(iter(parts), timeout=CALL_TIMEOUT)
            assert answer == b"|".join(parts)

    run(body())


# -- 11. interceptors -------------------------------------------------------------------


class RequireHeader(grpc.aio.ServerInterceptor):
    """Denies every call without `x-allow: yes` with UNAVAILABLE."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        self.seen.append(handler_call_details.method)
        metadata = dict(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if metadata.get("x-allow") == "yes":
            return handler

        async def deny(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "denied: no x-allow")

        async def deny_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "denied: no x-allow")
            yield b""  # pragma: no cover

        if handler is not None and handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def test_an_interceptor_denies_or_passes_unary_and_stream_calls() -> None:
    async def upper(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request.upper()

    async def body() -> None:
        interceptor = RequireHeader()
        handlers = service(Echo=unary(echo), Upper=grpc.stream_stream_rpc_method_handler(upper))
        allow = (("x-allow", "yes"),)
        async with (
            serving(handlers, interceptors=[interceptor], setup=add_inference) as (_, address),
            channel(address) as ch,
        ):
            echo_call = ch.unary_unary(path("Echo"))
            error = await expect_error(echo_call(b"x", timeout=CALL_TIMEOUT))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == "denied: no x-allow"
            assert await echo_call(b"x", metadata=allow, timeout=CALL_TIMEOUT) == b"x"

            stub = gs_grpc.GRPCInferenceServiceStub(ch)
            live = await stub.ServerLive(gs.ServerLiveRequest(), metadata=allow, timeout=5)
            assert live.live

            denied = ch.stream_stream(path("Upper"))(timeout=CALL_TIMEOUT)
            assert await asyncio.wait_for(denied.code(), CALL_TIMEOUT) == (
                grpc.StatusCode.UNAVAILABLE
            )
            assert await denied.details() == "denied: no x-allow"

            passed = ch.stream_stream(path("Upper"))(metadata=allow, timeout=CALL_TIMEOUT)
            for word in (b"a", b"bc", b"def"):
                await asyncio.wait_for(passed.write(word), CALL_TIMEOUT)
                assert await asyncio.wait_for(passed.read(), CALL_TIMEOUT) == word.upper()
            await asyncio.wait_for(passed.done_writing(), CALL_TIMEOUT)
            assert await asyncio.wait_for(passed.code(), CALL_TIMEOUT) == grpc.StatusCode.OK

            error = await expect_error(ch.unary_unary(path("Nope"))(b"", metadata=allow))
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED
            assert interceptor.seen.count(path("Echo")) == 2
            assert path("Upper") in interceptor.seen

    run(body())


# -- 12. graceful stop -----------------------------------------------------------------


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_stop_lets_a_call_in_flight_finish_within_grace() -> None:
    started = asyncio.Event()

    async def slowish(request: bytes, context: Any) -> bytes:
        started.set()
        await asyncio.sleep(0.5)
        return b"finished " + request

    async def body() -> None:
        server = H2GrpcServer()
        server.add_generic_rpc_handlers([service(Slowish=unary(slowish))])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(path("Slowish"))(b"x", timeout=CALL_TIMEOUT)
            await wait(started)
            stopping = asyncio.create_task(server.stop(2))
            assert await asyncio.wait_for(call, CALL_TIMEOUT) == b"finished x"
            assert await call.code() == grpc.StatusCode.OK
            await asyncio.wait_for(stopping, 5)
            assert await server.wait_for_termination(timeout=5) is True
        assert refused(port)
        async with channel(f"127.0.0.1:{port}") as fresh:
            error = await expect_error(fresh.unary_unary(path("Slowish"))(b"y", timeout=2))
            assert error.code() == grpc.StatusCode.UNAVAILABLE

    run(body())


def test_stop_ends_a_call_that_outlasts_the_grace() -> None:
    async def body() -> None:
        slow = Slow()
        server = H2GrpcServer()
        server.add_generic_rpc_handlers([service(Slow=unary(slow))])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(path("Slow"))(b"x", timeout=CALL_TIMEOUT)
            await wait(slow.started)
            loop = asyncio.get_running_loop()
            begun = loop.time()
            await asyncio.wait_for(server.stop(0.2), 5)
            assert loop.time() - begun < 3
            error = await expect_error(call)
            assert error.code() != grpc.StatusCode.OK
            # not the client's own deadline: the server ended the call
            assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            await wait(slow.cancelled)
            assert await server.wait_for_termination(timeout=5) is True
        assert refused(port)

    run(body())


def test_stop_lets_a_large_answer_still_being_sent_arrive_whole() -> None:
    """An answer the handler has returned but that still waits for the client's
    flow-control windows (16 MiB on a fresh channel) is part of the call in
    flight: stop(grace) must not close the connection under it."""
    started = asyncio.Event()
    blob = os.urandom(16 << 20)

    async def big(request: bytes, context: Any) -> bytes:
        started.set()
        await asyncio.sleep(0.2)
        return blob

    async def body() -> None:
        server = H2GrpcServer()
        server.add_generic_rpc_handlers([service(Big=unary(big))])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary(path("Big"))(b"x", timeout=CALL_TIMEOUT)
                await wait(started)
                stopping = asyncio.create_task(server.stop(5))
                try:
                    answer = await asyncio.wait_for(call, CALL_TIMEOUT)
                finally:
                    await asyncio.wait_for(stopping, 10)
                assert answer == blob
        finally:
            await asyncio.wait_for(server.stop(0), 5)

    run(body())


def test_wait_for_termination_returns_false_on_timeout_then_true_after_stop() -> None:
    async def body() -> None:
        async with serving(service(Echo=unary(echo))) as (server, _):
            assert await server.wait_for_termination(timeout=0.05) is False
            waiter = asyncio.create_task(server.wait_for_termination())
            await asyncio.sleep(0)
            assert not waiter.done()
            await asyncio.wait_for(server.stop(None), 5)
            assert await asyncio.wait_for(waiter, 5) is True

    run(body())


# -- 13. the health service --------------------------------------------------------------


def test_the_grpc_health_servicer_checks_and_watches() -> None:
    serving_status = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def body() -> None:
        servicer = health.aio.HealthServicer()
        await servicer.set("svc", serving_status)

        def register(server: H2GrpcServer) -> None:
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)

        async with serving(setup=register) as (_, address), channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            check = await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=5)
            assert check.status == serving_status
            overall = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert overall.status == serving_status
            error = await expect_error(
                stub.Check(health_pb2.HealthCheckRequest(service="other"), timeout=5)
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND

            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=CALL_TIMEOUT)
            first = await asyncio.wait_for(watch.read(), CALL_TIMEOUT)
            assert first.status == serving_status
            await servicer.set("svc", not_serving)
            second = await asyncio.wait_for(watch.read(), CALL_TIMEOUT)
            assert second.status == not_serving
            watch.cancel()
            check = await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=5)
            assert check.status == not_serving

    run(body())


# -- 14. TLS ---------------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost/127.0.0.1 (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl CLI to make a certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def test_tls_with_an_ssl_context(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)

    async def numbers(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"%d" % i

    async def body() -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2"])
        server = H2GrpcServer()
        server.add_generic_rpc_handlers(
            [service(Echo=unary(echo), Numbers=grpc.unary_stream_rpc_method_handler(numbers))]
        )
        port = server.add_secure_port("127.0.0.1:0", context)
        await server.start()
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        try:
            async with grpc.aio.secure_channel(
                f"127.0.0.1:{port}",
                credentials,
                options=[*OPTIONS, ("grpc.ssl_target_name_override", "localhost")],
            ) as ch:
                big = os.urandom(1 << 20)
                assert await ch.unary_unary(path("Echo"))(b"secret", timeout=CALL_TIMEOUT) == (
                    b"secret"
                )
                assert await ch.unary_unary(path("Echo"))(big, timeout=CALL_TIMEOUT) == big
                call = ch.unary_stream(path("Numbers"))(b"", timeout=CALL_TIMEOUT)
                assert [m async for m in call] == [b"0", b"1", b"2"]
        finally:
            await asyncio.wait_for(server.stop(0), 5)

    run(body())


def test_client_connections_have_tcp_keepalive() -> None:
    """A client gone without closing is found by TCP keepalive, as grpc.aio's pings found it."""

    async def body() -> None:
        async with serving(service(Echo=unary(echo))) as (server, address), channel(address) as ch:
            assert await ch.unary_unary(path("Echo"))(b"x", timeout=CALL_TIMEOUT) == b"x"
            (connection,) = server._connections
            assert connection.transport is not None
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10

    run(body())
