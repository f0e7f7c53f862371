"""The scheduler's clients of the rate limiter and of the workers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from stageserve.errors import StageError, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.net import insecure_channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Granted:
    grant_id: str
    instance_id: str
    worker_address: str


class RateLimiterClient:
    def __init__(self, address: str, wait_ms: int = 500, lease_ms: int = 60_000) -> None:
        self.address = address
        self.channel = insecure_channel(address)
        self.stub = pb_grpc.RateLimiterStub(self.channel)
        self.wait_ms = wait_ms
        self.lease_ms = lease_ms

    async def acquire(self, model: str, version: int) -> Granted | None:
        """A grant, or None when every instance stayed busy for wait_ms.

        Raises StageError(UNAVAILABLE) when no instance exists or the rate
        limiter cannot be reached.
        """
        try:
            resp = await self.stub.Acquire(
                pb.AcquireRequest(
                    model=model, version=version, wait_ms=self.wait_ms, lease_ms=self.lease_ms
                ),
                timeout=self.wait_ms / 1000.0 + 5.0,
            )
        except grpc.aio.AioRpcError as exc:
            raise unavailable(
                f"rate limiter at {self.address} unavailable: {exc.code().name}: {exc.details()}"
            ) from exc
        if resp.granted:
            return Granted(resp.grant_id, resp.instance.instance_id, resp.instance.worker_address)
        if "no instance" in resp.reason:
            raise StageError(grpc.StatusCode.UNAVAILABLE, resp.reason)
        return None

    async def release(self, grant_id: str, failed: bool = False, reason: str = "") -> None:
        try:
            await self.stub.Release(
                pb.ReleaseRequest(grant_id=grant_id, instance_failed=failed, reason=reason),
                timeout=5.0,
            )
        except grpc.aio.AioRpcError as exc:
            # The grant's lease expires on its own; nothing leaks.
            log.warning("release failed", extra={"grant_id": grant_id, "code": exc.code().name})

    async def close(self) -> None:
        await self.channel.close()


class WorkerClients:
    """One channel per worker address, created on first use."""

    def __init__(self, execute_timeout_s: float = 300.0) -> None:
        self._stubs: dict[str, pb_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.execute_timeout_s = execute_timeout_s

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = insecure_channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = pb_grpc.WorkerStub(channel)
        return stub

    async def execute(self, address: str, request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        return await self._stub(address).Execute(request, timeout=self.execute_timeout_s)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
