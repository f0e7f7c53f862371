"""Which requests the gateway sends through its shared-memory tensor region.

Only a plain model's request: a sequence model's state rows, an ensemble's
intermediate tensors and a decoupled model's responses are built and read
by the scheduler or stream back in parts, so they keep raw bytes. And only
a model whose every instance runs on a worker of this gateway's host: each
worker with a region announces its host id in Redis (TENSOR_SHM_HOSTS), and
`LocalModels` compares them with the rate limiter's instance list, again
every `period_s`. A worker on another host gets raw bytes, as without the
feature; one that joins is seen within `period_s`. Until then a batch of its
with references is refused TENSOR_REGION_NOT_LOCAL and the gateway resends
the request with its bytes inline (`inline`), and stops using shared memory
for that model until the next refresh says otherwise.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway.cuda_inplace import in_place_devices, model_eligible
from stageserve import task_stop
from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.redis_keys import TENSOR_SHM_HOSTS
from stageserve.tensor_shm import TensorShm, materialize
from stageserve.validation import PlaceRaw

log = logging.getLogger(__name__)


def shm_eligible(spec: ModelSpec) -> bool:
    return spec.sequence is None and not spec.steps and not spec.decoupled


def local_models(host: str, instances: list[pb.InstanceInfo], hosts: dict[str, str]) -> set[str]:
    """Models with at least one instance, every one on a worker of `host`."""
    remote = {i.model for i in instances if hosts.get(i.worker_id) != host}
    return {i.model for i in instances} - remote


class LocalModels:
    """The models this gateway may send through shared memory, kept fresh."""

    def __init__(
        self,
        host: str,
        ratelimiter: pb_grpc.RateLimiterStub,
        redis: aioredis.Redis,
        period_s: float = 1.0,
    ) -> None:
        self.host = host
        self.ratelimiter = ratelimiter
        self.redis = redis
        self.period_s = period_s
        self.models: set[str] = set()
        # model -> the CUDA device its every instance runs on, on this host
        # (services/gateway/cuda_inplace.py)
        self.cuda_devices: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def __contains__(self, model: str) -> bool:
        return model in self.models

    async def refresh(self) -> None:
        resp = await self.ratelimiter.ListInstances(pb.ListInstancesRequest(), timeout=5)
        raw = await self.redis.hgetall(TENSOR_SHM_HOSTS)
        hosts = {_text(k): _text(v) for k, v in raw.items()}
        self.models = local_models(self.host, list(resp.instances), hosts)
        self.cuda_devices = in_place_devices(self.host, resp.instances, hosts)

    async def run_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except (grpc.aio.AioRpcError, RedisError) as exc:
                # unknown: send nothing through shared memory until it is known
                self.models = set()
                self.cuda_devices = {}
                log.debug("tensor hosts unknown", extra={"error": type(exc).__name__})
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run_forever())

    async def close(self) -> None:
        if self._task is not None:
            await task_stop.stop(self._task)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TensorTransport:
    """The gateway's side: its region and the models it may use it for."""

    def __init__(self, shm: TensorShm, local: LocalModels) -> None:
        self.shm = shm
        self.local = local

    def eligible(self, spec: ModelSpec) -> bool:
        return shm_eligible(spec) and spec.name in self.local

    def cuda_device(self, spec: ModelSpec) -> int | None:
        """The CUDA device whose regions this model's worker reads and writes
        in place (None: the gateway copies): cuda_inplace.py's rules."""
        if not model_eligible(spec) or spec.name not in self.local:
            return None
        return self.local.cuda_devices.get(spec.name)

    def stage(self, spec: ModelSpec, inputs: list[pb.Tensor]) -> list[pb.TensorPart]:
        """For an eligible model, move the large inputs into the region (in
        place: they then hold references); the extents to `release` when the
        request ends (none otherwise)."""
        return self.shm.stage_inputs(inputs) if self.eligible(spec) else []

    def placer(self, spec: ModelSpec, staged: list[pb.TensorPart]) -> PlaceRaw | None:
        """For an eligible model, validation's hook that puts each large input
        in the region as it is checked (validation.PlaceRaw); each extent goes
        into `staged`, to `release` when the request ends. None otherwise."""
        if not self.eligible(spec):
            return None
        shm = self.shm

        def place(raw: bytes | memoryview, datatype: str) -> pb.TensorPart | None:
            part = shm.stage_bytes(raw, datatype)
            if part is not None:
                staged.append(part)
            return part

        return place

    def address(self, spec: ModelSpec, request: pb.ScheduleRequest) -> None:
        """For an eligible model, ask the worker for large outputs through
        shared memory (it writes them for this gateway's pid)."""
        if self.eligible(spec):
            request.shm_host = self.shm.host
            request.shm_pid = self.shm.pid

    def inline(self, spec: ModelSpec, request: pb.ScheduleRequest) -> None:
        """A request a worker refused (TENSOR_REGION_NOT_LOCAL) made ready to
        resend: its inputs' bytes copied back from the region (the slots stay
        held until `release`), no output through shared memory, and the model
        off shared memory until the next refresh."""
        for t in request.inputs:
            materialize(t)
        request.ClearField("shm_host")
        request.ClearField("shm_pid")
        self.local.models.discard(spec.name)
        self.local.cuda_devices.pop(spec.name, None)

    def release(self, staged: list[pb.TensorPart]) -> None:
        self.shm.release(staged)


def tensor_transport(
    shm: TensorShm | None, ratelimiter: pb_grpc.RateLimiterStub, redis: aioredis.Redis
) -> TensorTransport | None:
    """Started when the stack's tensor_shm gave this gateway a region."""
    if shm is None:
        return None
    local = LocalModels(shm.host, ratelimiter, redis)
    local.start()
    return TensorTransport(shm, local)
