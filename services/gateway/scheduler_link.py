"""The gateway's long-lived stream to the scheduler.

Requests are multiplexed over one bidirectional stream and matched to their
responses by id. If the stream breaks, every request waiting on it fails with
UNAVAILABLE at once, and the next request opens a new stream: a scheduler
that is down costs a client one fast error, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import grpc

from stageserve.errors import StageError, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.net import insecure_channel
from stageserve.settings import GATEWAY

log = logging.getLogger(__name__)

_CLOSE = object()


class SchedulerLink:
    def __init__(
        self, address: str, connect_timeout_s: float = GATEWAY.scheduler_connect_timeout_s
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.channel = insecure_channel(address)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[pb.ScheduleResponse]] = {}
        # Decoupled models: the responses before a request's final one.
        self._on_more: dict[int, Callable[[pb.ScheduleResponse], None]] = {}
        self._outbox: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._opening = asyncio.Lock()
        self._last_failure: tuple[float, StageError] | None = None

    async def _ensure_stream(self) -> asyncio.Queue:
        if self._outbox is not None and self._reader is not None and not self._reader.done():
            return self._outbox
        # One stream at a time: concurrent first requests wait for the same
        # stream instead of each opening one (which would reorder them). A
        # failed attempt answers everyone who waited for it at once, so a down
        # scheduler costs each request one bounded wait, not one per waiter.
        asked_at = time.monotonic()
        async with self._opening:
            if self._outbox is not None and self._reader is not None and not self._reader.done():
                return self._outbox
            if self._last_failure is not None and self._last_failure[0] >= asked_at:
                raise self._last_failure[1]
            try:
                return await self._open_stream()
            except StageError as err:
                self._last_failure = (time.monotonic(), err)
                raise

    async def _open_stream(self) -> asyncio.Queue:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), self.connect_timeout_s)
        except TimeoutError:
            raise unavailable(
                f"scheduler at {self.address} is unreachable (no connection within "
                f"{self.connect_timeout_s}s)"
            ) from None
        outbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            # Everything queued since the last write goes out as one message.
            while True:
                item = await outbox.get()
                if item is _CLOSE:
                    return
                batch = pb.ScheduleBatch()
                batch.requests.append(item)
                while not outbox.empty():
                    item = outbox.get_nowait()
                    if item is _CLOSE:
                        yield batch
                        return
                    batch.requests.append(item)
                yield batch

        call = self.stub.Schedule(requests())
        self._outbox = outbox
        self._reader = asyncio.create_task(self._read(call, outbox))
        return outbox

    async def _read(self, call, outbox: asyncio.Queue) -> None:
        reason = "scheduler stream closed"
        try:
            async for message in call:
                for resp in message.responses:
                    if resp.more:
                        on_more = self._on_more.get(resp.id)
                        if on_more is not None:
                            on_more(resp)
                        continue
                    fut = self._pending.pop(resp.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(resp)
        except grpc.aio.AioRpcError as exc:
            reason = f"scheduler stream failed: {exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "gateway shutting down"
            raise
        finally:
            log.warning("scheduler stream ended", extra={"reason": reason})
            if self._outbox is outbox:
                self._outbox = None
            outbox.put_nowait(_CLOSE)
            self._fail_pending(unavailable(f"scheduler at {self.address} unavailable: {reason}"))

    def _fail_pending(self, err: StageError) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def schedule(
        self,
        request: pb.ScheduleRequest,
        on_more: Callable[[pb.ScheduleResponse], None] | None = None,
    ) -> pb.ScheduleResponse:
        """The request's (final) response; `on_more` gets a decoupled model's
        earlier responses as they arrive."""
        outbox = await self._ensure_stream()
        request.id = next(self._ids)
        fut: asyncio.Future[pb.ScheduleResponse] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = fut
        if on_more is not None:
            self._on_more[request.id] = on_more
        outbox.put_nowait(request)
        try:
            return await fut
        finally:
            self._pending.pop(request.id, None)
            self._on_more.pop(request.id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.channel.close()
