"""One formed batch on its instance: the worker call and every request's answer.

ModelQueue (model_queue.py) forms a batch on a held grant and hands it
here. A run builds the worker's request (for a sequence model, after the
sequences' adapter claimed the batch in Redis), calls the worker, and
answers each request: its outputs, its own error (a Python model's
response), or the batch's error mapped to Triton's status code. A
decoupled model's responses are forwarded as the worker streams them
(decoupled.py). What the queue must know afterwards, however the run ended
(an exception included), is in the RunState it passed in: whether the
instance failed, and whether the grant already went back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.scheduler.batch_spans import start_batch_spans
from services.scheduler.batch_strategy import Queued
from services.scheduler.clients import Granted, WorkerCallError, WorkerClients
from services.scheduler.decoupled import DecoupledBatch
from services.scheduler.execute_request import build_execute_request, error_response
from stageserve.config import ModelSpec
from stageserve.errors import StageError, unavailable
from stageserve.generated import stageserve_pb2 as pb

if TYPE_CHECKING:
    from services.scheduler.sequence_queue import SequenceIO

log = logging.getLogger(__name__)

_NONE_HIDDEN: frozenset[str] = frozenset()  # outputs a batch keeps from its answers

Deliver = Callable[[Queued, pb.ScheduleResponse], None]

#: a worker's answers that fail the batch but not the instance, passed on as
#: they are (TENSOR_REGION_NOT_LOCAL: the worker cannot map a gateway's
#: shared-memory input, the gateway resends inline: stageserve/tensor_shm.py)
_MODEL_FAILURES = frozenset({pb.BACKEND_FAILED, pb.INVALID_INPUT, pb.TENSOR_REGION_NOT_LOCAL})


@dataclass
class RunState:
    """What a batch's run tells its queue, even when it ends by an exception."""

    # False: the instance is fine; True: it failed (release the grant as
    # failed); None: it went away (release without blaming the worker).
    failed_instance: bool | None = False
    # A decoupled batch handed its grant back when execute returned (its
    # responses may still be coming): the queue must not give it back again.
    grant_returned: bool = False


class BatchRun:
    """Runs the batches of one model version (one per ModelQueue).

    `deliver` answers a request (the queue's, which keeps preserve_ordering);
    `requeue` puts a batch whose instance went away back at the head of the
    queue, False when it cannot; `batch_sizes` observes each batch's size."""

    def __init__(
        self,
        model: str,
        workers: WorkerClients,
        sequences: SequenceIO | None,
        deliver: Deliver,
        requeue: Callable[[list[Queued]], bool],
        batch_sizes: Any,
    ) -> None:
        self.model = model
        self.workers = workers
        self.sequences = sequences
        self.deliver = deliver
        self.requeue = requeue
        self.batch_sizes = batch_sizes

    async def run(
        self,
        spec: ModelSpec,
        batch: list[Queued],
        grant: Granted,
        state: RunState,
        give_back: Callable[[], None],
        formed_ns: int = 0,
    ) -> None:
        """Execute `batch` on `grant`'s instance and answer it. `give_back`
        returns the grant early: a decoupled batch's when its execute returned,
        a stateless batch's when its result came back (before its answers);
        otherwise the queue returns it once this ends. `formed_ns`: when the
        strategy picked the batch (traced requests' "batch" span starts)."""
        if log.isEnabledFor(logging.DEBUG):  # Triton's verbose level 1
            extra = {"model": self.model, "size": len(batch), "instance": grant.instance_id}
            log.debug("batch formed", extra=extra)
        job = None
        # Before the try: a sequence batch can end before it is built (nothing
        # claimable, Redis down) and the finally reads it.
        decoupled: DecoupledBatch[Queued] | None = None
        # A decoupled sequence batch's final answers, held until its commit:
        # "state first, answers second", as for any sequence batch.
        finals: list[tuple[Queued, pb.ScheduleResponse]] = []
        try:
            compute_start = time.monotonic_ns()
            if self.sequences is None:
                rows: Sequence[Queued | None] = batch
                hidden = _NONE_HIDDEN
                request = build_execute_request(
                    grant.instance_id,
                    batch,
                    spec.batching,
                    spec.ragged_inputs,
                    request_info=spec.backend == "python",
                )
            else:  # claims the sequences in Redis; some may wait or be refused
                job = await self.sequences.prepare(batch, grant.instance_id)
                if job is None:
                    return
                rows, hidden, request = job.rows, job.hidden, job.request
                compute_start = time.monotonic_ns()
            if spec.decoupled:

                def returned() -> None:
                    state.grant_returned = True
                    give_back()

                decoupled = DecoupledBatch(
                    rows,
                    compute_start,
                    sum(request.request_batch_sizes),
                    # A sequence's finals wait for its commit (below).
                    self.deliver if job is None else lambda q, r: finals.append((q, r)),
                    # execute returned: the instance is free, its senders go
                    # on. A sequence batch keeps its instance to its last
                    # final, so its next request runs after this one ended.
                    on_returned=returned if job is None else None,
                )
            spans = None
            if any(q is not None and q.msg.traceparent for q in rows):
                spans = await start_batch_spans(
                    rows, request, grant.instance_id, formed_ns or compute_start
                )
            try:
                resp = await self.workers.execute(
                    grant.worker_address, request, decoupled.on_part if decoupled else None
                )
            except WorkerCallError as exc:
                if spans is not None:
                    spans.end(time.monotonic_ns(), exc.details or "execution failed")
                    spans = None
                err, state.failed_instance = self._execution_error(exc, grant)
                ran = decoupled is not None and (decoupled.sent_any or decoupled.returned)
                if state.failed_instance is None and not ran and self.requeue(batch):
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
                        self.deliver(q, error_response(q.msg.id, err))
                return
            if spans is not None:
                spans.end(time.monotonic_ns())
            if decoupled is not None:
                decoupled.finish(None)
                if job is not None:  # a decoupled model's states: not supported (config.py)
                    await job.commit(None)
                self._deliver_all(finals)
                return
            # The instance is free now: the next batch may start before this
            # one's answers go out (ModelQueue._instance_free), and before a
            # sequence batch's commit: the next batch holds other sequences,
            # as these stay running until this run ends (strategy.finished).
            state.grant_returned = True
            give_back()
            failed: dict[int, StageError] = {}
            if job is not None:
                # State first, answers second: a client that sends its next
                # request the moment it has this answer must find the new
                # state in Redis.
                failed = await job.commit(resp)
            self._answer(rows, hidden, request, resp, compute_start, failed)
        finally:
            if job is not None:
                job.close()

    def _deliver_all(self, answers: list[tuple[Queued, pb.ScheduleResponse]]) -> None:
        for q, response in answers:
            self.deliver(q, response)

    def _answer(
        self,
        rows: Sequence[Queued | None],
        hidden: frozenset[str],
        request: pb.ExecuteRequest,
        resp: pb.ExecuteResponse,
        compute_start: int,
        failed: dict[int, StageError] | None = None,
    ) -> None:
        """Each request's outputs (less `hidden` ones) or its own error, or
        the error `failed` gives its row; None rows are padding."""
        total = sum(request.request_batch_sizes)
        self.batch_sizes.observe(total)
        # Each answer's timing is set field by field in the answer: a Timing
        # built apart is copied into it (3.5-4.4 -> 2.8 us per request of
        # batches of 20, `python -m bench.scheduler_work`; docs/benchmarks.md,
        # "The scheduler's own work per request").
        c_input, c_infer, c_output = (
            resp.compute_input_ns,
            resp.compute_infer_ns,
            resp.compute_output_ns,
        )
        leader = True
        deliver = self.deliver
        for i, (q, result) in enumerate(zip(rows, resp.results, strict=True)):
            if q is None:
                continue
            msg = q.msg
            if failed and i in failed:
                deliver(q, error_response(msg.id, failed[i]))
                continue
            if result.failure:  # a per-request error (a Python model's response)
                answer = pb.ScheduleResponse(
                    id=msg.id, failure=result.failure, message=result.message, model_error=True
                )
            elif hidden:
                answer = pb.ScheduleResponse(id=msg.id, outputs=_shown(result.outputs, hidden))
            else:
                answer = pb.ScheduleResponse(id=msg.id, outputs=result.outputs)
            timing = answer.timing
            timing.queue_ns = compute_start - q.enqueue_ns
            timing.compute_input_ns = c_input
            timing.compute_infer_ns = c_infer
            timing.compute_output_ns = c_output
            timing.batch_size = total
            if leader:
                timing.batch_leader = True
                leader = False
            if msg.traceparent:
                timing.enqueue_ns = q.enqueue_ns
                timing.execute_end_ns = time.monotonic_ns()
            deliver(q, answer)

    def _execution_error(
        self, exc: WorkerCallError, grant: Granted
    ) -> tuple[StageError, bool | None]:
        """The clients' error, and whether the instance failed (None: it is gone,
        release the grant without blaming the worker)."""
        code = exc.code
        if exc.reason in _MODEL_FAILURES:  # the model, not the worker, failed the batch
            return StageError.of(exc.reason, exc.details or "model execution failed"), False
        if exc.reason == pb.MODEL_NOT_FOUND:  # the instance was unloaded meanwhile
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


def _shown(outputs: Sequence[pb.Tensor], hidden: frozenset[str]) -> Sequence[pb.Tensor]:
    """`outputs` less the `hidden` ones. A sequence batch asks for its state
    outputs after the client's (sequence_queue.py), so they end the list and
    a slice drops them: ~1.2 us less per answer of six outputs than a
    filtered copy (docs/benchmarks.md, "A sequence batch's scheduler work")."""
    k = len(outputs)
    while k and outputs[k - 1].name in hidden:
        k -= 1
    if len(outputs) - k == len(hidden):  # every hidden one (each appears once) ends it
        return outputs[:k]
    return [t for t in outputs if t.name not in hidden]
