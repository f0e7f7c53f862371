"""grpc.aio adapter of the scheduler: one bidirectional stream per gateway."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket

import grpc

from services.scheduler.clients import RateLimiterClient, WorkerClients
from services.scheduler.ensemble import check_step_input, run_ensemble
from services.scheduler.execute_request import error_response
from services.scheduler.model_queue import ModelQueue
from services.scheduler.sequence_queue import make_sequence_queue
from services.scheduler.shard_member import ShardMember
from services.scheduler.step_cache import StepCache
from stageserve import trace_spans
from stageserve.errors import StageError, stage_fault, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.model_state import LoadedModel, ModelStateStore
from stageserve.redis_connect import connect
from stageserve.response_cache import open_cache
from stageserve.scheduler_link import SchedulerLink
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.script_lane import ScriptLane
from stageserve.settings import SchedulerSettings, Settings
from stageserve.shard_map import ShardView
from stageserve.transport import serve_stream

log = logging.getLogger(__name__)


def _requests_of(batch: pb.ScheduleBatch):
    return batch.requests


def _pack_responses(responses: list[pb.ScheduleResponse]) -> pb.ScheduleResponses:
    return pb.ScheduleResponses(responses=responses)


def _scheduler_error(msg: pb.ScheduleRequest, exc: Exception) -> pb.ScheduleResponse:
    """A request whose submission raised: answered, and the stream goes on."""
    return error_response(msg.id, stage_fault(f"scheduler error: {type(exc).__name__}"))


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        state: ModelStateStore,
        ratelimiter: RateLimiterClient,
        workers: WorkerClients,
        settings: SchedulerSettings,
    ) -> None:
        self.settings = settings
        self.state = state
        self.ratelimiter = ratelimiter
        self.workers = workers
        self.models: dict[str, LoadedModel] = {}
        self.queues: dict[tuple[str, int], ModelQueue] = {}
        self._tasks: set[asyncio.Task] = set()
        # Sharding by model (services/scheduler/shard_member.py): None serves
        # every model (a scheduler started without a Redis membership).
        self.shard: ShardMember | None = None
        # Ensemble steps whose composing model another scheduler owns go there.
        self.peers: SchedulerRouter | None = None
        # --cache-config's response cache for ensemble steps; None: none kept
        self.step_cache: StepCache | None = None

    @functools.cached_property
    def script_lane(self) -> ScriptLane | None:
        """The pipelined connection the sequence models' scripts share."""
        return ScriptLane.of(self.state.redis)

    async def _not_ours(self, msg: pb.ScheduleRequest, respond) -> bool:
        """Refuse (NOT_OWNER, which the gateway resends to the owner) a request
        for a model this scheduler neither owns nor may take now."""
        if self.shard is None or self.shard.owns(msg.model) or await self.shard.holds(msg.model):
            return False
        err = StageError.of(
            pb.NOT_OWNER, f"scheduler {self.shard.id} does not own model '{msg.model}'"
        )
        respond(error_response(msg.id, err))
        return True

    async def drain(self, model: str, limit_s: float = 2.0) -> None:
        """Return once no request of `model` is queued or executing here, or
        after `limit_s` (a batch that long still finishes here; new requests
        go to the model's next owner meanwhile). A sequence batch is waited
        for to its end (at most the execute timeout): its commit must land
        before the model's term ends, or it keeps nothing and fails
        (sequence_queue.py), and the next owner would not wait for it."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + limit_s
        last = start + max(limit_s, self.settings.execute_timeout_s)
        while loop.time() < last:
            now = loop.time()
            busy = [
                q
                for (m, _), q in self.queues.items()
                if m == model
                and (
                    (q.sequences is not None and q.executing)
                    or (now < deadline and (q.pending or q.executing))
                )
            ]
            if not busy:
                break
            await asyncio.sleep(0.005)
        for key in [k for k in self.queues if k[0] == model]:
            queue = self.queues[key]
            if not (queue.pending or queue.executing):
                queue.close()
                del self.queues[key]

    def lost(self, model: str) -> None:
        """The map gave `model` to another scheduler while this one's lease
        had lapsed: its queued requests go back to the gateways (NOT_OWNER,
        resent to the new owner), and its queues close once their running
        batches end."""
        for (name, _), queue in list(self.queues.items()):
            if name == model:
                queue.refuse_pending()
        self._spawn(self.drain(model))

    async def _model(self, name: str, generation: int) -> LoadedModel | None:
        cached = self.models.get(name)
        if cached is not None and cached.generation == generation:
            return cached
        loaded = await self.state.get(name)
        if loaded is None:
            self.models.pop(name, None)
            return None
        self.models[name] = loaded
        for key, queue in list(self.queues.items()):
            if key[0] != name:
                continue
            if queue.fits(loaded.spec):
                queue.reconfigure(loaded.spec)
            else:  # sequence batching turned on or off: a queue of the other kind
                queue.close()
                del self.queues[key]
        return loaded

    def _queue(self, loaded: LoadedModel, version: int) -> ModelQueue:
        key = (loaded.name, version)
        queue = self.queues.get(key)
        if queue is None:
            if loaded.spec.sequence is not None:
                queue = make_sequence_queue(
                    loaded.name,
                    version,
                    loaded.spec,
                    self.ratelimiter,
                    self.workers,
                    self.state.redis,
                    loaded.path,
                    self.settings,
                    self.script_lane,
                )
            else:
                queue = ModelQueue(
                    loaded.name,
                    version,
                    loaded.spec,
                    self.ratelimiter,
                    self.workers,
                    self.settings,
                )
            queue.fence = self.shard  # a batch runs only under a fresh shard lease
            if queue.sequences is not None and self.shard is not None:
                queue.sequences.term = functools.partial(self.shard.term, loaded.name)
            self.queues[key] = queue
        return queue

    async def _submit(
        self, msg: pb.ScheduleRequest, respond, woken: set[ModelQueue] | None = None
    ) -> None:
        """`woken`: the queues this message submitted to without waking them
        (ModelQueue.wake() once the message's requests are all in)."""
        cached = self.models.get(msg.model)
        if cached is None or cached.generation != msg.config_generation:
            cached = await self._model(msg.model, msg.config_generation)
        # A draining version still takes the requests the gateway admitted
        # before the reload that removed it (LoadedModel.draining).
        if cached is None or msg.version not in cached.served_versions:
            err = unavailable(f"model '{msg.model}' version {msg.version} is not loaded")
            respond(error_response(msg.id, err))
            return
        shard = self.shard  # the owned-set test inline: it runs per request
        unowned = shard is not None and msg.model not in shard.owned
        if unowned and await self._not_ours(msg, respond):
            return
        if cached.spec.steps:
            self._spawn(self._run_ensemble(msg, cached, respond))
            return
        queue = self._queue(cached, msg.version)
        if woken is None:
            queue.submit(msg, respond)
            return
        queue.submit(msg, respond, wake=False)
        woken.add(queue)

    async def _run_ensemble(self, msg: pb.ScheduleRequest, loaded: LoadedModel, respond) -> None:
        try:
            respond(await run_ensemble(msg, loaded.spec, self._submit_step))
        except Exception as exc:  # a bug must answer the request, not hang it
            log.exception("ensemble failed", extra={"model": msg.model})
            respond(error_response(msg.id, stage_fault(f"ensemble error: {exc}")))

    async def _submit_step(
        self, request: pb.ScheduleRequest, stat: pb.StepStat
    ) -> pb.ScheduleResponse:
        """One ensemble step: an internal request to a composing model,
        answered from the response cache where the model enables it."""
        loaded = self.models.get(request.model) or await self._model(request.model, -1)
        if loaded is None:
            raise unavailable(f"composing model '{request.model}' is not loaded")
        if request.version <= 0:
            request.version = max(loaded.versions)
        if request.version not in loaded.versions:
            raise unavailable(
                f"composing model '{request.model}' version {request.version} is not loaded"
            )
        request.config_generation = loaded.generation
        if not loaded.spec.batching:
            request.batch_size = 0
        if loaded.spec.steps:
            return await run_ensemble(request, loaded.spec, self._submit_step)
        if loaded.spec.decoupled:  # its many responses have no place in the dataflow yet
            raise StageError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"ensemble step '{request.model}' is a decoupled model, which StageServe "
                f"does not support inside ensembles",
            )
        check_step_input(loaded.spec, request)
        if self.step_cache is None:
            return await self._execute_step(request, loaded)
        return await self.step_cache.run(
            request, loaded.spec, stat, lambda: self._execute_step(request, loaded)
        )

    async def _execute_step(
        self, request: pb.ScheduleRequest, loaded: LoadedModel
    ) -> pb.ScheduleResponse:
        shard, peers = self.shard, self.peers
        if shard is not None and peers is not None and not await shard.holds(request.model):
            return await peers.schedule(request)  # its owner runs it
        answered: asyncio.Future[pb.ScheduleResponse] = asyncio.get_running_loop().create_future()

        def respond(resp: pb.ScheduleResponse) -> None:
            if not answered.done():
                answered.set_result(resp)

        self._queue(loaded, request.version).submit(request, respond)
        return await answered

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def Schedule(self, request_iterator, context: grpc.aio.ServicerContext):
        """One gateway's (or worker's BLS) stream: requests are submitted in
        arrival order; answers go back as they come, packed per write. The
        queues a message reached are woken once, after its last request, so
        an idle queue forms one batch of them all (ModelQueue.wake)."""
        woken: set[ModelQueue] = set()

        def wake_all() -> None:
            for queue in woken:
                queue.wake()
            woken.clear()

        async for message in serve_stream(
            request_iterator,
            unpack=_requests_of,
            handle=lambda msg, respond: self._submit(msg, respond, woken),
            pack=_pack_responses,
            on_error=_scheduler_error,
            on_message_end=wake_all,
        ):
            yield message

    async def QueueStats(self, request: pb.QueueStatsRequest, context) -> pb.QueueStatsResponse:
        return pb.QueueStatsResponse(
            models=[
                pb.ModelQueueStats(
                    model=m, version=v, pending=q.pending, executing_batches=q.executing
                )
                for (m, v), q in sorted(self.queues.items())
            ]
        )


async def _join_shards(
    service: SchedulerService, scheduler_id: str, address: str, settings: Settings
) -> None:
    """Register in the shard map and take this scheduler's models; ensemble
    steps of models other schedulers own go to them through `service.peers`."""
    redis = service.state.redis
    sched = settings.scheduler
    shard = service.shard = ShardMember(
        redis,
        scheduler_id,
        address,
        service.drain,
        lease_ms=sched.shard_lease_ms,
        heartbeat_s=sched.shard_heartbeat_s,
        on_lost=service.lost,
    )
    view = ShardView(redis)
    service.peers = SchedulerRouter(
        view,
        None,
        lambda peer: SchedulerLink(
            peer,
            settings.gateway.scheduler_connect_timeout_s,
            settings.stage_tls,
            client=settings.gateway.stream_client,
        ),
    )
    await view.refresh()
    view.start()
    await shard.join()


async def serve(
    listen: str,
    redis_url: str,
    ratelimiter_address: str,
    settings: Settings,
    scheduler_id: str | None = None,
    advertise: str | None = None,
) -> None:
    """`settings.scheduler`: the adaptive batch hold, the shard lease and the
    scheduler's figures. `scheduler_id`: this scheduler's name in the shard
    map (a restarted scheduler that keeps it keeps its models; default
    host-pid); `advertise`: the address gateways and workers dial (default:
    the bound one, a wildcard host replaced by this host's name)."""
    from stageserve.net import add_stage_port, stage_server
    from stageserve.service_runtime import run_server

    redis = connect(redis_url, settings.redis_client)
    await redis.ping()
    spans = trace_spans.configure("scheduler", redis)  # traced requests' spans
    # stageserve up's schedulers keep their names across restarts; the
    # default, host-pid, is kept too by a container started again (pid 1).
    scheduler_id = scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
    ratelimiter = RateLimiterClient(
        ratelimiter_address, settings.scheduler, settings.stage_tls, scheduler_id
    )
    # An earlier process under this name may have died holding grants.
    await ratelimiter.release_predecessors()
    workers = WorkerClients(
        settings.scheduler.execute_timeout_s, settings.stage_tls, settings.scheduler.stream_client
    )
    service = SchedulerService(ModelStateStore(redis), ratelimiter, workers, settings.scheduler)
    cache = open_cache(settings.scheduler.response_cache, redis, settings.redis_client)
    service.step_cache = StepCache(cache) if cache is not None else None
    server = stage_server(settings.scheduler.grpc_server)
    pb_grpc.add_SchedulerServicer_to_server(service, server)
    # The address peers dial goes into the shard map: bind before joining.
    host = listen.rsplit(":", 1)[0]
    port = add_stage_port(server, listen, settings.stage_tls)
    if port == 0:
        raise RuntimeError(f"scheduler: cannot listen on {listen}")
    public_host = host if host not in ("0.0.0.0", "[::]") else socket.gethostname()
    address = advertise or f"{public_host}:{port}"
    if settings.scheduler.shard_lease_ms > 0:
        await _join_shards(service, scheduler_id, address, settings)
    try:
        await run_server(
            server,
            f"{host}:{port}",
            "scheduler",
            stage_tls=settings.stage_tls,
            bound=True,
            before_stop=service.shard.leave if service.shard is not None else None,
        )
    finally:
        for queue in service.queues.values():
            queue.close()
        if service.peers is not None:
            await service.peers.close()
        await ratelimiter.close()
        await workers.close()
        if service.step_cache is not None:
            await service.step_cache.close()
        await asyncio.to_thread(spans.close)
        lane = vars(service).get("script_lane")  # made by the first sequence model, if any
        if lane is not None:
            lane.close()
        await redis.aclose()
