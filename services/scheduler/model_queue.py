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
claims, state commits) around each execution. Running a formed batch on
its instance and answering its requests is batch_run.py's; the queue keeps
what happens around it: the grant, the strategy's bookkeeping, ordering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from redis.exceptions import RedisError

from services.scheduler.batch_run import BatchRun, RunState
from services.scheduler.batch_strategy import Queued, QueueStrategy, Respond, Strategy
from services.scheduler.batcher import QueueFull
from services.scheduler.clients import Granted, InstancesGone, RateLimiterClient, WorkerClients
from services.scheduler.execute_request import error_response
from services.scheduler.grant_pool import GrantPool, Held, Usable
from services.scheduler.instance_pins import InstanceFilter
from services.scheduler.response_order import ResponseOrder
from services.scheduler.wakeup import Wakeup
from stageserve.config import ModelSpec
from stageserve.errors import StageError, queue_full, queue_timeout, stage_fault, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import SchedulerSettings
from stageserve.telemetry import (
    SCHEDULER_BATCH_SIZE,
    SCHEDULER_QUEUE_DEPTH,
    TRITON,
    model_labels,
)

if TYPE_CHECKING:
    from services.scheduler.sequence_queue import SequenceIO

log = logging.getLogger(__name__)


class Fence(Protocol):
    """May this scheduler still run the model's batches (sharding's lease,
    services/scheduler/shard_member.py)? `fresh` is the per-batch test
    (no I/O); `confirm` settles a stale answer with Redis."""

    def fresh(self) -> bool: ...

    async def confirm(self, model: str) -> bool: ...


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
        settings: SchedulerSettings,
        strategy: Strategy | None = None,
        sequences: SequenceIO | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.spec = spec
        # (not `strategy or ...`: an empty strategy is falsy, it has a __len__)
        self.strategy: Strategy = (
            QueueStrategy(spec, settings.adaptive_batch_delay_us) if strategy is None else strategy
        )
        self.sequences = sequences
        self.ratelimiter = ratelimiter
        self.workers = workers
        self.executing = 0
        self.fence: Fence | None = None  # None: every batch runs (no sharding)
        self._arrived = Wakeup()
        self._idle_waiting = False  # the dispatch loop waits in its idle branch
        self._grant_event = asyncio.Event()
        self.grants: GrantPool[Granted] = GrantPool(settings.grant_reuse_s, settings.standby_hold_s)
        self._acquiring: asyncio.Task | None = None
        # instance -> its grants out with this queue's batches (not in the pool)
        self._running_on: dict[str, int] = {}
        # traced requests queued and not yet in a batch: an acquire names them
        # all (the rate limiter's "grant" span of each); empty when untraced
        self._traced_waiting: list[Queued] = []
        self._tasks: set[asyncio.Task] = set()
        self._deadline_changed = Wakeup()
        self._order: ResponseOrder[tuple[Respond, pb.ScheduleResponse]] = ResponseOrder()
        v = str(version)
        self._depth_gauge = SCHEDULER_QUEUE_DEPTH.labels(model, v)
        self._labels = model_labels(model, version)
        self._run = BatchRun(
            model,
            workers,
            sequences,
            self._deliver,
            self._requeue,
            SCHEDULER_BATCH_SIZE.labels(model, v),
        )
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

    def submit(self, msg: pb.ScheduleRequest, respond: Respond, wake: bool = True) -> None:
        """Queue a request. wake=False: the caller submits more (the rest of an
        incoming message) and calls wake() after the last of them."""
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
        if msg.traceparent:  # it waits for the next grant acquired
            self._traced_waiting.append(queued)
        if has_deadline:
            self._deadline_changed.set()
        if wake:
            self._depth_changed()
        # else wake() sets the depth, once for the message: set per request,
        # the gauges took ~1.4 of the ~8 us a request's submit cost
        # (`python -m bench.scheduler_work`, docs/benchmarks.md)
        if self.sequences is not None:
            self.sequences.accepted(queued)  # eligible once listed in Redis
            return
        if wake:
            self._arrived.set()

    def wake(self) -> None:
        """Requests came with submit(wake=False): while the loop is idle, run
        their batch from here when a held grant is usable and the strategy
        gives the batch now (what the loop would do once woken, less its
        wake-up); otherwise wake the loop.

        Why: at concurrency 1 the loop's wake-up is one event-loop turn and
        one task resumption per request in the scheduler's critical path
        (strace: ~4 more epoll_wait per request than the relay's
        middle). `python -m bench --models simple -c 1 8 64`, three rounds
        interleaved with the loop always woken: scheduler CPU per
        request at c=1 580-600 -> 559-575 us, 611-619 -> 618-631 infer/s;
        c=8 and c=64 within the noise, batches of 4.0 at c=8 either way
        (a message's requests still form one batch: wake() runs after them)."""
        self._depth_changed()
        if self.sequences is not None:
            return  # a sequence's request is eligible once listed (accepted above)
        if self._idle_waiting and self._dispatch_at_once() and not len(self.strategy):
            return
        self._arrived.set()

    # --------------------------------------------------------------- timeouts

    def _expire(self) -> None:
        rejected = self.strategy.expire(time.monotonic_ns())
        if not rejected:
            return
        if self._traced_waiting:
            self._untraced(rejected)
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
        self._traced_waiting = []
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
        left = self._running_on.pop(grant.instance_id, 1) - 1
        if left:
            self._running_on[grant.instance_id] = left
        if not self.grants.finished(held, failed, grant.holds_resources, time.monotonic()):
            self._spawn(self.ratelimiter.release(grant.grant_id, failed=bool(failed)))
        self._grant_event.set()
        self._arrived.set()  # an idle loop starts its standby hold now

    def _instance_free(self, held: Held[Granted]) -> None:
        """A run's instance is free while the run goes on (a stateless batch's
        answers still to go out, a decoupled model's senders): its grant goes
        back, and the next batch starts from here when the strategy has one
        due, rather than a loop turn later, after those answers.

        Why: with one instance, a model runs one batch at a time, so its
        throughput is max_batch_size over the time from one batch's result to
        the next batch's start. A busy scheduler's loop adds a turn behind
        every other callback for each hand-off in that gap (the run answers,
        the loop wakes on the grant, the loop forms the batch). On the H100
        host, bench.scale identity c=256, 8 gateways, batches of 58-63 of 64,
        two interleaved rounds: 12,398 / 12,796 -> 13,296 / 13,978 infer/s.
        Sequence models keep the loop's order: their next batch needs this
        one's sequences released (strategy.finished) first."""
        self._give_back(held, False)
        if self.sequences is None and not self._loop_task.done():
            try:
                self._dispatch_at_once()
            except Exception:  # not this run's failure: its answers still go out
                log.exception("next batch failed to start", extra={"model": self.model})

    def _usable(self, grant: Granted) -> Usable:
        if self.workers.is_broken(grant.worker_address):
            self.strategy.forget_instance(grant.instance_id)
            return Usable.BROKEN
        if grant.grant_id in self.ratelimiter.lost:  # its worker died
            self.strategy.forget_instance(grant.instance_id)
            return Usable.LOST
        return Usable.OK

    async def _acquire_into_spare(self, wanted: InstanceFilter | None) -> None:
        try:
            traced = [q.msg.traceparent for q in self._traced_waiting]
            only = wanted.only if wanted is not None else ()
            other_than = wanted.other_than if wanted is not None else ()
            got = await self.ratelimiter.acquire(self.model, self.version, traced, only, other_than)
            if isinstance(got, InstancesGone):
                for instance in got.instances:
                    self.strategy.forget_instance(instance)
            elif got is not None:
                if got.instance_id in other_than:  # no other instance is there
                    self.strategy.crowded(time.monotonic_ns())
                self.grants.acquired(got, time.monotonic())
        except StageError as err:
            # No instance at all, or the rate limiter is down: answer now
            # rather than keep clients waiting.
            self._fail_all(err)
        finally:
            self._acquiring = None
            self._grant_event.set()

    def _take_held(self, wanted: InstanceFilter | None) -> Held[Granted] | None:
        """A usable held grant on an instance `wanted` names, if any;
        unusable ones met on the way go back."""
        fits = None if wanted is None else (lambda g: wanted.fits(g.instance_id))
        held, releases = self.grants.take(self._usable, fits, time.monotonic())
        for grant, failed in releases:
            self._spawn(self.ratelimiter.release(grant.grant_id, failed=failed))
        return held

    async def _next_grant(self) -> Held[Granted] | None:
        """A held grant if there is one, else wait for a batch to finish or the
        rate limiter to grant another instance. None once the queue emptied."""
        while True:
            now_ns = time.monotonic_ns()
            wanted = self.strategy.instance_filter(now_ns)
            held = self._take_held(wanted)
            if held is not None:
                return held
            if not self.strategy.has_work(now_ns):
                return None
            if self._acquiring is None and not self._running_all(wanted):
                self._acquiring = asyncio.create_task(self._acquire_into_spare(wanted))
            self._grant_event.clear()
            await self._grant_event.wait()

    def _running_all(self, wanted: InstanceFilter | None) -> bool:
        """Whether every instance `wanted` allows runs a batch of ours: their
        grants come back to the pool when those end, asking the rate limiter
        would only wait."""
        return (
            wanted is not None
            and bool(wanted.only)
            and all(i in self._running_on for i in wanted.only)
        )

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
                    self._idle_waiting = True
                    await self._wait_arrival(remaining)
                    self._idle_waiting = False
                    continue
                self.grants.busy()
                held = await self._next_grant()
                if held is None:
                    continue
                batch, formed_ns = await self._form_batch(held.grant.instance_id)
                if not batch:
                    self.grants.put_back(held)
                    continue
                self._dispatch(batch, held, formed_ns)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep the loop alive whatever one batch did
                log.exception("dispatch loop error", extra={"model": self.model})
                await asyncio.sleep(0.01)

    def _dispatch_at_once(self) -> bool:
        """A batch started from wake(); False: none could start here."""
        held = self._take_held(self.strategy.instance_filter(time.monotonic_ns()))
        if held is None:
            return False
        try:
            self._expire()
            formed_ns = time.monotonic_ns()
            batch = self.strategy.next_batch(formed_ns, held.grant.instance_id).batch
        except BaseException:  # the grant goes back to the pool, not lost with the error
            self.grants.put_back(held)
            raise
        if not batch:
            self.grants.put_back(held)
            return False
        self.grants.busy()
        self._dispatch(self._formed(batch), held, formed_ns)
        return True

    def _formed(self, batch: list[Queued]) -> list[Queued]:
        self._depth_changed()
        if self._traced_waiting:
            self._untraced(batch)
        if self._ordered:
            for q in batch:
                q.seq = self._order.number()
        return batch

    def _untraced(self, gone: list[Queued]) -> None:
        """Traced requests that wait for no grant any more (batched or answered)."""
        ids = {id(q) for q in gone}
        self._traced_waiting = [q for q in self._traced_waiting if id(q) not in ids]
        if not len(self.strategy):  # a sequence's request dropped unbatched, say
            self._traced_waiting = []

    def _dispatch(self, batch: list[Queued], held: Held[Granted], formed_ns: int) -> None:
        """`formed_ns`: when the strategy picked the batch (its "batch" span starts)."""
        self.executing += 1
        instance = held.grant.instance_id
        self._running_on[instance] = self._running_on.get(instance, 0) + 1
        self._spawn(self._guarded(batch, held, formed_ns))

    async def _form_batch(self, instance: str) -> tuple[list[Queued], int]:
        """A batch for `instance` and when the strategy picked it; ([], 0)
        when none is due."""
        while True:
            self._expire()
            now_ns = time.monotonic_ns()
            decision = self.strategy.next_batch(now_ns, instance)
            batch = decision.batch
            if batch:
                return self._formed(batch), now_ns
            if decision.wake_at_ns is None:
                return [], 0
            await self._wait_arrival(max(0.0, (decision.wake_at_ns - time.monotonic_ns()) / 1e9))

    async def _guarded(self, batch: list[Queued], held: Held[Granted], formed_ns: int) -> None:
        """Run a batch; a bug in one batch answers its requests, never hangs them.
        However it ended, the strategy hears of it and the grant goes back."""
        state = RunState()
        fence = self.fence
        try:
            if fence is not None and not fence.fresh() and not await fence.confirm(self.model):
                self._refuse(batch)
                return
            await self._run.run(
                self.spec,
                batch,
                held.grant,
                state,
                lambda: self._instance_free(held),
                formed_ns,
            )
        except RedisError as exc:  # Redis down or restarting: the client may retry
            log.warning("batch failed: Redis unavailable", extra={"error": repr(exc)})
            err = unavailable(f"model '{self.model}': the state store is unavailable, retry")
            for q in batch:
                q.respond(error_response(q.msg.id, err))
        except Exception as exc:
            log.exception("batch failed", extra={"model": self.model})
            err = stage_fault(f"scheduler error: {exc}")
            for q in batch:  # the gateway ignores a second answer to one request
                q.respond(error_response(q.msg.id, err))
        finally:
            self.strategy.finished(batch, time.monotonic_ns())
            self.executing -= 1
            if not state.grant_returned:
                self._give_back(held, state.failed_instance)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, batch: list[Queued]) -> None:
        """Answer NOT_OWNER without running: another scheduler owns the model
        now and the gateway resends these requests there."""
        err = StageError.of(pb.NOT_OWNER, f"this scheduler no longer owns model '{self.model}'")
        for q in batch:
            q.respond(error_response(q.msg.id, err))
        if self.sequences is not None:
            self.sequences.dropped(batch)

    def refuse_pending(self) -> None:
        """Answer every queued request NOT_OWNER (the model moved away)."""
        failed = self.strategy.drain()
        self._depth_changed()
        self._refuse(failed)

    def _requeue(self, batch: list[Queued]) -> bool:
        """Put a batch whose instance went away back at the head of the queue."""
        if not self.strategy.requeue(batch):
            return False
        self._depth_changed()
        self._arrived.set()
        return True
