"""The worker process: load the published models, register, execute batches.

The worker follows the model set the gateway publishes in Redis (pub/sub plus
a periodic re-check), hosts the instances its device should run, and keeps
the rate limiter's registry in step: register after loading, re-register
after unloading, heartbeat to keep its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import cast

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.worker import cuda_sync
from services.worker.backends import BackendError, InvalidInputError, StillSending
from services.worker.blas_threads import limit_blas_threads
from services.worker.compute_spans import record_compute_spans
from services.worker.hosting import host_version
from services.worker.instances import HostedInstance, placements
from services.worker.load_order import load_order
from services.worker.publishers import PublisherWatch
from services.worker.python_backend.bls import install as bls_install
from services.worker.stale import stale_instances
from services.worker.warmup import WarmupError
from stageserve import heap_freeze, tensor_shm, trace_spans
from stageserve import redis_keys as keys
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.gpus import gpu_count
from stageserve.model_state import LoadedModel, ModelStateStore
from stageserve.net import add_stage_port, stage_channel, stage_server
from stageserve.redis_connect import connect
from stageserve.settings import Settings, WorkerSettings
from stageserve.transport import serve_stream

log = logging.getLogger(__name__)


def _requests_of(message: pb.ExecuteRequests):
    return message.requests


def _pack_responses(responses: list[pb.ExecuteResponse]) -> pb.ExecuteResponses:
    return pb.ExecuteResponses(responses=responses)


def _worker_error(request: pb.ExecuteRequest, exc: Exception) -> pb.ExecuteResponse:
    """A batch whose handling raised (a bug): answered, never left to hang."""
    return pb.ExecuteResponse(
        id=request.id,
        failure=pb.BACKEND_FAILED,
        message=f"worker error: {type(exc).__name__}",
    )


def _not_hosted(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
    return pb.ExecuteResponse(
        id=request.id,
        failure=pb.MODEL_NOT_FOUND,
        message=f"instance {request.instance_id} is not hosted here",
    )


def _failed(inst: HostedInstance, request: pb.ExecuteRequest, exc: Exception) -> pb.ExecuteResponse:
    """A batch that raised: INVALID_ARGUMENT when refused before running,
    TENSOR_REGION_NOT_LOCAL when an input refers to a shared-memory region
    this worker cannot map (the gateway resends it inline), INTERNAL
    otherwise (a BackendError, or a bug: answer, never hang it)."""
    if isinstance(exc, tensor_shm.RegionNotLocal):
        return pb.ExecuteResponse(
            id=request.id, failure=pb.TENSOR_REGION_NOT_LOCAL, message=str(exc)
        )
    if isinstance(exc, InvalidInputError):
        return pb.ExecuteResponse(
            id=request.id,
            failure=pb.INVALID_INPUT,
            message=f"model '{inst.model}': {exc}",
        )
    if not isinstance(exc, BackendError):
        log.exception("execution failed", extra={"instance": inst.instance_id})
    return pb.ExecuteResponse(
        id=request.id,
        failure=pb.BACKEND_FAILED,
        message=f"model '{inst.model}' execution failed: {exc}",
    )


def _answered(
    inst: HostedInstance, request: pb.ExecuteRequest, resp: pb.ExecuteResponse
) -> pb.ExecuteResponse:
    """A batch that ran: its id, and its compute times into the instance's metrics."""
    resp.id = request.id
    c_in, c_infer, c_out = inst.compute_timers
    c_in.observe(resp.compute_input_ns / 1e9)
    c_infer.observe(resp.compute_infer_ns / 1e9)
    c_out.observe(resp.compute_output_ns / 1e9)
    if request.traceparents:  # some request of the batch is traced
        record_compute_spans(request, resp, time.monotonic_ns())
    return resp


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        state: ModelStateStore,
        ratelimiter: pb_grpc.RateLimiterStub,
        gpu: int | None,
        settings: WorkerSettings,
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.address = ""
        self.state = state
        self.ratelimiter = ratelimiter
        self.gpu = gpu
        self.instances: dict[str, HostedInstance] = {}
        # (model, version, generation) whose load failed here: not tried again
        # until another generation of the model is published.
        self.failed: set[tuple[str, int, int]] = set()
        self._reconcile_lock = asyncio.Lock()
        self.publishers = PublisherWatch(settings.publisher_grace_s)
        self._executing = 0  # batches executing on this worker, all instances

    # ---------------------------------------------------------------- execute

    async def _run(
        self,
        request: pb.ExecuteRequest,
        emit: Callable[[pb.ExecuteResponse], None] | None = None,
    ) -> pb.ExecuteResponse:
        """Execute one batch on its instance's thread; errors become the
        answer's code."""
        inst = self.instances.get(request.instance_id)
        if inst is None:
            return _not_hosted(request)
        inst.in_flight += 1  # until the batch's last message: an unload waits for it
        self._executing += 1
        executing = True
        try:
            loop = asyncio.get_running_loop()
            ran = await loop.run_in_executor(inst.executor, inst.execute, request, emit)
            if isinstance(ran, StillSending):
                # A decoupled execute returned: its instance thread is
                # free, the model's senders still answer this batch.
                self._executing -= 1
                executing = False
                resp = await asyncio.wrap_future(ran.last)
            else:
                resp = ran
        except Exception as exc:
            return _failed(inst, request, exc)
        finally:
            inst.in_flight -= 1
            if executing:
                self._executing -= 1
        return _answered(inst, request, resp)

    def _run_inline(self, request: pb.ExecuteRequest) -> pb.ExecuteResponse | None:
        """The batch's answer, computed now on the event loop when its
        instance's inline policy says so (inline_policy.py); None: run it on
        the instance's thread (`_run`). No task is made for an inline batch:
        at concurrency 1 that is one task and one event-loop turn less per
        request. `python -m bench --models simple -c 1 64`, three interleaved
        rounds against a task per batch: worker CPU per request at
        c=1 350-353 -> 322-334 us, at c=64 80-84 -> 74-81 us."""
        inst = self.instances.get(request.instance_id)
        if inst is None or not inst.inline.runs_inline(self._executing):
            return None
        inst.in_flight += 1
        self._executing += 1
        try:
            # Never StillSending: Python models are thread-bound, never inline.
            resp = cast("pb.ExecuteResponse", inst.execute(request))
        except Exception as exc:
            return _failed(inst, request, exc)
        finally:
            inst.in_flight -= 1
            self._executing -= 1
        return _answered(inst, request, resp)

    async def ExecuteStream(self, request_iterator, context):
        """Batches from one scheduler run concurrently (each on its instance's
        thread, or inline when short) and are answered as they finish, packed
        per write."""
        loop = asyncio.get_running_loop()
        # Batches of this stream handed to a task that has not started yet:
        # they count as executing for the inline policy (nothing runs on the
        # loop while another batch waits to reach its thread), as they did
        # when every batch had its task. Per stream: a task cancelled before
        # it started ends with its stream.
        starting = 0

        def handle(request: pb.ExecuteRequest, respond) -> Awaitable[None] | None:
            nonlocal starting
            if log.isEnabledFor(logging.DEBUG):  # Triton's verbose level 1
                log.debug("executing batch", extra={"instance": request.instance_id})
            answer = None if starting else self._run_inline(request)
            if answer is not None:
                respond(answer)
                return None

            def emit(part: pb.ExecuteResponse) -> None:
                """A decoupled model's response, sent from the instance's thread."""
                part.id = request.id
                loop.call_soon_threadsafe(respond, part)

            async def run() -> None:
                nonlocal starting
                starting -= 1
                respond(await self._run(request, emit))

            starting += 1
            return run()

        async for message in serve_stream(
            request_iterator,
            unpack=_requests_of,
            handle=handle,
            pack=_pack_responses,
            concurrent=True,
            on_error=_worker_error,
        ):
            yield message

    # ------------------------------------------------------------- lifecycle

    async def reconcile(self) -> None:
        """Make the hosted instances match the published model set."""
        async with self._reconcile_lock:
            waiting = self.publishers.waiting_for()
            complete = self.publishers.observe(await self.state.publishers(), time.monotonic())
            wanted = await self.state.loaded()
            self.failed = {
                f for f in self.failed if f[0] in wanted and wanted[f[0]].generation == f[2]
            }
            # New generations load (and register) before old ones unload, so a
            # reload under traffic never leaves a model without instances.
            # Each model registers once loaded (load_order.py says why). After
            # a failed register the loads go on and one register ends them:
            # a rate limiter that hangs costs one call's timeout, not one per model.
            changed = register_failed = False
            for model in load_order(wanted.values(), "torch" in sys.modules):
                if await self._load(model):
                    changed = True
                    if not register_failed:
                        try:
                            await self.register()
                        except grpc.aio.AioRpcError as exc:
                            log.warning("register failed", extra={"code": exc.code().name})
                            register_failed = True
            if register_failed:
                await self.register()
            if complete:
                changed |= await self._unload_stale(wanted)
            elif self.publishers.waiting_for() != waiting:
                # Redis lost the model set and not every gateway republished
                # yet: what is missing may still be served, keep it.
                log.warning(
                    "model set incomplete; unloading nothing",
                    extra={"waiting_for": self.publishers.waiting_for()},
                )
            if changed:  # the loaded models' objects out of the collector's walks
                heap_freeze.settle("model set changed")

    async def _unload_stale(self, wanted: dict[str, LoadedModel]) -> bool:
        stale = stale_instances(self.instances.values(), wanted)
        if not stale:
            return False
        for inst in stale:
            del self.instances[inst.instance_id]
        await self.register()  # stop new grants before draining
        for inst in stale:
            while inst.in_flight:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(inst.close)
            log.info("instance unloaded", extra={"instance": inst.instance_id})
        return True

    async def _load(self, model: LoadedModel) -> bool:
        """Host the versions of `model` this worker does not host yet; True if any loaded.

        A version that cannot load (its backend fails to build or warm up, a
        dependency is missing) is reported once as that version's load error,
        which the gateway answers with and shows in the repository index, and
        is not tried again until a new generation of the model is published
        (its files or config changed, or a load request)."""
        if model.spec.steps:  # an ensemble runs in the scheduler, not on instances
            return False
        hosted = {(i.model, i.version, i.generation) for i in self.instances.values()}
        groups = [(g, placements(g, self.gpu)) for g in model.spec.instance_groups]
        changed = False
        for version in model.versions:
            key = (model.name, version, model.generation)
            if key in hosted or key in self.failed:
                continue
            try:
                loaded = await host_version(
                    self.worker_id,
                    model,
                    version,
                    groups,
                    self.state.redis,
                    bool(self.settings.python_instance_process),
                )
            except (BackendError, WarmupError) as exc:
                await self._load_failed(model, version, str(exc))
                continue
            except Exception as exc:  # a bug: the version fails, the other models load
                log.exception("model load raised", extra={"model": model.name})
                reason = f"worker error while loading: {type(exc).__name__} (see the worker log)"
                await self._load_failed(model, version, reason)
                continue
            for inst in loaded:
                self.instances[inst.instance_id] = inst
            log.info(
                "model loaded",
                extra={"model": model.name, "version": version, "instances": len(loaded)},
            )
            changed = True
        return changed

    async def _load_failed(self, model: LoadedModel, version: int, reason: str) -> None:
        """One log line and the reported reason; tried again only if reporting failed."""
        log.error(
            "model load failed",
            extra={
                "model": model.name,
                "version": version,
                "generation": model.generation,
                "error": reason,
            },
        )
        await self.state.report_load_error(model.name, version, self.worker_id, reason)
        self.failed.add((model.name, version, model.generation))

    async def register(self) -> None:
        infos = [
            pb.InstanceInfo(
                instance_id=i.instance_id,
                model=i.model,
                version=i.version,
                kind=i.placement.kind,
                device_id=i.placement.device_id,
                priority=i.rate_limit[0],
                resources=[
                    pb.ResourceNeed(name=n, count=c, **{"global": g}) for n, c, g in i.rate_limit[1]
                ],
            )
            for i in self.instances.values()
        ]
        await self.ratelimiter.Register(
            pb.RegisterRequest(
                worker_id=self.worker_id,
                worker_address=self.address,
                instances=infos,
                lease_ms=self.settings.lease_ms,
            ),
            timeout=10,
        )

    async def heartbeat_forever(self) -> None:
        while True:
            try:
                resp = await self.ratelimiter.Heartbeat(
                    pb.HeartbeatRequest(worker_id=self.worker_id, lease_ms=self.settings.lease_ms),
                    timeout=2,
                )
                if not resp.known:
                    log.warning("rate limiter forgot this worker; registering again")
                    await self.register()
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat failed", extra={"code": exc.code().name})
            await asyncio.sleep(self.settings.heartbeat_s)

    async def follow_models_forever(self, redis: aioredis.Redis) -> None:
        pubsub = redis.pubsub()
        await pubsub.subscribe(keys.MODEL_EVENTS)
        while True:
            try:
                await self.reconcile()
            except grpc.aio.AioRpcError as exc:
                log.warning("register failed", extra={"code": exc.code().name})
            except Exception:
                log.exception("reconcile failed")
            # Wake on a model event or after reconcile_s, whichever first.
            reconcile_s = self.settings.reconcile_s
            try:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=reconcile_s)
            except Exception:
                await asyncio.sleep(reconcile_s)


def detect_gpu(device: str) -> int | None:
    """'cpu' -> None, 'cuda:N' -> N, 'auto' -> 0 when the machine has a GPU.

    Not from ONNX Runtime's provider list: onnxruntime-gpu lists
    CUDAExecutionProvider on a host without any GPU (measured, 1.24.4)."""
    if device == "cpu":
        return None
    if device.startswith("cuda"):
        return int(device.split(":", 1)[1]) if ":" in device else 0
    return 0 if gpu_count() > 0 else None


async def _reclaim_forever(shm: tensor_shm.TensorShm) -> None:
    """Free this worker's output slots that dead gateways or lost answers
    hold, every SHM_RECLAIM_EVERY_S, not only when the region fills."""
    while True:
        await asyncio.sleep(tensor_shm.SHM_RECLAIM_EVERY_S)
        freed = shm.reclaim_lost()
        if freed:
            log.info("tensor slots reclaimed", extra={"slots": freed})


async def serve(
    listen: str,
    redis_url: str,
    ratelimiter_address: str,
    worker_id: str | None,
    settings: Settings,
    advertise: str | None = None,
    scheduler_address: str | None = None,
) -> None:
    """`settings.worker` holds the device and the worker's figures; a Python
    model's BLS calls reach the scheduler as the gateway's settings say."""
    from stageserve.service_runtime import run_server

    limit_blas_threads(os.environ, settings.worker.blas_threads)
    device = detect_gpu(settings.worker.device)
    # Before any model loads: the flag belongs to the context they create.
    log.info("CUDA sync mode: %s", cuda_sync.apply(settings.worker.cuda_sync, device))
    redis = connect(redis_url, settings.redis_client)
    await redis.ping()
    spans = trace_spans.configure("worker", redis)  # traced requests' spans
    worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
    channel = stage_channel(ratelimiter_address, settings.stage_tls)
    service = WorkerService(
        worker_id,
        ModelStateStore(redis),
        pb_grpc.RateLimiterStub(channel),
        device,
        settings.worker,
    )
    server = stage_server(settings.worker.grpc_server)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    # Python models' BLS requests go to the scheduler (python_backend/bls.py).
    bls = bls_install(scheduler_address, service.state, settings) if scheduler_address else None

    # The address peers dial must be known before registering: bind first.
    host = listen.rsplit(":", 1)[0]
    port = add_stage_port(server, listen, settings.stage_tls)
    if port == 0:
        raise RuntimeError(f"worker: cannot listen on {listen}")
    public_host = host if host not in ("0.0.0.0", "[::]") else socket.gethostname()
    service.address = advertise or f"{public_host}:{port}"
    shm = tensor_shm.install(settings.stack, redis_url, "worker")
    if shm is not None:  # gateways of this host send this worker references
        await redis.hset(keys.TENSOR_SHM_HOSTS, worker_id, shm.host)
    tasks = [
        asyncio.create_task(service.follow_models_forever(redis)),
        asyncio.create_task(service.heartbeat_forever()),
    ]
    if shm is not None:
        tasks.append(asyncio.create_task(_reclaim_forever(shm)))
    try:
        await run_server(
            server, f"{host}:{port}", "worker", stage_tls=settings.stage_tls, bound=True
        )
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await service.ratelimiter.Deregister(
                pb.DeregisterRequest(worker_id=worker_id), timeout=2
            )
        # Off the loop: a Python model's execute may be waiting on a BLS call
        # that needs the loop, and its finalize queues behind that execute.
        for inst in list(service.instances.values()):
            await asyncio.to_thread(inst.close)
        if bls is not None:
            await bls.close()
        await channel.close()
        await asyncio.to_thread(spans.close)
        if shm is not None:
            with contextlib.suppress(RedisError):
                await redis.hdel(keys.TENSOR_SHM_HOSTS, worker_id)
        await redis.aclose()
        tensor_shm.uninstall()
