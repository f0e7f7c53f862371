"""Triton's sequence batcher for stateful models.

Requests of one sequence (correlation id) run one at a time, in order; a
batch takes at most one request per sequence. The scheduler fills the
control inputs (START / END / READY / CORRID, in the int32, fp32 or bool form
the config asks for) and the implicit state inputs, and keeps the state
outputs in Redis (sequence_store.py), so the worker stays stateless and any
scheduler process can continue a sequence.

Strategies:
- oldest: the oldest ready request of up to max_batch_size sequences, rows
  packed in age order;
- direct: each sequence owns a batch slot from its START to its END (or idle
  timeout); row i of a batch is slot i, and slots with nothing to run are
  padding rows with READY false. A START waits while every slot is taken.

Every accepted request is also an entry in its sequence's backlog in Redis
(sequence_store.py): the order of a sequence's requests, and which one may
run, is decided there, so several schedulers interleave one sequence in
arrival order. A request becomes eligible here once its entry is listed.

States with variable dims (-1, Triton's growable state) keep their shape in
Redis next to their bytes; a batch only joins sequences whose inputs and
states have the same shapes, the others run in a following batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.scheduler.clients import Granted, WorkerCallError
from services.scheduler.grant_pool import Held
from services.scheduler.model_queue import (
    ModelQueue,
    Queued,
    Respond,
    error_response,
    shape_key,
)
from services.scheduler.sequence_slots import DirectSlots, ready_in_age_order
from services.scheduler.sequence_store import (
    UNKNOWN,
    WAIT,
    Claim,
    SequenceStore,
    StateUpdate,
    sequence_key,
)
from stageserve.config import ControlInput, ModelSpec, StateSpec
from stageserve.errors import StageError, invalid, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import element_count, numpy_to_raw, serialize_bytes_elements

log = logging.getLogger(__name__)

# How soon to retry a sequence whose earlier request runs at another scheduler.
BUSY_RETRY_S = 0.005


@dataclass
class SeqQueued(Queued):
    entry: str = ""  # its backlog entry in Redis
    listed: bool = False  # the entry is in Redis: the request may run


# A claimed row: (cid, request, its states' raw bytes, their shapes)
Row = tuple[str, SeqQueued, dict[str, bytes], dict[str, tuple[int, ...]]]


class SequenceQueue(ModelQueue):
    def __init__(self, *args, store: SequenceStore, model_dir: Path, **kwargs) -> None:
        self.store = store
        self.model_dir = model_dir
        self.backlogs: dict[str, deque[SeqQueued]] = {}
        self._unlisted: list[tuple[str, SeqQueued]] = []  # entries not yet in Redis
        self._listing: asyncio.Task | None = None
        self._slot_timer: asyncio.TimerHandle | None = None
        self.running: set[str] = set()  # sequences with a request executing
        self.slots: DirectSlots[Row] = DirectSlots()  # the direct strategy's slots
        self.retry_at: dict[str, float] = {}  # busy elsewhere: not before this time
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------- intake

    def submit(self, msg: pb.ScheduleRequest, respond: Respond) -> None:
        cid = sequence_key(msg.sequence_id, msg.sequence_id_str)
        q = SeqQueued(msg, respond, time.monotonic_ns(), entry=self.store.new_entry())
        self.backlogs.setdefault(cid, deque()).append(q)
        self._unlisted.append((cid, q))
        self._depth_changed()
        if self._listing is None:
            self._listing = asyncio.create_task(self._list_arrivals())

    async def _list_arrivals(self) -> None:
        """Append new requests to their sequences' backlogs in Redis, in
        arrival order; each burst of arrivals is one round trip."""
        try:
            while self._unlisted:
                items, self._unlisted = self._unlisted, []
                try:
                    await self.store.enqueue([(cid, q.entry) for cid, q in items])
                except Exception as exc:  # Redis unreachable: answer, never hang
                    err = unavailable(f"sequence backlog in Redis unavailable: {exc}")
                    for cid, q in items:
                        if self._drop(cid, q):
                            q.respond(error_response(q.msg.id, err))
                    self._depth_changed()
                    continue
                gone = []
                for cid, q in items:
                    q.listed = True
                    if not self._queued(cid, q):  # answered meanwhile (_fail_all)
                        gone.append((cid, q.entry))
                if gone:
                    await self.store.forget(gone)
                self._arrived.set()
        except Exception:
            log.exception("listing sequence requests failed", extra={"model": self.model})
        finally:
            self._listing = None

    def _queued(self, cid: str, q: SeqQueued) -> bool:
        return any(x is q for x in self.backlogs.get(cid, ()))

    def _drop(self, cid: str, q: SeqQueued) -> bool:
        backlog = self.backlogs.get(cid)
        if backlog is None or not self._queued(cid, q):
            return False
        backlog.remove(q)
        if not backlog and cid not in self.running:
            del self.backlogs[cid]
        return True

    @property
    def pending(self) -> int:
        return sum(len(b) for b in self.backlogs.values())

    def _depth_changed(self) -> None:
        depth = self.pending
        self._depth_gauge.set(depth)

    def _fail_all(self, err: StageError) -> None:
        listed = []
        for cid in list(self.backlogs):
            if cid in self.running:
                continue
            for q in self.backlogs.pop(cid):
                q.respond(error_response(q.msg.id, err))
                if q.listed:
                    listed.append((cid, q.entry))
        self._depth_changed()
        if listed:
            self._spawn(self.store.forget(listed))

    def close(self) -> None:
        super().close()
        self.store.close()

    # ---------------------------------------------------------------- batches

    @property
    def _seqspec(self):
        assert self.spec.sequence is not None
        return self.spec.sequence

    def _direct(self) -> bool:
        return self._seqspec.strategy == "direct"

    def _capacity(self) -> int:
        return max(1, self.spec.max_batch_size)

    def _eligible(self) -> list[str]:
        """Sequences whose next request may run now, oldest first."""
        now = time.monotonic()
        ready = ready_in_age_order(
            ((cid, b[0].listed, b[0].enqueue_ns) for cid, b in self.backlogs.items() if b),
            self.running,
            self.retry_at,
            now,
        )
        if not self._direct():
            return ready
        idle_s = self._seqspec.max_idle_us / 1e6
        self.slots.free_idle(
            now, idle_s, lambda cid: cid in self.running or bool(self.backlogs.get(cid))
        )
        out = []
        for cid in ready:
            start = self.backlogs[cid][0].msg.sequence_start
            if self.slots.admit(cid, start, self._capacity(), time.monotonic()):
                out.append(cid)
            else:
                self._wake_when_a_slot_idles_out()
        return out

    def _wake_when_a_slot_idles_out(self) -> None:
        """A START waits for a slot: look again when the least recently used
        idle slot times out, not only when the next request arrives."""
        if self._slot_timer is not None:
            return
        expiry = self.slots.next_idle_expiry(self.running, self._seqspec.max_idle_us / 1e6)
        if expiry is None:
            return  # a running sequence's finish wakes the loop
        delay = max(0.0, expiry - time.monotonic())

        def wake() -> None:
            self._slot_timer = None
            self._arrived.set()

        self._slot_timer = asyncio.get_running_loop().call_later(delay + 0.001, wake)

    def _has_work(self) -> bool:
        return bool(self._eligible())

    async def _form_batch(self) -> list[Queued]:
        delay_ns = self._seqspec.max_queue_delay_us * 1000
        while True:
            eligible = self._eligible()
            if not eligible:
                return []
            oldest = self.backlogs[eligible[0]][0].enqueue_ns
            full = len(eligible) >= self._capacity()
            if full or not delay_ns or time.monotonic_ns() >= oldest + delay_ns:
                break
            await self._wait_arrival((oldest + delay_ns - time.monotonic_ns()) / 1e9)
        # Rows of one batch share their input shapes (the oldest one's).
        batching = self.spec.batching
        want = shape_key(self.backlogs[eligible[0]][0].msg, batching)
        chosen = [
            cid for cid in eligible if shape_key(self.backlogs[cid][0].msg, batching) == want
        ][: self._capacity()]
        batch = []
        for cid in chosen:
            batch.append(self.backlogs[cid].popleft())
            self.running.add(cid)
        self._depth_changed()
        return batch

    # -------------------------------------------------------------- execution

    async def _execute(self, batch: list[Queued], held: Held[Granted]) -> None:
        grant = held.grant
        failed_instance: bool | None = False
        seqs: list[SeqQueued] = [q for q in batch if isinstance(q, SeqQueued)]
        cids = [sequence_key(q.msg.sequence_id, q.msg.sequence_id_str) for q in seqs]
        unsettled: dict[str, str] = {}  # claimed entries not yet committed: cid -> entry
        try:
            claims = await self.store.claim(
                [
                    (cid, q.entry, q.msg.sequence_start, self.slots.slot(cid))
                    for cid, q in zip(cids, seqs, strict=True)
                ]
            )
            claimed: list[tuple[Row, int]] = []
            for cid, q, claim in zip(cids, seqs, claims, strict=True):
                if claim.status == WAIT:  # an earlier request runs elsewhere: soon again
                    self._put_back(cid, q, BUSY_RETRY_S)
                elif claim.status == UNKNOWN:
                    self.running.discard(cid)
                    self.slots.release(cid)
                    q.respond(error_response(q.msg.id, self._unknown(q, self.store.lost(cid))))
                else:
                    unsettled[cid] = q.entry
                    claimed.append(((cid, q, *self._start_states(q, claim)), claim.slot))
            claimed = self._same_state_shapes(claimed, unsettled)
            if not claimed:
                return
            rows = self._rows(claimed)
            try:
                request = self._execute_request(grant.instance_id, rows)
            except StageError as err:
                await self._settle_failed(claimed, err, unsettled)
                return
            compute_start = time.monotonic_ns()
            try:
                resp = await self.workers.execute(grant.worker_address, request)
            except WorkerCallError as exc:
                err, failed_instance = self._execution_error(exc, grant)
                await self._settle_failed(claimed, err, unsettled)
                return
            await self._finish(rows, resp, compute_start)
            unsettled.clear()
        finally:
            if unsettled:  # an unexpected error: free the sequences' backlogs
                self._spawn(self.store.forget(list(unsettled.items())))
            for cid in cids:
                self.running.discard(cid)
                self.slots.touch(cid, time.monotonic())
                if cid in self.backlogs and not self.backlogs[cid]:
                    del self.backlogs[cid]
            self.executing -= 1
            self._give_back(held, failed_instance)
            self._arrived.set()

    def _put_back(self, cid: str, q: SeqQueued, delay_s: float) -> None:
        """Return a request to the head of its backlog, eligible after delay_s."""
        self.backlogs.setdefault(cid, deque()).appendleft(q)
        self.running.discard(cid)
        if delay_s:
            self.retry_at[cid] = time.monotonic() + delay_s
            asyncio.get_running_loop().call_later(delay_s, self._arrived.set)
        self._depth_changed()

    async def _settle_failed(
        self, claimed: list[tuple[Row, int]], err: StageError, unsettled: dict[str, str]
    ) -> None:
        """A failed execution leaves each sequence's state as it was."""
        await self.store.commit([(cid, q.entry, False, None) for (cid, q, _, _), _ in claimed])
        unsettled.clear()
        for (_, q, _, _), _ in claimed:
            q.respond(error_response(q.msg.id, err))

    def _start_states(
        self, q: SeqQueued, claim: Claim
    ) -> tuple[dict[str, bytes], dict[str, tuple[int, ...]]]:
        """The states a request runs with: the kept ones, or initial at START."""
        if q.msg.sequence_start:
            return {}, {}
        return claim.states, claim.shapes

    def _state_shape(self, state: StateSpec, row: Row) -> tuple[int, ...]:
        _, q, states, shapes = row
        if q.msg.sequence_start or state.output_name not in states:
            return state.initial_dims
        return shapes.get(state.output_name, state.initial_dims)

    def _same_state_shapes(
        self, claimed: list[tuple[Row, int]], unsettled: dict[str, str]
    ) -> list[tuple[Row, int]]:
        """Keep the rows whose variable states match the first row's shapes; the
        others go back (still heading their backlogs) for the next batch."""
        variable = [s for s in self._seqspec.states if s.variable]
        if not variable or len(claimed) < 2:
            return claimed

        def key(row: Row) -> tuple:
            return tuple(self._state_shape(s, row) for s in variable)

        want = key(claimed[0][0])
        keep = []
        for row, slot in claimed:
            if key(row) == want:
                keep.append((row, slot))
            else:
                unsettled.pop(row[0], None)
                self._put_back(row[0], row[1], 0.0)
        return keep

    def _unknown(self, q: Queued, lost: bool = False) -> StageError:
        ident = q.msg.sequence_id_str or q.msg.sequence_id
        if lost:
            # Beyond Triton (whose sequence state dies with the server): the
            # state store lost it (Redis restarted empty); starting over from
            # zero would answer wrongly, so the client is told to resend.
            return invalid(
                f"inference request for sequence {ident} to model '{self.model}': the "
                f"sequence's state was lost (the state store restarted); resend the sequence "
                f"from its START request"
            )
        return invalid(
            f"inference request for sequence {ident} to model '{self.model}' must specify the "
            f"START flag on the first request of the sequence (or the sequence idled out after "
            f"{self._seqspec.max_idle_us} us)"
        )

    def _rows(self, claimed: list[tuple[Row, int]]) -> list[Row | None]:
        """Batch rows; for direct, row i is slot i and gaps are padding (None)."""
        if not self._direct():
            return [row for row, _ in claimed]
        return self.slots.layout([(row[0], row, slot) for row, slot in claimed], self._capacity())

    def _execute_request(self, instance_id: str, rows: list[Row | None]) -> pb.ExecuteRequest:
        spec = self.spec
        seq = self._seqspec
        real = [r for r in rows if r is not None]
        head = real[0][1].msg
        req = pb.ExecuteRequest(instance_id=instance_id)
        n = len(rows)
        batch_dim = [n] if spec.batching else []
        for i, t in enumerate(head.inputs):
            parts = []
            for r in rows:
                parts.append(r[1].msg.inputs[i].raw if r is not None else _padding(t))
            req.inputs.append(
                pb.Tensor(
                    name=t.name,
                    datatype=t.datatype,
                    shape=batch_dim + list(t.shape[1:] if spec.batching else t.shape),
                    raw=b"".join(parts),
                )
            )
        for control in seq.controls:
            req.inputs.append(_control_tensor(control, rows, batch_dim))
        for state in seq.states:
            shape = self._state_shape(state, real[0])  # every real row has it
            raw = b"".join(
                self._state_row(state, r, shape) if r else self._initial(state, shape) for r in rows
            )
            req.inputs.append(
                pb.Tensor(
                    name=state.input_name,
                    datatype=state.datatype.triton,
                    shape=batch_dim + list(shape),
                    raw=raw,
                )
            )
        state_outputs = [s.output_name for s in seq.states]
        for r in rows:
            req.request_batch_sizes.append(1)
            if r is None:
                req.requested.add(names=state_outputs)
            else:
                wanted = list(r[1].msg.outputs) or [o.name for o in spec.outputs]
                req.requested.add(names=wanted + [s for s in state_outputs if s not in wanted])
        return req

    def _state_row(self, state: StateSpec, row: Row, shape: tuple[int, ...]) -> bytes:
        _, q, states, _ = row
        if not q.msg.sequence_start and state.output_name in states:
            return states[state.output_name]
        return self._initial(state, shape)

    def _initial(self, state: StateSpec, shape: tuple[int, ...]) -> bytes:
        size = element_count(shape) * max(state.datatype.item_size, 1)
        if state.initial_file and shape == state.initial_dims:
            path = self.model_dir / "initial_state" / state.initial_file
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise invalid(f"initial state file {path} unreadable: {exc}") from exc
            if len(data) != size:
                raise invalid(f"initial state file {path} holds {len(data)} bytes, needs {size}")
            return data
        return b"\0" * size

    async def _finish(
        self, rows: list[Row | None], resp: pb.ExecuteResponse, compute_start: int
    ) -> None:
        seq = self._seqspec
        state_names = {s.output_name for s in seq.states}
        declared = {o.name for o in self.spec.outputs}
        skip = 1 if self.spec.batching else 0  # a row's state shape has no batch dim
        commits = []
        answers = []
        leader = True
        total = len(rows)
        for r, result in zip(rows, resp.results, strict=True):
            if r is None:
                continue
            cid, q, _, _ = r
            new_states = {
                t.name: StateUpdate(t.raw, tuple(t.shape[skip:]))
                for t in result.outputs
                if t.name in state_names
            }
            commits.append((cid, q.entry, q.msg.sequence_end, new_states))
            if q.msg.sequence_end:
                self.slots.release(cid)
            outputs = [t for t in result.outputs if t.name not in state_names or t.name in declared]
            timing = pb.Timing(
                queue_ns=compute_start - q.enqueue_ns,
                compute_input_ns=resp.compute_input_ns,
                compute_infer_ns=resp.compute_infer_ns,
                compute_output_ns=resp.compute_output_ns,
                batch_size=total,
                batch_leader=leader,
            )
            leader = False
            answers.append((q, pb.ScheduleResponse(id=q.msg.id, outputs=outputs, timing=timing)))
        self._batch_hist.observe(total)
        # State first, answers second: a client that sends its next request the
        # moment it has this answer must find the new state in Redis.
        await self.store.commit(commits)
        for q, answer in answers:
            q.respond(answer)


def _padding(t: pb.Tensor) -> bytes:
    """One row of zeros (or empty strings) shaped like `t`'s rows."""
    if t.datatype == "BYTES":
        return serialize_bytes_elements([b""] * element_count(t.shape[1:]))
    rows = t.shape[0] if t.shape else 1
    return b"\0" * (len(t.raw) // max(rows, 1))


def _control_tensor(control: ControlInput, rows, batch_dim: list[int]) -> pb.Tensor:
    dt = control.datatype
    values: list = []
    for r in rows:
        msg = r[1].msg if r is not None else None
        if control.kind == "CONTROL_SEQUENCE_CORRID":
            if msg is None:
                values.append("" if dt.triton == "BYTES" else 0)
            elif dt.triton == "BYTES":
                values.append(msg.sequence_id_str or str(msg.sequence_id))
            elif msg.sequence_id_str:
                raise invalid(
                    f"string correlation id '{msg.sequence_id_str}' cannot fill the "
                    f"{dt.triton} CORRID control '{control.name}'"
                )
            else:
                values.append(msg.sequence_id)
            continue
        flag = (
            msg is not None
            and {
                "CONTROL_SEQUENCE_START": msg.sequence_start,
                "CONTROL_SEQUENCE_END": msg.sequence_end,
                "CONTROL_SEQUENCE_READY": True,
            }[control.kind]
        )
        values.append(control.true_value if flag else control.false_value)
    shape = [*batch_dim, 1] if batch_dim else [1]
    if dt.triton == "BYTES":
        raw = serialize_bytes_elements(values)
    else:
        raw = numpy_to_raw(np.asarray(values, dtype=dt.numpy).reshape(shape), dt)
    return pb.Tensor(name=control.name, datatype=dt.triton, shape=shape, raw=raw)


def make_sequence_queue(
    model: str,
    version: int,
    spec: ModelSpec,
    ratelimiter,
    workers,
    redis,
    model_dir: Path,
) -> SequenceQueue:
    assert spec.sequence is not None
    store = SequenceStore(redis, model, version, spec.sequence.max_idle_us // 1000)
    return SequenceQueue(
        model, version, spec, ratelimiter, workers, store=store, model_dir=model_dir
    )
