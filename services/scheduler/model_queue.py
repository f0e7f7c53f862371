"""One model version's queue: wait for a free instance, form a batch, run it.

The dispatch loop needs a grant (a free instance) before it forms a batch, so
batches form when an instance can run them and grow while every instance is
busy. Each batch runs as its own task; the loop goes straight back to
waiting for the next free instance.

ModelQueue is the one dispatch loop, for every kind of model; it composes
pure parts and does their I/O: a batch-forming strategy (batch_strategy.py:
the default scheduler and dynamic batcher over batcher.py;
sequence_strategy.py: the sequence batcher), the grant pool (which grants
are kept for reuse and when they go back: grant_pool.py) and the response
order (preserve_ordering: response_order.py). The rate limiter is asked
only for instances beyond those the pool holds. A sequence model adds the
sequences' Redis adapter (sequence_queue.SequenceIO: backlog listing,
claims, state commits) around each execution.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

import grpc
from redis.exceptions import RedisError

from services.scheduler.batch_strategy import Queued, QueueStrategy, Respond, Strategy
from services.scheduler.batcher import QueueFull
from services.scheduler.clients import Granted, RateLimiterClient, WorkerCallError, WorkerClients
from services.scheduler.decoupled import DecoupledBatch
from services.scheduler.grant_pool import GrantPool, Held, Usable
from services.scheduler.response_order import ResponseOrder
from services.scheduler.wakeup import Wakeup
from stageserve.config import ModelSpec
from stageserve.errors import StageError, queue_full, queue_timeout, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import (
    SCHEDULER_BATCH_SIZE,
    SCHEDULER_QUEUE_DEPTH,
    TRITON,
    model_labels,
)

if TYPE_CHECKING:
    from services.scheduler.sequence_queue import SequenceIO

log = logging.getLogger(__name__)

_NONE_HIDDEN: frozenset[str] = frozenset()  # outputs a batch keeps from its answers


def error_response(request_id: int, err: StageError) -> pb.ScheduleResponse:
    return pb.ScheduleResponse(
        id=request_id, code=err.code.value[0], message=err.message, rejected=err.rejected
    )


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
        if request_info:  # only Python models read them (InferenceRequest)
            add_request_info(req, q.msg)
    return req


def add_request_info(req: pb.ExecuteRequest, msg: pb.ScheduleRequest | None) -> None:
    """A request's metadata for pb_utils.InferenceRequest; None: a padding row,
    which Triton 2.51 gives correlation id 0, flags 0 and no request id."""
    if msg is None:
        req.request_info.add(padding=True)
        return
    req.request_info.add(
        request_id=msg.request_id,
        correlation_id=msg.sequence_id,
        correlation_id_str=msg.sequence_id_str,
        # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1, _END = 2
        flags=int(msg.sequence_start) | (int(msg.sequence_end) << 1),
        parameters_json=msg.parameters_json,
    )


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
    """The dispatch loop of one model version: composes a strategy (no I/O)
    and, for sequence models, the sequences' Redis adapter; does the I/O."""

    def __init__(
        self,
        model: str,
        version: int,
        spec: ModelSpec,
        ratelimiter: RateLimiterClient,
        workers: WorkerClients,
        adaptive_delay_us: int = 0,
        strategy: Strategy | None = None,
        sequences: SequenceIO | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.spec = spec
        # (not `strategy or ...`: an empty strategy is falsy, it has a __len__)
        self.strategy: Strategy = (
            QueueStrategy(spec, adaptive_delay_us) if strategy is None else strategy
        )
        self.sequences = sequences
        self.ratelimiter = ratelimiter
        self.workers = workers
        self.executing = 0
        self._arrived = Wakeup()
        self._grant_event = asyncio.Event()
        self.grants: GrantPool[Granted] = GrantPool()
        self._acquiring: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._deadline_changed = Wakeup()
        self._order: ResponseOrder[tuple[Respond, pb.ScheduleResponse]] = ResponseOrder()
        v = str(version)
        self._depth_gauge = SCHEDULER_QUEUE_DEPTH.labels(model, v)
        self._batch_hist = SCHEDULER_BATCH_SIZE.labels(model, v)
        self._labels = model_labels(model, version)
        if sequences is not None:
            sequences.bind(self._changed)
        self._expiry_task = asyncio.create_task(self._expiry_loop())
        self._loop_task = asyncio.create_task(self._dispatch_loop())

    def _depth_changed(self) -> None:
        depth = len(self.strategy)
        self._depth_gauge.set(depth)
        TRITON.set("nv_inference_pending_request_count", self._labels, depth)

    def _changed(self) -> None:
        """The sequences' adapter changed the queue (listed, put back, dropped)."""
        self._depth_changed()
        self._arrived.set()

    def fits(self, spec: ModelSpec) -> bool:
        """Whether reconfigure can take this spec (same kind of scheduling)."""
        return (spec.sequence is None) == (self.sequences is None)

    def reconfigure(self, spec: ModelSpec) -> None:
        """A reloaded model: keep queued requests, apply the new batching settings,
        and hand back held grants (their instances belong to the old load)."""
        self.spec = spec
        self.strategy.reconfigure(spec)
        # Ordering restarts with the new settings: release what was held.
        for respond, held in self._order.reset():
            respond(held)
        self._release_spare()
        self._arrived.set()

    def submit(self, msg: pb.ScheduleRequest, respond: Respond) -> None:
        queued = Queued(msg, respond, time.monotonic_ns())
        try:
            has_deadline = self.strategy.add(queued)
        except QueueFull as exc:
            level = self.strategy.level_of(int(msg.priority))
            respond(
                error_response(
                    msg.id,
                    queue_full(
                        f"Exceeds maximum queue size: the queue of model '{self.model}' "
                        f"(priority level {level}) is full: {exc}"
                    ),
                )
            )
            return
        if has_deadline:
            self._deadline_changed.set()
        self._depth_changed()
        if self.sequences is not None:
            self.sequences.accepted(queued)  # eligible once listed in Redis
            return
        self._arrived.set()

    # --------------------------------------------------------------- timeouts

    def _expire(self) -> None:
        rejected = self.strategy.expire(time.monotonic_ns())
        if not rejected:
            return
        for q in rejected:
            waited_us = (time.monotonic_ns() - q.enqueue_ns) // 1000
            q.respond(
                error_response(
                    q.msg.id,
                    queue_timeout(
                        f"Request timeout expired: request to model '{self.model}' waited "
                        f"{waited_us} us in the queue"
                    ),
                )
            )
        self._depth_changed()

    async def _expiry_loop(self) -> None:
        """Answer timed-out requests at their deadline, whatever is executing."""
        while True:
            deadline = self.strategy.next_deadline()
            if deadline is None:
                await self._deadline_changed.wait()
                continue
            delay = (deadline - time.monotonic_ns()) / 1e9
            if delay > 0:
                await self._deadline_changed.wait(delay)
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
        return len(self.strategy)

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
        if self.sequences is not None:
            self.sequences.close()

    def _fail_all(self, err: StageError) -> None:
        failed = self.strategy.drain()
        for q in failed:
            q.respond(error_response(q.msg.id, err))
        self._depth_changed()
        if self.sequences is not None:
            self.sequences.dropped(failed)

    async def _wait_arrival(self, timeout_s: float | None) -> None:
        await self._arrived.wait(timeout_s)

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
            if not self.strategy.has_work(time.monotonic_ns()):
                return None
            if self._acquiring is None:
                self._acquiring = asyncio.create_task(self._acquire_into_spare())
            self._grant_event.clear()
            await self._grant_event.wait()

    # ---------------------------------------------------------------- dispatch

    async def _dispatch_loop(self) -> None:
        while True:
            try:
                now_ns = time.monotonic_ns()
                if not self.strategy.has_work(now_ns):
                    # Idle: the pool keeps held grants for a standby hold, then
                    # they go back. A batch finishing wakes us (its grant joins
                    # the pool), so the hold starts when the last one ends; so
                    # does an arrival, or the strategy's own wake-up (a retry
                    # or a slot idle-out coming due). Inline, not a coroutine:
                    # at concurrency 1 this runs once per request.
                    remaining = self.grants.idle(now_ns / 1e9)
                    if remaining == 0.0:
                        self._release_spare()
                        continue
                    wake_ns = self.strategy.wake_at_ns(now_ns)
                    if wake_ns is not None:
                        until = max(0.0, (wake_ns - now_ns) / 1e9)
                        remaining = until if remaining is None else min(remaining, until)
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
            decision = self.strategy.next_batch(time.monotonic_ns())
            batch = decision.batch
            if batch:
                self._depth_changed()
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
        spec = self.spec
        sequences = self.sequences
        failed_instance: bool | None = False
        job = None
        # Before the try: a sequence batch can end before it is built (nothing
        # claimable, Redis down) and the finally reads it.
        decoupled: DecoupledBatch | None = None
        # A decoupled sequence batch's final answers, held until its commit:
        # "state first, answers second", as for any sequence batch.
        finals: list[tuple[Queued, pb.ScheduleResponse]] = []
        try:
            compute_start = time.monotonic_ns()
            if sequences is None:
                rows: list[Queued | None] = batch  # type: ignore[assignment]
                hidden = _NONE_HIDDEN
                request = build_execute_request(
                    grant.instance_id,
                    batch,
                    spec.batching,
                    spec.ragged_inputs,
                    request_info=spec.backend == "python",
                )
            else:  # claims the sequences in Redis; some may wait or be refused
                job = await sequences.prepare(batch, grant.instance_id)
                if job is None:
                    return
                rows, hidden, request = job.rows, job.hidden, job.request
                compute_start = time.monotonic_ns()
            if spec.decoupled:
                decoupled = DecoupledBatch(
                    rows,
                    compute_start,
                    sum(request.request_batch_sizes),
                    # A sequence's finals wait for its commit (below).
                    self._deliver if job is None else lambda q, r: finals.append((q, r)),
                    # execute returned: the instance is free, its senders go
                    # on. A sequence batch keeps its instance to its last
                    # final, so its next request runs after this one ended.
                    on_returned=(lambda: self._give_back(held, False)) if job is None else None,
                )
            try:
                resp = await self.workers.execute(
                    grant.worker_address, request, decoupled.on_part if decoupled else None
                )
            except WorkerCallError as exc:
                err, failed_instance = self._execution_error(exc, grant)
                ran = decoupled is not None and (decoupled.sent_any or decoupled.returned)
                if failed_instance is None and not ran and self._requeue(batch):
                    return  # the instance was unloaded (a reload): run elsewhere
                if decoupled is not None:
                    decoupled.finish(err)
                if job is not None:  # a failed execution leaves the states as they were
                    await job.settle_failed()
                if decoupled is not None:
                    self._deliver_all(finals)
                    return
                for q in rows:
                    if q is not None:
                        self._deliver(q, error_response(q.msg.id, err))
                return
            if decoupled is not None:
                decoupled.finish(None)
                if job is not None:  # a decoupled model's states: not supported (config.py)
                    await job.commit(None)
                self._deliver_all(finals)
                return
            if job is not None:
                # State first, answers second: a client that sends its next
                # request the moment it has this answer must find the new
                # state in Redis.
                await job.commit(resp)
            self._answer(rows, hidden, request, resp, compute_start)
        finally:
            if job is not None:
                job.close()
            self.strategy.finished(batch, time.monotonic_ns())
            self.executing -= 1
            if decoupled is None or not decoupled.returned or job is not None:
                self._give_back(held, failed_instance)

    def _deliver_all(self, answers: list[tuple[Queued, pb.ScheduleResponse]]) -> None:
        for q, response in answers:
            self._deliver(q, response)

    def _answer(
        self,
        rows: list[Queued | None],
        hidden: frozenset[str],
        request: pb.ExecuteRequest,
        resp: pb.ExecuteResponse,
        compute_start: int,
    ) -> None:
        """Each request's outputs (less `hidden` ones) or its own error; None
        rows are padding."""
        total = sum(request.request_batch_sizes)
        self._batch_hist.observe(total)
        leader = True
        for q, result in zip(rows, resp.results, strict=True):
            if q is None:
                continue
            timing = pb.Timing(
                queue_ns=compute_start - q.enqueue_ns,
                compute_input_ns=resp.compute_input_ns,
                compute_infer_ns=resp.compute_infer_ns,
                compute_output_ns=resp.compute_output_ns,
                batch_size=total,
                batch_leader=leader,
            )
            leader = False
            if result.code:  # a per-request error (a Python model's response)
                self._deliver(
                    q,
                    pb.ScheduleResponse(
                        id=q.msg.id, code=result.code, message=result.message, timing=timing
                    ),
                )
                continue
            outputs = result.outputs
            if hidden:
                outputs = [t for t in outputs if t.name not in hidden]
            self._deliver(q, pb.ScheduleResponse(id=q.msg.id, outputs=outputs, timing=timing))

    def _requeue(self, batch: list[Queued]) -> bool:
        """Put a batch whose instance went away back at the head of the queue."""
        if not self.strategy.requeue(batch):
            return False
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
