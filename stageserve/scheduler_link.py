"""The gateway's (and a worker's BLS) long-lived stream to the scheduler.

Requests are multiplexed over one bidirectional stream (stageserve/transport.py)
and matched to their responses by id. If the stream breaks, every request
waiting on it fails with UNAVAILABLE at once, and the next request opens a new
stream: a scheduler that is down costs a client one fast error, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import grpc

from stageserve.errors import StageError, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.net import own_stream_channel, stage_channel
from stageserve.stage_tls import StageTls
from stageserve.tensor_shm import release_outputs
from stageserve.transport import StreamLink
from stageserve.write_hold import WriteHold


class SchedulerGone(StageError):
    """The scheduler left the shard map while this end waited to connect:
    nothing was sent, so the router may send the request to the new owner."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class SchedulerLink:
    def __init__(
        self,
        address: str,
        connect_timeout_s: float,
        stage_tls: StageTls | None,
        hold_us: int = 0,
        give_up: Callable[[], Awaitable[None]] | None = None,
        client: str = "h2",
    ) -> None:
        """`connect_timeout_s`: GatewaySettings.scheduler_connect_timeout_s;
        `stage_tls`: Settings.stage_tls, the channel's mutual TLS (None: plaintext).
        `hold_us` > 0: each write may wait up to that long for more requests
        (stageserve/write_hold.py): the gateway's link, not a worker's BLS calls,
        which a model's execute waits on.
        `give_up`: awaited beside a connection attempt; when it finishes first
        (the router saw this scheduler leave the shard map), the attempt fails
        with SchedulerGone before anything was sent. `client`:
        GatewaySettings.stream_client, the stream's client ("h2" or "grpcio")."""
        self.address = address
        self.give_up = give_up
        self.connect_timeout_s = connect_timeout_s
        self.channel = stage_channel(address, stage_tls)  # unary calls (queue statistics)
        self.stream_channel = own_stream_channel(address, stage_tls, client) or self.channel
        stub = pb_grpc.SchedulerStub(self.stream_channel)
        self._link: StreamLink[pb.ScheduleRequest, pb.ScheduleResponse] = StreamLink(
            name="scheduler",
            open_call=stub.Schedule,
            pack=lambda requests: pb.ScheduleBatch(requests=requests),
            unpack=lambda message: message.responses,
            on_break=self._broken,
            ready=self._connected,
            hold=WriteHold(hold_us * 1000) if hold_us > 0 else None,
            orphan=release_outputs,
        )

    async def _connected(self) -> None:
        if self.give_up is not None:
            await self._connected_unless_gone(self.give_up)
            return
        try:
            await asyncio.wait_for(self.stream_channel.channel_ready(), self.connect_timeout_s)
        except TimeoutError:
            raise unavailable(
                f"scheduler at {self.address} is unreachable (no connection within "
                f"{self.connect_timeout_s}s)"
            ) from None

    async def _connected_unless_gone(self, give_up: Callable[[], Awaitable[None]]) -> None:
        ready: asyncio.Future[None] = asyncio.ensure_future(self.stream_channel.channel_ready())
        gone = asyncio.ensure_future(give_up())
        try:
            done, _ = await asyncio.wait(
                {ready, gone}, timeout=self.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (ready, gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if ready in done and not ready.cancelled() and ready.exception() is None:
            return
        if gone in done:
            raise SchedulerGone(f"scheduler at {self.address} left the shard map")
        raise unavailable(
            f"scheduler at {self.address} is unreachable (no connection within "
            f"{self.connect_timeout_s}s)"
        )

    def _broken(self, code: grpc.StatusCode, details: str) -> StageError:
        return unavailable(f"scheduler at {self.address} unavailable: {code.name}: {details}")

    async def schedule(
        self,
        request: pb.ScheduleRequest,
        on_more: Callable[[pb.ScheduleResponse], None] | None = None,
    ) -> pb.ScheduleResponse:
        """The request's (final) response; `on_more` gets a decoupled model's
        earlier responses as they arrive."""
        return await self._link.call(request, on_more=on_more)

    async def close(self) -> None:
        await self._link.close()
        if self.stream_channel is not self.channel:
            await self.stream_channel.close()
        await self.channel.close()
