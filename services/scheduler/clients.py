"""The scheduler's clients of the rate limiter and of the workers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from stageserve.errors import StageError, reason_of, status_code, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.net import own_stream_channel, stage_channel
from stageserve.settings import SchedulerSettings
from stageserve.stage_tls import StageTls
from stageserve.telemetry import STAGE_RPC_DURATION, STAGE_RPC_ERRORS
from stageserve.transport import StreamLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Granted:
    grant_id: str
    instance_id: str
    worker_address: str
    # It holds rate_limiter resources: released after one execution, never
    # kept for reuse (other instances wait for those resources).
    holds_resources: bool = False


@dataclass(frozen=True)
class InstancesGone:
    """None of the instances an acquire asked for is registered any more."""

    instances: tuple[str, ...]


class RateLimiterClient:
    """Acquire / release grants, and keep the leases of held grants alive.

    Acquires and releases travel on one long-lived stream (Grants, over
    stageserve/transport.py), packed with whatever else is queued: a unary
    call each cost the rate limiter 2x the CPU (docs/architecture.md).
    Leases are short (SchedulerSettings.grant_lease_ms), so the grants of a
    scheduler that crashed come free within seconds; a live scheduler renews
    what it holds every grant_renew_s. A renewal also reports grants the rate limiter dropped (their
    worker died), which the holder must stop using.
    """

    def __init__(
        self,
        address: str,
        settings: SchedulerSettings,
        stage_tls: StageTls | None,
        scheduler_id: str,
    ) -> None:
        """`stage_tls`: Settings.stage_tls, the channel's mutual TLS (None:
        plaintext). `scheduler_id`: the scheduler's name; its grants' ids
        begin with it and this process's incarnation (`holder`), so the next
        process of that name ends them at its start (`release_predecessors`)."""
        self.address = address
        # "/" ends the scheduler id in a grant's id
        self.holder = f"{scheduler_id.replace('/', '_')}/{uuid.uuid4().hex[:12]}"
        self.channel = stage_channel(address, stage_tls)  # its unary calls
        self.stub = pb_grpc.RateLimiterStub(self.channel)
        self.stream_channel = (
            own_stream_channel(address, stage_tls, settings.stream_client) or self.channel
        )
        self._link: StreamLink[pb.GrantRequest, pb.GrantResponse] = StreamLink(
            name=f"ratelimiter {address}",
            open_call=pb_grpc.RateLimiterStub(self.stream_channel).Grants,
            pack=lambda requests: pb.GrantRequests(requests=requests),
            unpack=lambda message: message.responses,
            on_break=self._unreachable,
        )
        self.wait_ms = settings.acquire_wait_ms
        self.lease_ms = settings.grant_lease_ms
        self.renew_s = settings.grant_renew_s
        self.held: set[str] = set()
        self.lost: set[str] = set()
        self._renewer: asyncio.Task | None = None
        self._acquire_timer = STAGE_RPC_DURATION.labels("scheduler", "ratelimiter", "Acquire")

    def _unreachable(self, code: grpc.StatusCode, details: str) -> StageError:
        return unavailable(f"rate limiter at {self.address} unavailable: {code.name}: {details}")

    async def _acquire_call(self, request: pb.GrantRequest, timeout_s: float) -> pb.AcquireResponse:
        """The acquire's answer; StageError when it failed (typed by the rate
        limiter) or the stream broke."""
        start = time.perf_counter()
        try:
            resp = await self._link.call(
                request,
                timeout_s=timeout_s,
                on_timeout=lambda: unavailable(
                    f"rate limiter at {self.address} did not answer within {timeout_s:.0f}s"
                ),
            )
            if resp.failure:
                raise StageError.of(resp.failure, f"rate limiter at {self.address}: {resp.message}")
        except StageError as err:
            STAGE_RPC_ERRORS.labels("scheduler", "ratelimiter", "Acquire", err.code.name).inc()
            raise
        finally:
            self._acquire_timer.observe(time.perf_counter() - start)
        return resp.acquire

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            if not self.held:
                continue
            try:
                resp = await self.stub.Renew(
                    pb.RenewRequest(grant_ids=list(self.held), lease_ms=self.lease_ms), timeout=2
                )
                self.lost.update(resp.lost_grant_ids)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                log.warning("grant renewal failed", extra={"error": str(exc)})

    async def acquire(
        self,
        model: str,
        version: int,
        traceparents: Sequence[str] = (),
        only: Collection[str] = (),
        other_than: Collection[str] = (),
    ) -> Granted | InstancesGone | None:
        """A grant, or None when every instance stayed busy for wait_ms;
        `traceparents`: the traced requests waiting for it (the rate limiter
        emits a "grant" span under each). `only`: the grant names one of
        these instances (InstancesGone when none of them is registered any
        more); `other_than`: none of these while the model has another.

        Raises StageError (UNAVAILABLE) when no instance exists, or the rate
        limiter or its Redis cannot be reached.
        """
        request = pb.GrantRequest(
            acquire=pb.AcquireRequest(
                model=model,
                version=version,
                wait_ms=self.wait_ms,
                lease_ms=self.lease_ms,
                holder=self.holder,
            )
        )
        if traceparents:
            request.acquire.traceparents.extend(traceparents)
        if only:
            request.acquire.only_instances.extend(only)
        if other_than:
            request.acquire.other_than.extend(other_than)
        resp = await self._acquire_call(request, self.wait_ms / 1000.0 + 5.0)
        if resp.granted:
            self.held.add(resp.grant_id)
            if self._renewer is None:
                self._renewer = asyncio.create_task(self._renew_forever())
            return Granted(
                resp.grant_id,
                resp.instance.instance_id,
                resp.instance.worker_address,
                resp.holds_resources,
            )
        if resp.failure == pb.NO_INSTANCE:
            raise StageError.of(pb.NO_INSTANCE, resp.reason)
        if resp.gone_instances:
            return InstancesGone(tuple(resp.gone_instances))
        return None

    async def release_predecessors(self, timeout_s: float = 2.0) -> None:
        """End the grants an earlier process of this scheduler id still holds
        (it was killed: they would block their instances until their leases
        ran out, grant_lease_ms after its last renewal). Best effort: a rate
        limiter that does not answer leaves them to their leases."""
        request = pb.ReleaseHolderRequest(holder=self.holder)
        try:
            await self.stub.ReleaseHolder(request, timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            log.warning("predecessor's grants not released", extra={"error": str(exc)})

    async def release(self, grant_id: str, failed: bool = False, reason: str = "") -> None:
        """Sent without waiting for an answer: a release that fails (the
        stream broke, Redis is down) is logged by the rate limiter, and the
        grant's lease ends on its own, so nothing leaks."""
        self.held.discard(grant_id)
        self.lost.discard(grant_id)
        request = pb.GrantRequest(
            release=pb.ReleaseRequest(grant_id=grant_id, instance_failed=failed, reason=reason)
        )
        await self._link.send(request)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        await self._link.close()
        if self.stream_channel is not self.channel:
            await self.stream_channel.close()
        await self.channel.close()


class WorkerCallError(Exception):
    """An Execute that did not succeed: the worker's answer (its reason) or a
    broken stream (its status code, and the reason that code stands for)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, reason: pb.FailureReason | None = None
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason_of(code) if reason is None else reason

    @classmethod
    def answered(cls, resp: pb.ExecuteResponse) -> WorkerCallError:
        """The worker's failed answer."""
        return cls(status_code(resp.failure), resp.message, resp.failure)


class WorkerStream:
    """One long-lived ExecuteStream to a worker (stageserve/transport.py);
    batches matched to answers by id."""

    def __init__(self, address: str, stage_tls: StageTls | None, client: str = "h2") -> None:
        """`client`: SchedulerSettings.stream_client ("h2" or "grpcio")."""
        self.address = address
        self.channel = own_stream_channel(address, stage_tls, client) or stage_channel(
            address, stage_tls
        )
        self._link: StreamLink[pb.ExecuteRequest, pb.ExecuteResponse] = StreamLink(
            name=f"worker {address}",
            open_call=pb_grpc.WorkerStub(self.channel).ExecuteStream,
            pack=lambda requests: pb.ExecuteRequests(requests=requests),
            unpack=lambda message: message.responses,
            on_break=lambda code, reason: WorkerCallError(code, reason),
        )
        self._timer = STAGE_RPC_DURATION.labels("scheduler", "worker", "Execute")

    @property
    def broken(self) -> bool:
        """The stream broke (the worker died or went away) and nothing has
        come from the worker since. Grants on a broken worker are not reused."""
        return self._link.broken

    async def execute(
        self,
        request: pb.ExecuteRequest,
        timeout_s: float,
        on_part: Callable[[pb.ExecuteResponse], None] | None = None,
    ) -> pb.ExecuteResponse:
        start = time.perf_counter()
        try:
            resp = await self._link.call(
                request,
                on_more=on_part,
                timeout_s=timeout_s,
                on_timeout=lambda: WorkerCallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s}s"
                ),
            )
            if resp.failure:
                raise WorkerCallError.answered(resp)
        except WorkerCallError as exc:
            STAGE_RPC_ERRORS.labels("scheduler", "worker", "Execute", exc.code.name).inc()
            raise
        finally:
            self._timer.observe(time.perf_counter() - start)
        return resp

    async def close(self) -> None:
        await self._link.close()
        await self.channel.close()


class WorkerClients:
    """One stream per worker address, opened on first use."""

    def __init__(
        self, execute_timeout_s: float, stage_tls: StageTls | None, client: str = "h2"
    ) -> None:
        """`execute_timeout_s`: SchedulerSettings.execute_timeout_s; `stage_tls`:
        Settings.stage_tls, every worker stream's mutual TLS (None: plaintext);
        `client`: SchedulerSettings.stream_client."""
        self._streams: dict[str, WorkerStream] = {}
        self.client = client
        self.execute_timeout_s = execute_timeout_s
        self.stage_tls = stage_tls

    def is_broken(self, address: str) -> bool:
        stream = self._streams.get(address)
        return stream is not None and stream.broken

    async def execute(
        self,
        address: str,
        request: pb.ExecuteRequest,
        on_part: Callable[[pb.ExecuteResponse], None] | None = None,
    ) -> pb.ExecuteResponse:
        """The batch's answer; `on_part` gets a decoupled model's responses as sent."""
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = WorkerStream(address, self.stage_tls, self.client)
        return await stream.execute(request, self.execute_timeout_s, on_part)

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.close()
