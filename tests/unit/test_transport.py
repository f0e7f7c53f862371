"""stageserve/transport.py over real grpc.aio streams (one process, localhost)."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
import pytest
from prometheus_client import REGISTRY

from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.net import free_port
from stageserve.transport import _Outbox, serve_stream
from stageserve.write_hold import WriteHold
from tests.unit.scheduler_links import Broken, scheduler_link


class Echo(pb_grpc.SchedulerServicer):
    """Answers model "echo" at once, "slow" after 50 ms, "boom" by raising,
    "parts" with two more=True responses before the final one, "never" never."""

    def __init__(self, concurrent: bool = True) -> None:
        self.concurrent = concurrent
        self.messages_in = 0
        self.requests_in = 0
        self.handled: list[str] = []
        self.message_ends: list[int] = []  # len(handled) at each message's end

    def _unpack(self, message: pb.ScheduleBatch):
        self.messages_in += 1
        self.requests_in += len(message.requests)
        return message.requests

    async def _handle(self, request: pb.ScheduleRequest, respond) -> None:
        self.handled.append(request.request_id)
        if request.model == "slow":
            await asyncio.sleep(0.05)
        elif request.model == "boom":
            raise ValueError("secret detail")
        elif request.model == "never":
            return
        elif request.model == "parts":
            respond(pb.ScheduleResponse(id=request.id, more=True, message="1"))
            respond(pb.ScheduleResponse(id=request.id, more=True, message="2"))
        respond(pb.ScheduleResponse(id=request.id, message=request.request_id))

    async def Schedule(self, request_iterator, context):
        async for message in serve_stream(
            request_iterator,
            unpack=self._unpack,
            handle=self._handle,
            pack=lambda responses: pb.ScheduleResponses(responses=responses),
            concurrent=self.concurrent,
            on_error=lambda request, exc: pb.ScheduleResponse(
                id=request.id, failure=pb.STAGE_FAULT, message=f"failed: {type(exc).__name__}"
            ),
            on_message_end=lambda: self.message_ends.append(len(self.handled)),
        ):
            yield message


async def _server(servicer: Echo, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _req(model: str, tag: str = "") -> pb.ScheduleRequest:
    return pb.ScheduleRequest(model=model, request_id=tag)


@pytest.fixture
def port() -> int:
    return free_port()


def in_loop(test):
    """Run an async test in a fresh event loop (no pytest-asyncio here)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))

    return run


@in_loop
async def test_many_calls_in_flight_are_matched_by_id_and_packed(port):
    servicer = Echo()
    server = await _server(servicer, port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        tags = [str(i) for i in range(200)]
        answers = await asyncio.gather(*(link.call(_req("echo", t)) for t in tags))
        assert [a.message for a in answers] == tags
        assert servicer.requests_in == 200
        # 200 calls queued in one loop turn travel in far fewer messages.
        assert servicer.messages_in < 20
        assert link.in_flight == 0
        await link.close()
    await server.stop(None)


def _stream_counts(link: str) -> tuple[float, float]:
    """(messages, requests) the client ends of `link` streams have written."""
    labels = {"link": link}
    messages = REGISTRY.get_sample_value("stageserve_stream_messages_total", labels) or 0.0
    requests = REGISTRY.get_sample_value("stageserve_stream_requests_total", labels) or 0.0
    return messages, requests


@in_loop
async def test_the_link_counts_the_messages_it_writes_and_the_requests_they_carry(port):
    servicer = Echo()
    server = await _server(servicer, port)
    messages0, requests0 = _stream_counts("test")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        await asyncio.gather(*(link.call(_req("echo", str(i))) for i in range(50)))
        await link.call(_req("echo", "alone"))
        await link.close()
    await server.stop(None)
    messages, requests = _stream_counts("test")
    # what the server read, message for message: 51 requests in fewer messages
    assert (messages - messages0, requests - requests0) == (
        servicer.messages_in,
        servicer.requests_in,
    )
    assert requests - requests0 == 51
    assert 2 <= messages - messages0 < 51


@in_loop
async def test_a_write_hold_packs_requests_that_arrive_one_by_one(port):
    servicer = Echo()
    server = await _server(servicer, port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        # At most 200 ms, and (a test with few calls) whatever the mean in flight.
        link = scheduler_link(channel, hold=WriteHold(200_000_000, min_mean_in_flight=0))
        # Alone on the stream, a call is written at once: answered long
        # before the 200 ms the hold could wait.
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await link.call(_req("echo", "alone"))).message == "alone"
        assert loop.time() - started < 0.1
        assert servicer.messages_in == 1
        # With a call in flight, calls arriving 5 ms apart wait for each
        # other: one message carries them, though each came in its own turn.
        never = asyncio.ensure_future(link.call(_req("never", "busy")))
        await asyncio.sleep(0.05)
        before = servicer.messages_in
        calls = []
        for i in range(5):
            calls.append(asyncio.ensure_future(link.call(_req("echo", str(i)))))
            await asyncio.sleep(0.005)
        answers = await asyncio.gather(*calls)
        assert [a.message for a in answers] == [str(i) for i in range(5)]
        assert servicer.messages_in - before == 1
        never.cancel()
        await link.close()
    await server.stop(None)


@in_loop
async def test_a_sent_request_reaches_the_handler_in_order_and_waits_for_nothing(port):
    servicer = Echo(concurrent=False)
    server = await _server(servicer, port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        await link.send(_req("never", "sent"))  # no answer is ever awaited
        assert link.in_flight == 0
        answer = await link.call(_req("echo", "called"))
        assert answer.message == "called"
        assert servicer.handled == ["sent", "called"]
        await link.close()
    await server.stop(None)


@in_loop
async def test_decoupled_parts_reach_on_more_before_the_final_response(port):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        parts: list[str] = []
        final = await link.call(_req("parts", "last"), on_more=lambda r: parts.append(r.message))
        assert parts == ["1", "2"]
        assert final.message == "last" and not final.more
        await link.close()
    await server.stop(None)


@in_loop
async def test_a_raising_on_more_callback_fails_its_call_only(port):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)

        def raising(_resp) -> None:
            raise KeyError("callback bug")

        with pytest.raises(KeyError):  # at once, not when the stream ends
            await asyncio.wait_for(link.call(_req("parts", "last"), on_more=raising), 5)
        assert (await link.call(_req("echo", "after"))).message == "after"
        assert not link.broken
        await link.close()
    await server.stop(None)


@in_loop
async def test_a_raising_handler_is_answered_and_the_stream_goes_on(port):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        failed, ok = await asyncio.gather(link.call(_req("boom")), link.call(_req("echo", "x")))
        assert failed.failure == pb.STAGE_FAULT and failed.message == "failed: ValueError"
        assert "secret" not in failed.message
        assert ok.message == "x"
        assert (await link.call(_req("echo", "y"))).message == "y"
        await link.close()
    await server.stop(None)


@in_loop
async def test_on_message_end_runs_once_per_message_after_all_its_handlers(port):
    servicer = Echo(concurrent=False)
    server = await _server(servicer, port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        await link.call(_req("echo", "first"))  # a message of one
        # Queued in one turn: one message of three, one of whose handlers raises.
        answers = await asyncio.gather(
            link.call(_req("echo", "a")), link.call(_req("boom", "b")), link.call(_req("echo", "c"))
        )
        assert [a.failure for a in answers] == [pb.FAILURE_NONE, pb.STAGE_FAULT, pb.FAILURE_NONE]
        assert servicer.messages_in == 2
        assert servicer.message_ends == [1, 4]  # after the 1st handler, then after the 4th
        await link.close()
    await server.stop(None)


@in_loop
async def test_concurrent_handlers_answer_as_they_finish(port):
    server = await _server(Echo(concurrent=True), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        order: list[str] = []

        async def call(model: str, tag: str) -> None:
            await link.call(_req(model, tag))
            order.append(tag)

        await asyncio.gather(call("slow", "slow"), call("echo", "fast"))
        assert order == ["fast", "slow"]
        await link.close()
    await server.stop(None)


@in_loop
async def test_sequential_handlers_run_in_arrival_order(port):
    servicer = Echo(concurrent=False)
    server = await _server(servicer, port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        tags = [f"{model}{i}" for i, model in enumerate(["slow", "echo", "slow", "echo"])]
        await asyncio.gather(*(link.call(_req(t[:-1], t)) for t in tags))
        assert servicer.handled == tags
        await link.close()
    await server.stop(None)


@in_loop
async def test_timeout_fails_the_call_with_the_given_error(port):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        with pytest.raises(Broken) as caught:
            await link.call(
                _req("never"),
                timeout_s=0.05,
                on_timeout=lambda: Broken(grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
            )
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert link.in_flight == 0
        with pytest.raises(TimeoutError):
            await link.call(_req("never"), timeout_s=0.01)
        await link.close()
    await server.stop(None)


@in_loop
async def test_a_broken_stream_fails_every_waiting_call_then_reopens(port):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        assert (await link.call(_req("echo", "a"))).message == "a"
        waiting = [asyncio.ensure_future(link.call(_req("never"))) for _ in range(5)]
        await asyncio.sleep(0.05)
        await server.stop(None)  # the peer goes away mid-call
        results = await asyncio.wait_for(
            asyncio.gather(*waiting, return_exceptions=True), timeout=5
        )
        assert all(isinstance(r, Broken) for r in results), results
        assert results[0].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert link.broken and link.in_flight == 0
        server = await _server(Echo(), port)  # back on the same address
        for _ in range(50):  # the channel reconnects with backoff
            try:
                answer = await link.call(_req("echo", "b"))
                break
            except Broken:
                await asyncio.sleep(0.1)
        assert answer.message == "b"
        assert not link.broken
        await link.close()
    await server.stop(None)


@in_loop
async def test_callers_waiting_for_one_failed_open_share_its_error(port):
    attempts = 0

    async def never_ready() -> None:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.05)
        raise Broken(grpc.StatusCode.UNAVAILABLE, "unreachable")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel, ready=never_ready)
        results = await asyncio.gather(
            *(link.call(_req("echo")) for _ in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, Broken) for r in results)
        assert attempts == 1  # one bounded wait for all of them, not one each
        with pytest.raises(Broken):  # a later call tries again
            await link.call(_req("echo"))
        assert attempts == 2


@in_loop
async def test_outbox_hands_over_everything_queued_then_ends_when_closed() -> None:
    # the outbox never looks at its items: ints stand in for messages
    outbox: _Outbox[int] = _Outbox()  # type: ignore[type-var]
    taker = asyncio.ensure_future(outbox.take_all())
    await asyncio.sleep(0)
    outbox.put(1)
    outbox.put(2)
    assert await taker == [1, 2]
    outbox.put(3)
    outbox.close()
    assert await outbox.take_all() == [3]  # what was queued still goes out
    assert await outbox.take_all() == []


@in_loop
async def test_a_down_peer_is_logged_once_not_once_per_call(port, caplog):
    server = await _server(Echo(), port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = scheduler_link(channel)
        assert (await link.call(_req("echo", "a"))).message == "a"
        await server.stop(None)
        with caplog.at_level(logging.WARNING, logger="stageserve.transport"):
            for _ in range(6):  # each call opens a stream that fails at once
                with pytest.raises(Broken):
                    await link.call(_req("echo"), timeout_s=5)
        ended = [r for r in caplog.records if r.getMessage() == "internal stream ended"]
        # the stream that broke, then the first failed reopen; not one per call
        assert 1 <= len(ended) <= 2, [r.__dict__.get("details") for r in ended]
        server = await _server(Echo(), port)
        for _ in range(50):
            try:
                assert (await link.call(_req("echo", "b"))).message == "b"
                break
            except Broken:
                await asyncio.sleep(0.1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stageserve.transport"):
            await server.stop(None)  # up again, then down again: logged again
            with pytest.raises(Broken):
                await link.call(_req("echo"), timeout_s=5)
        assert any(r.getMessage() == "internal stream ended" for r in caplog.records)
        await link.close()
