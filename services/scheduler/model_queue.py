"""One model version's queue: wait for a free instance, form a batch, run it.

The dispatch loop needs a grant (a free instance) before it forms a batch, so
batches form when an instance can run them and grow while every instance is
busy. Each batch runs as its own task; the loop goes straight back to
waiting for the next free instance.

The loop composes pure parts and does their I/O: the batcher (batch
formation, queue order, timeouts: batcher.py), the grant pool (which grants
are kept for reuse and when they go back: grant_pool.py) and the response
order (preserve_ordering: response_order.py). The rate limiter is asked
only for instances beyond those the pool holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from redis.exceptions import RedisError

from services.scheduler.batcher import (
    Batcher,
    DefaultBatcher,
    DynamicBatcher,
    Pending,
    QueueFull,
    QueuePolicy,
)
from services.scheduler.batcher import shape_key as batch_shape_key
from services.scheduler.clients import Granted, RateLimiterClient, WorkerCallError, WorkerClients
from services.scheduler.decoupled import DecoupledBatch
from services.scheduler.grant_pool import GrantPool, Held, Usable
from services.scheduler.response_order import ResponseOrder
from stageserve.config import ModelSpec, QueuePolicySpec
from stageserve.errors import StageError, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import (
    SCHEDULER_BATCH_SIZE,
    SCHEDULER_QUEUE_DEPTH,
    TRITON,
    model_labels,
)

log = logging.getLogger(__name__)

Respond = Callable[[pb.ScheduleResponse], None]

# How often a batch is retried when its instance disappeared under it (a reload).
MAX_ATTEMPTS = 3


@dataclass
class Queued:
    msg: pb.ScheduleRequest
    respond: Respond
    enqueue_ns: int
    seq: int = 0  # dispatch order, for preserve_ordering
    pending: Pending | None = None  # its queue entry, to requeue it
    attempts: int = 0


def _policy(p: QueuePolicySpec) -> QueuePolicy:
    return QueuePolicy(
        p.timeout_action, p.default_timeout_us, p.allow_timeout_override, p.max_queue_size
    )


def make_batcher(spec: ModelSpec, adaptive_delay_us: int = 0) -> Batcher:
    db = spec.dynamic_batching
    if db is None:
        return DefaultBatcher()
    return DynamicBatcher(
        spec.max_batch_size,
        db.preferred_batch_sizes,
        db.max_queue_delay_us * 1000,
        adaptive_delay_us * 1000,
        priority_levels=db.priority_levels,
        default_priority_level=db.default_priority_level,
        default_policy=_policy(db.default_queue_policy),
        level_policies={level: _policy(p) for level, p in db.priority_queue_policy},
    )


def shape_key(
    msg: pb.ScheduleRequest, batching: bool, ragged: frozenset[str] = frozenset()
) -> tuple:
    return batch_shape_key(((t.name, t.shape) for t in msg.inputs), batching, ragged)


def error_response(request_id: int, err: StageError) -> pb.ScheduleResponse:
    return pb.ScheduleResponse(id=request_id, code=err.code.value[0], message=err.message)


def build_execute_request(
    instance_id: str,
    batch: list[Queued],
    batching: bool,
    ragged: frozenset[str] = frozenset(),
    request_info: bool = False,
) -> pb.ExecuteRequest:
    """Concatenate each input's raw bytes across the batch (batch dim is outermost).

    A ragged input becomes one 1-D tensor of all the requests' elements (what
    Triton's ONNX Runtime backend feeds such an input), with the requests' own
    shapes alongside; the bytes are still only concatenated, never decoded."""
    first = batch[0].msg
    req = pb.ExecuteRequest(instance_id=instance_id)
    for i, t in enumerate(first.inputs):
        if t.name in ragged:
            req.inputs.append(_ragged_input(req, t, [q.msg.inputs[i] for q in batch]))
            continue
        if len(batch) == 1:
            req.inputs.append(t)
            continue
        total = sum(q.msg.inputs[i].shape[0] for q in batch)
        req.inputs.append(
            pb.Tensor(
                name=t.name,
                datatype=t.datatype,
                shape=[total, *t.shape[1:]],
                raw=b"".join(q.msg.inputs[i].raw for q in batch),
            )
        )
    req.request_batch_sizes.extend(q.msg.batch_size if batching else 1 for q in batch)
    for q in batch:
        req.requested.add(names=q.msg.outputs)
        if not request_info:  # only Python models read them (InferenceRequest)
            continue
        req.request_info.add(
            request_id=q.msg.request_id,
            correlation_id=q.msg.sequence_id,
            correlation_id_str=q.msg.sequence_id_str,
            flags=int(q.msg.sequence_start) | (int(q.msg.sequence_end) << 1),
            parameters_json=q.msg.parameters_json,
        )
    return req


def _ragged_input(req: pb.ExecuteRequest, first: pb.Tensor, parts: list[pb.Tensor]) -> pb.Tensor:
    """One ragged input across the batch; records each request's shape in req."""
    shapes = req.ragged_shapes.add(input=first.name, rank=len(first.shape))
    for t in parts:
        shapes.dims.extend(t.shape)
    return pb.Tensor(
        name=first.name,
        datatype=first.datatype,
        shape=[sum(math.prod(t.shape) for t in parts)],
        raw=parts[0].raw if len(parts) == 1 else b"".join(t.raw for t in parts),
    )


class ModelQueue:
    def __init__(
        self,
        model: str,
        version: int,
        spec: ModelSpec,
        ratelimiter: RateLimiterClient,
        workers: WorkerClients,
        adaptive_delay_us: int = 0,
    ) -> None:
        self.model = model
        self.version = version
        self.spec = spec
        self.adaptive_delay_us = adaptive_delay_us
        self.batcher = make_batcher(spec, adaptive_delay_us)
        self.ratelimiter = ratelimiter
        self.workers = workers
        self.executing = 0
        self._arrived = asyncio.Event()
        self._grant_event = asyncio.Event()
        self.grants: GrantPool[Granted] = GrantPool()
        self._acquiring: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._deadline_changed = asyncio.Event()
        self._order: ResponseOrder[tuple[Respond, pb.ScheduleResponse]] = ResponseOrder()
        self._expiry_task = asyncio.create_task(self._expiry_loop())
        v = str(version)
        self._depth_gauge = SCHEDULER_QUEUE_DEPTH.labels(model, v)
        self._batch_hist = SCHEDULER_BATCH_SIZE.labels(model, v)
        self._labels = model_labels(model, version)
        self._loop_task = asyncio.create_task(self._dispatch_loop())

    def _depth_changed(self) -> None:
        depth = len(self.batcher)
        self._depth_gauge.set(depth)
        TRITON.set("nv_inference_pending_request_count", self._labels, depth)

    def reconfigure(self, spec: ModelSpec) -> None:
        """A reloaded model: keep queued requests, apply the new batching settings,
        and hand back held grants (their instances belong to the old load)."""
        pending = self.batcher.drain()
        self.spec = spec
        self.batcher = make_batcher(spec, self.adaptive_delay_us)
        for p in pending:  # the new config may make other inputs ragged
            p.shape_key = shape_key(p.payload.msg, spec.batching, spec.ragged_inputs)
        self.batcher.requeue_front(pending)
        # Ordering restarts with the new settings: release what was held.
        for respond, held in self._order.reset():
            respond(held)
        self._release_spare()
        self._arrived.set()

    def submit(self, msg: pb.ScheduleRequest, respond: Respond) -> None:
        now = time.monotonic_ns()
        batching = self.spec.batching
        queued = Queued(msg, respond, now)
        pending = queued.pending = Pending(
            batch_size=msg.batch_size if batching else 1,
            shape_key=shape_key(msg, batching, self.spec.ragged_inputs),
            enqueue_ns=now,
            payload=queued,
            priority=int(msg.priority),
        )
        try:
            self.batcher.add(pending, timeout_us=int(msg.timeout_us))
        except QueueFull as exc:
            level = self.batcher.level_of(int(msg.priority))
            respond(
                error_response(
                    msg.id,
                    unavailable(
                        f"Exceeds maximum queue size: the queue of model '{self.model}' "
                        f"(priority level {level}) is full: {exc}"
                    ),
                )
            )
            return
        if pending.deadline_ns is not None:
            self._deadline_changed.set()
        self._depth_changed()
        self._arrived.set()

    # --------------------------------------------------------------- timeouts

    def _expire(self) -> None:
        rejected = self.batcher.expire(time.monotonic_ns())
        if not rejected:
            return
        for p in rejected:
            q: Queued = p.payload
            waited_us = (time.monotonic_ns() - q.enqueue_ns) // 1000
            q.respond(
                error_response(
                    q.msg.id,
                    unavailable(
                        f"Request timeout expired: request to model '{self.model}' waited "
                        f"{waited_us} us in the queue"
                    ),
                )
            )
        self._depth_changed()

    async def _expiry_loop(self) -> None:
        """Answer timed-out requests at their deadline, whatever is executing."""
        while True:
            self._deadline_changed.clear()
            deadline = self.batcher.next_deadline()
            if deadline is None:
                await self._deadline_changed.wait()
                continue
            delay = (deadline - time.monotonic_ns()) / 1e9
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._deadline_changed.wait(), delay)
                continue
            self._expire()

    # -------------------------------------------------------------- ordering

    def _deliver(self, q: Queued, response: pb.ScheduleResponse) -> None:
        """Send a response; with preserve_ordering, in dispatch order."""
        if not self._ordered:
            q.respond(response)
            return
        for respond, ready in self._order.answered(q.seq, (q.respond, response)):
            respond(ready)

    @property
    def pending(self) -> int:
        return len(self.batcher)

    def _has_work(self) -> bool:
        """Whether a batch could be formed now (given a free instance)."""
        return len(self.batcher) > 0

    @property
    def _ordered(self) -> bool:
        db = self.spec.dynamic_batching
        return db is not None and db.preserve_ordering

    def close(self) -> None:
        self._loop_task.cancel()
        self._expiry_task.cancel()
        if self._acquiring is not None:
            self._acquiring.cancel()
        self._release_spare()
        self._fail_all(unavailable(f"model '{self.model}' is no longer scheduled"))

    def _fail_all(self, err: StageError) -> None:
        for p in self.batcher.drain():
            q: Queued = p.payload
            q.respond(error_response(q.msg.id, err))
        self._depth_changed()

    async def _wait_arrival(self, timeout_s: float | None) -> None:
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout_s)

    # ---------------------------------------------------------------- grants

    def _release_spare(self) -> None:
        for grant in self.grants.drain():
            self._spawn(self.ratelimiter.release(grant.grant_id))

    def _give_back(self, held: Held[Granted], failed: bool | None) -> None:
        """A finished batch's grant: the pool keeps it for the next batch, or it
        goes back to the rate limiter."""
        grant = held.grant
        if not self.grants.finished(held, failed, grant.holds_resources, time.monotonic()):
            self._spawn(self.ratelimiter.release(grant.grant_id, failed=bool(failed)))
        self._grant_event.set()
        self._arrived.set()  # an idle loop starts its standby hold now

    def _usable(self, grant: Granted) -> Usable:
        if self.workers.is_broken(grant.worker_address):
            return Usable.BROKEN
        if grant.grant_id in self.ratelimiter.lost:
            return Usable.LOST
        return Usable.OK

    async def _acquire_into_spare(self) -> None:
        try:
            grant = await self.ratelimiter.acquire(self.model, self.version)
            if grant is not None:
                self.grants.acquired(grant, time.monotonic())
        except StageError as err:
            # No instance at all, or the rate limiter is down: answer now
            # rather than keep clients waiting.
            self._fail_all(err)
        finally:
            self._acquiring = None
            self._grant_event.set()

    async def _next_grant(self) -> Held[Granted] | None:
        """A held grant if there is one, else wait for a batch to finish or the
        rate limiter to grant another instance. None once the queue emptied."""
        while True:
            held, releases = self.grants.take(self._usable)
            for grant, failed in releases:
                self._spawn(self.ratelimiter.release(grant.grant_id, failed=failed))
            if held is not None:
                return held
            if not self._has_work():
                return None
            if self._acquiring is None:
                self._acquiring = asyncio.create_task(self._acquire_into_spare())
            self._grant_event.clear()
            await self._grant_event.wait()

    # ---------------------------------------------------------------- dispatch

    async def _dispatch_loop(self) -> None:
        while True:
            try:
                if not self._has_work():
                    # Idle: the pool keeps held grants for a standby hold, then
                    # they go back. A batch finishing wakes us (its grant joins
                    # the pool), so the hold starts when the last one ends.
                    remaining = self.grants.idle(time.monotonic())
                    if remaining == 0.0:
                        self._release_spare()
                    else:
                        await self._wait_arrival(remaining)
                    continue
                self.grants.busy()
                held = await self._next_grant()
                if held is None:
                    continue
                batch = await self._form_batch()
                if not batch:
                    self.grants.put_back(held)
                    continue
                self.executing += 1
                self._spawn(self._guarded(batch, held))
            except asyncio.CancelledError:
                raise
            except Exception:  # keep the loop alive whatever one batch did
                log.exception("dispatch loop error", extra={"model": self.model})
                await asyncio.sleep(0.01)

    async def _form_batch(self) -> list[Queued]:
        while True:
            self._expire()
            decision = self.batcher.next_batch(time.monotonic_ns())
            if decision.batch:
                self._depth_changed()
                batch = [p.payload for p in decision.batch]
                if self._ordered:
                    for q in batch:
                        q.seq = self._order.number()
                return batch
            if decision.wake_at_ns is None:
                return []
            await self._wait_arrival(max(0.0, (decision.wake_at_ns - time.monotonic_ns()) / 1e9))

    async def _guarded(self, batch: list[Queued], held: Held[Granted]) -> None:
        """Run a batch; a bug in one batch answers its requests, never hangs them."""
        try:
            await self._execute(batch, held)
        except RedisError as exc:  # Redis down or restarting: the client may retry
            log.warning("batch failed: Redis unavailable", extra={"error": repr(exc)})
            err = unavailable(f"model '{self.model}': the state store is unavailable, retry")
            for q in batch:
                q.respond(error_response(q.msg.id, err))
        except Exception as exc:
            log.exception("batch failed", extra={"model": self.model})
            err = StageError(grpc.StatusCode.INTERNAL, f"scheduler error: {exc}")
            for q in batch:  # the gateway ignores a second answer to one request
                q.respond(error_response(q.msg.id, err))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, batch: list[Queued], held: Held[Granted]) -> None:
        grant = held.grant
        failed_instance: bool | None = False
        try:
            compute_start = time.monotonic_ns()
            request = build_execute_request(
                grant.instance_id,
                batch,
                self.spec.batching,
                self.spec.ragged_inputs,
                request_info=self.spec.backend == "python",
            )
            decoupled = (
                DecoupledBatch(
                    batch, compute_start, sum(request.request_batch_sizes), self._deliver
                )
                if self.spec.decoupled
                else None
            )
            try:
                resp = await self.workers.execute(
                    grant.worker_address, request, decoupled.on_part if decoupled else None
                )
            except WorkerCallError as exc:
                err, failed_instance = self._execution_error(exc, grant)
                resent = decoupled is not None and decoupled.sent_any
                if failed_instance is None and not resent and self._requeue(batch):
                    return  # the instance was unloaded (a reload): run elsewhere
                if decoupled is not None:
                    decoupled.finish(err)
                    return
                for q in batch:
                    self._deliver(q, error_response(q.msg.id, err))
                return
            if decoupled is not None:
                decoupled.finish(None)
                return
            total = sum(request.request_batch_sizes)
            self._batch_hist.observe(total)
            for i, q in enumerate(batch):
                timing = pb.Timing(
                    queue_ns=compute_start - q.enqueue_ns,
                    compute_input_ns=resp.compute_input_ns,
                    compute_infer_ns=resp.compute_infer_ns,
                    compute_output_ns=resp.compute_output_ns,
                    batch_size=total,
                    batch_leader=i == 0,
                )
                result = resp.results[i]
                if result.code:  # a per-request error (a Python model's response)
                    self._deliver(
                        q,
                        pb.ScheduleResponse(
                            id=q.msg.id, code=result.code, message=result.message, timing=timing
                        ),
                    )
                    continue
                self._deliver(
                    q, pb.ScheduleResponse(id=q.msg.id, outputs=result.outputs, timing=timing)
                )
        finally:
            self.executing -= 1
            self._give_back(held, failed_instance)

    def _requeue(self, batch: list[Queued]) -> bool:
        """Put a batch whose instance went away back at the head of the queue."""
        if any(q.pending is None or q.attempts >= MAX_ATTEMPTS for q in batch):
            return False
        for q in batch:
            q.attempts += 1
        self.batcher.requeue_front([q.pending for q in batch if q.pending is not None])
        self._depth_changed()
        self._arrived.set()
        return True

    def _execution_error(
        self, exc: WorkerCallError, grant: Granted
    ) -> tuple[StageError, bool | None]:
        """The clients' error, and whether the instance failed (None: it is gone,
        release the grant without blaming the worker)."""
        code = exc.code
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT):
            return StageError(code, exc.details or "model execution failed"), False
        if code == grpc.StatusCode.NOT_FOUND:  # the instance was unloaded meanwhile
            return unavailable(f"model '{self.model}' instance went away: {exc.details}"), None
        log.warning(
            "worker failed during execution",
            extra={"model": self.model, "instance": grant.instance_id, "code": code.name},
        )
        return (
            unavailable(
                f"worker {grant.worker_address} failed while executing model '{self.model}' "
                f"(instance {grant.instance_id}): {code.name}: {exc.details}"
            ),
            True,
        )
