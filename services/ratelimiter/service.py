"""grpc.aio adapter of the rate limiter: converts messages and waits for grants.

Acquire and Release arrive on one stream per scheduler (Grants, served by
stageserve/transport.py's serve_stream, each request its own task since an
acquire may wait); the rest are unary calls. Every failure is typed
(errors.py): Redis unreachable is UNAVAILABLE, never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from services.ratelimiter.errors import stage_error, typed_errors
from services.ratelimiter.registry import (
    Gone,
    Grant,
    Instance,
    NoInstances,
    RedisRegistry,
    Resource,
    predecessor_prefixes,
)
from stageserve import trace_spans
from stageserve.errors import invalid
from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.settings import RateLimiterSettings, Settings
from stageserve.telemetry import (
    RATELIMITER_GRANT_WAIT,
    RATELIMITER_GRANTS,
    RATELIMITER_INSTANCES,
    RATELIMITER_RESOURCES,
    RATELIMITER_WAIT,
)
from stageserve.transport import serve_stream

log = logging.getLogger(__name__)


def instance_to_pb(inst: Instance) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        instance_id=inst.instance_id,
        model=inst.model,
        version=inst.version,
        kind=inst.kind,
        device_id=inst.device_id,
        worker_id=inst.worker_id,
        worker_address=inst.worker_address,
        priority=inst.priority,
    )


class Wakeups:
    """One event per model version, swapped on every release so no wakeup is lost."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, int], asyncio.Event] = {}

    def event(self, model: str, version: int) -> asyncio.Event:
        return self._events.setdefault((model, version), asyncio.Event())

    def wake(self, model: str, version: int) -> None:
        ev = self._events.pop((model, version), None)
        if ev is not None:
            ev.set()

    def wake_all(self) -> None:
        events, self._events = self._events, {}
        for ev in events.values():
            ev.set()


def _requests_of(message: pb.GrantRequests):
    return message.requests


def _pack_responses(responses: list[pb.GrantResponse]) -> pb.GrantResponses:
    return pb.GrantResponses(responses=responses)


class RateLimiterService(pb_grpc.RateLimiterServicer):
    def __init__(self, registry: RedisRegistry, settings: RateLimiterSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.wakeups = Wakeups()
        # grant id -> (model, version, holds resources, monotonic end of its
        # lease): which waiters its release wakes. Only a hint (a release of
        # a grant not found here wakes every waiter), so an entry whose lease
        # ended is dropped (forget_expired): a grant whose release never
        # comes here (swept, lost on a broken stream, released through
        # another rate limiter) would otherwise stay for the process's life.
        self._grants: dict[str, tuple[str, int, bool, float]] = {}
        self._exported_resources: set[tuple[str, str]] = set()

    @typed_errors
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        instances = [
            Instance(
                i.instance_id,
                i.model,
                i.version,
                i.kind,
                i.device_id,
                request.worker_id,
                request.worker_address,
                i.priority,
                tuple(Resource(r.name, r.count, getattr(r, "global")) for r in i.resources),
            )
            for i in request.instances
        ]
        added = await self.registry.register(
            request.worker_id,
            request.worker_address,
            instances,
            request.lease_ms or self.settings.default_worker_lease_ms,
        )
        log.info(
            "worker registered",
            extra={"worker_id": request.worker_id, "instances": len(instances), "added": added},
        )
        self.wakeups.wake_all()
        return pb.RegisterResponse()

    @typed_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = await self.registry.heartbeat(
            request.worker_id, request.lease_ms or self.settings.default_worker_lease_ms
        )
        return pb.HeartbeatResponse(known=known)

    @typed_errors
    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        removed = await self.registry.deregister(request.worker_id)
        log.info("worker deregistered", extra={"worker_id": request.worker_id, "removed": removed})
        self.wakeups.wake_all()
        return pb.DeregisterResponse()

    async def Grants(self, request_iterator, context: grpc.aio.ServicerContext):
        """One scheduler's stream of acquires and releases, answered by id."""
        async for message in serve_stream(
            request_iterator,
            unpack=_requests_of,
            handle=self._grant_call,
            pack=_pack_responses,
            concurrent=True,
        ):
            yield message

    async def _grant_call(self, request: pb.GrantRequest, respond) -> None:
        """An acquire is answered (granted or not, or its typed error); a
        release is not (the scheduler sends it and goes on): its failure is
        logged here, and the grant's lease ends on its own."""
        call = request.WhichOneof("call")
        try:
            if call == "release":
                await self.release(request.release)
                return
            if call != "acquire":
                raise invalid(f"a grant call must be an acquire or a release, not {call}")
            resp = pb.GrantResponse(id=request.id, acquire=await self.acquire(request.acquire))
        except Exception as exc:
            err = stage_error(exc, call.capitalize() if call else "Grants")
            if call == "release":
                return
            resp = pb.GrantResponse(id=request.id, failure=err.reason, message=err.message)
        respond(resp)

    async def acquire(self, request: pb.AcquireRequest) -> pb.AcquireResponse:
        """A grant within request.wait_ms, or granted=False with the reason."""
        model, version = request.model, request.version
        lease_ms = request.lease_ms or self.settings.default_grant_lease_ms
        started = time.monotonic()
        deadline = started + request.wait_ms / 1000.0
        start_ns = time.monotonic_ns() if request.traceparents else 0
        resp = await self._acquire(
            model,
            version,
            lease_ms,
            deadline,
            tuple(request.only_instances),
            tuple(request.other_than),
            request.holder,
        )
        if request.traceparents:
            await record_grant_spans(request, resp, start_ns, time.monotonic_ns())
        waited = time.monotonic() - started
        RATELIMITER_WAIT.labels(model, str(version)).observe(waited)
        if resp.granted:
            RATELIMITER_GRANT_WAIT.labels(model, str(resp.instance.priority)).observe(waited)
        return resp

    async def _acquire(
        self,
        model: str,
        version: int,
        lease_ms: int,
        deadline: float,
        only: tuple[str, ...] = (),
        other_than: tuple[str, ...] = (),
        holder: str = "",
    ) -> pb.AcquireResponse:
        while True:
            event = self.wakeups.event(model, version)
            try:
                got = await self.registry.attempt(
                    model, version, lease_ms, only, other_than, holder
                )
            except NoInstances as exc:
                return pb.AcquireResponse(granted=False, reason=str(exc), failure=pb.NO_INSTANCE)
            if isinstance(got, Grant):
                return self._granted(got, lease_ms)
            if isinstance(got, Gone):  # the asker picks other instances
                return pb.AcquireResponse(
                    granted=False,
                    reason="the instances asked for are gone",
                    failure=pb.INSTANCE_BUSY,
                    gone_instances=got.instances,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return pb.AcquireResponse(
                    granted=False,
                    reason="every instance (or a resource it needs) is busy",
                    failure=pb.INSTANCE_BUSY,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, got.recheck_s))

    def _granted(self, grant: Grant, lease_ms: int) -> pb.AcquireResponse:
        inst = grant.instance
        RATELIMITER_GRANTS.labels(inst.model, str(inst.version)).inc()
        until = time.monotonic() + lease_ms / 1000.0
        self._grants[grant.grant_id] = (inst.model, inst.version, grant.holds_resources, until)
        return pb.AcquireResponse(
            granted=True,
            grant_id=grant.grant_id,
            instance=instance_to_pb(inst),
            holds_resources=grant.holds_resources,
        )

    async def release(self, request: pb.ReleaseRequest) -> None:
        await self.registry.release(request.grant_id, failed=request.instance_failed)
        if request.instance_failed:
            log.warning(
                "instance reported failed; its worker is removed",
                extra={"grant_id": request.grant_id, "reason": request.reason},
            )
        known = self._grants.pop(request.grant_id, None)
        if known is not None and not known[2]:
            self.wakeups.wake(known[0], known[1])
        else:  # freed resources may let any model run
            self.wakeups.wake_all()

    @typed_errors
    async def Renew(self, request: pb.RenewRequest, context) -> pb.RenewResponse:
        lease_ms = request.lease_ms or self.settings.default_renew_lease_ms
        lost = await self.registry.renew(list(request.grant_ids), lease_ms)
        # The renewed grants stay in _grants as long as their new leases.
        until = time.monotonic() + lease_ms / 1000.0
        gone = set(lost)
        for gid in request.grant_ids:
            known = self._grants.get(gid)
            if known is not None and gid not in gone:
                self._grants[gid] = (known[0], known[1], known[2], until)
        return pb.RenewResponse(lost_grant_ids=lost)

    @typed_errors
    async def ReleaseHolder(
        self, request: pb.ReleaseHolderRequest, context
    ) -> pb.ReleaseHolderResponse:
        released = await self.registry.release_holder(request.holder)
        mine, keep = predecessor_prefixes(request.holder)
        for gid in [g for g in self._grants if g.startswith(mine) and not g.startswith(keep)]:
            del self._grants[gid]
        if released:
            log.info(
                "grants of an earlier scheduler process released",
                extra={"holder": request.holder, "released": released},
            )
            self.wakeups.wake_all()
        return pb.ReleaseHolderResponse(released=released)

    @typed_errors
    async def ListInstances(
        self, request: pb.ListInstancesRequest, context
    ) -> pb.ListInstancesResponse:
        instances = await self.registry.instances(request.model, request.version)
        busy = await self.registry.busy_instance_ids()
        return pb.ListInstancesResponse(
            instances=[instance_to_pb(i) for i in instances], busy_instance_ids=busy
        )

    async def export_usage_once(self) -> None:
        """Set the instance and resource gauges from Redis; a resource that is
        gone (its last instance left) leaves /metrics."""
        for (model, version), (free, busy) in (await self.registry.usage()).items():
            RATELIMITER_INSTANCES.labels(model, str(version), "free").set(free)
            RATELIMITER_INSTANCES.labels(model, str(version), "busy").set(busy)
        exported: set[tuple[str, str]] = set()
        for key, (held, available) in (await self.registry.resources()).items():
            name, _, device = key.rpartition("@")
            exported.add((name, device))
            RATELIMITER_RESOURCES.labels(name, device, "held").set(held)
            RATELIMITER_RESOURCES.labels(name, device, "available").set(available)
        for name, device in self._exported_resources - exported:
            for state in ("held", "available"):
                RATELIMITER_RESOURCES.remove(name, device, state)
        self._exported_resources = exported

    async def export_usage_forever(self) -> None:
        """Keep the gauges current for /metrics."""
        period_s = self.settings.usage_export_s
        while True:
            try:
                await self.export_usage_once()
            except Exception as exc:
                stage_error(exc, "usage export")  # logged there
            await asyncio.sleep(period_s)

    def freed(self, message: bytes) -> None:
        """Another rate limiter freed an instance of a pool ("{model}:{version}")
        or anything ("*"): its waiters here look again now."""
        text = message.decode()
        model, _, version = text.rpartition(":")
        if text == "*" or not version.isdigit():
            self.wakeups.wake_all()
        else:
            self.wakeups.wake(model, int(version))

    async def follow_freed_forever(self) -> None:
        """Wake waiters on what other rate limiter processes free (Redis pub/sub)."""
        pubsub = self.registry.redis.pubsub(ignore_subscribe_messages=True)
        failures = 0
        try:
            while True:
                try:
                    if not pubsub.subscribed:
                        await pubsub.subscribe(self.registry.freed_channel)
                        self.wakeups.wake_all()  # whatever was freed while unsubscribed
                        if failures:
                            log.info("release signals followed again", extra={"tries": failures})
                        failures = 0
                    message = await pubsub.get_message(timeout=None)
                except Exception as exc:  # Redis away: the waiters poll meanwhile
                    if not failures:  # once per outage, not once per try
                        stage_error(exc, "freed subscription")  # logged there
                    failures += 1
                    await pubsub.aclose()  # subscribes anew next round
                    await asyncio.sleep(min(self.settings.acquire_poll_s * 2**failures, 5.0))
                    continue
                if message is not None and message["type"] == "message":
                    self.freed(message["data"])
        finally:
            await pubsub.aclose()

    def forget_expired(self, now: float) -> int:
        """Drop the _grants entries whose lease ended by `now` (monotonic
        seconds); returns how many. Their release, should it still come,
        wakes every waiter."""
        ended = [gid for gid, known in self._grants.items() if known[3] <= now]
        for gid in ended:
            del self._grants[gid]
        return len(ended)

    async def sweep_forever(self) -> None:
        """Release expired grants, forget dead workers and the wake-up hints
        of grants whose lease ended."""
        period_s = self.settings.sweep_s
        while True:
            try:
                expired, dead = await self.registry.sweep()
                if expired or dead:
                    log.warning("sweep", extra={"expired_grants": expired, "dead_workers": dead})
                    self.wakeups.wake_all()
            except Exception as exc:
                stage_error(exc, "sweep")  # logged there
            self.forget_expired(time.monotonic())  # with Redis away too
            await asyncio.sleep(period_s)


async def record_grant_spans(
    request: pb.AcquireRequest, resp: pb.AcquireResponse, start_ns: int, end_ns: int
) -> None:
    """A "grant" span per traced request waiting for this acquire, granted at
    once or after a wait alike: from the acquire's arrival to its answer,
    under the request's gateway span."""
    parents = [p for p in map(trace_spans.parse_traceparent, request.traceparents) if p]
    stage = trace_spans.STAGE
    emitter = await stage.emitter() if stage is not None and parents else None
    if emitter is None:
        return
    attributes: dict[str, str | bool] = {
        "stageserve.granted": resp.granted,
        "stageserve.model": request.model,
    }
    if resp.granted:
        attributes["stageserve.instance"] = resp.instance.instance_id
    for parent in parents:
        span, _ = emitter.start("grant", parent, start_ns, attributes)
        emitter.end(span, end_ns, "" if resp.granted else resp.reason)


async def serve(listen: str, redis_url: str, settings: Settings) -> None:
    """`settings.ratelimiter`: the rate limit mode, resource overrides and figures."""
    from stageserve.net import stage_server
    from stageserve.redis_connect import connect
    from stageserve.service_runtime import run_server

    rl = settings.ratelimiter
    rate_limit, resource_overrides = rl.mode, dict(rl.resources)
    redis = connect(redis_url, settings.redis_client)
    await redis.ping()
    spans = trace_spans.configure("ratelimiter", redis)  # traced requests' grant spans
    registry = RedisRegistry(redis, mode=rate_limit, settings=rl)
    await registry.set_overrides(resource_overrides)
    log.info(
        "rate limiting",
        extra={"mode": rate_limit, "resource_overrides": resource_overrides},
    )
    service = RateLimiterService(registry, rl)
    server = stage_server(rl.grpc_server)
    pb_grpc.add_RateLimiterServicer_to_server(service, server)
    background = [
        asyncio.create_task(service.sweep_forever()),
        asyncio.create_task(service.export_usage_forever()),
        asyncio.create_task(service.follow_freed_forever()),
    ]
    try:
        await run_server(server, listen, "ratelimiter", stage_tls=settings.stage_tls)
    finally:
        for task in background:
            task.cancel()
        await asyncio.to_thread(spans.close)
        await redis.aclose()
