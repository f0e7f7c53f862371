"""A decoupled model's responses, forwarded per request as the worker sends them.

A decoupled (Python) model answers each request of a batch with any number of
responses and then a final flag, possibly after execute returned. The worker
streams them as `ExecuteResponse(more=true, parts=...)`; each becomes a
ScheduleResponse for its request at once, `more` set until that request's
final one. Whatever the batch's outcome, every request gets exactly one
final answer.

A message with `execute_returned` says the model's execute returned while
some request still waits for its final: the instance takes its next batch
then (as in Triton), so the grant goes back (`on_returned`) while this
batch keeps forwarding the parts still to come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb


class _Queued(Protocol):
    msg: pb.ScheduleRequest
    enqueue_ns: int

    def respond(self, response: pb.ScheduleResponse) -> None: ...


Q = TypeVar("Q", bound=_Queued)


def _respond(q: _Queued, response: pb.ScheduleResponse) -> None:
    q.respond(response)


class DecoupledBatch(Generic[Q]):
    """`deliver` sends each request's final answer (the queue's, which keeps
    preserve_ordering); earlier responses go straight to the request;
    `on_returned` runs once, when the worker says execute returned."""

    def __init__(
        self,
        batch: Sequence[Q | None],
        compute_start_ns: int,
        total: int,
        deliver: Callable[[Q, pb.ScheduleResponse], None] = _respond,
        on_returned: Callable[[], None] | None = None,
    ) -> None:
        self.batch = batch
        self.deliver = deliver
        self.on_returned = on_returned
        self.compute_start_ns = compute_start_ns
        self.total = total
        self.finished: set[int] = set()
        # The first real request (rows before it may be padding) leads.
        self._leader = next((i for i, q in enumerate(batch) if q is not None), 0)
        self.sent_any = False
        self.returned = False  # execute returned before the batch's last message

    def on_part(self, resp: pb.ExecuteResponse) -> None:
        if resp.execute_returned and not self.returned:
            self.returned = True
            if self.on_returned is not None:
                self.on_returned()
        for part in resp.parts:
            index = part.request_index
            if index >= len(self.batch) or index in self.finished:
                continue
            q = self.batch[index]
            if q is None:  # a sequence batcher's padding row: nobody waits for it
                continue
            out = pb.ScheduleResponse(
                id=q.msg.id, more=not part.final, no_response=not part.has_response
            )
            if part.has_response and part.response.failure:
                out.failure, out.message = part.response.failure, part.response.message
            elif part.has_response:
                out.outputs.extend(part.response.outputs)
            if part.final:
                self.finished.add(index)
                out.timing.CopyFrom(self._timing(index))
                out.timing.compute_infer_ns = part.compute_infer_ns
            self.sent_any = True
            if part.final:
                self.deliver(q, out)
            else:
                q.respond(out)

    def finish(self, err: StageError | None) -> None:
        """The batch ended: requests still open get the error (or an empty final)."""
        for index, q in enumerate(self.batch):
            if index in self.finished or q is None:
                continue
            self.finished.add(index)
            out = pb.ScheduleResponse(id=q.msg.id, timing=self._timing(index))
            if err is not None:
                out.failure, out.message = err.reason, err.message
            else:
                out.no_response = True
            self.deliver(q, out)

    def _timing(self, index: int) -> pb.Timing:
        q = self.batch[index]
        assert q is not None
        return pb.Timing(
            queue_ns=self.compute_start_ns - q.enqueue_ns,
            batch_size=self.total,
            batch_leader=index == self._leader,
        )
