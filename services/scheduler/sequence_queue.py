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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import numpy as np

from services.scheduler.clients import Granted, WorkerCallError
from services.scheduler.model_queue import ModelQueue, Queued, Respond, error_response
from services.scheduler.sequence_store import BUSY, UNKNOWN, SequenceStore, sequence_key
from stageserve.config import ControlInput, ModelSpec, StateSpec
from stageserve.errors import StageError, invalid
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import element_count, numpy_to_raw, serialize_bytes_elements

# How soon to retry a sequence another scheduler is executing.
BUSY_RETRY_S = 0.005


class SequenceQueue(ModelQueue):
    def __init__(self, *args, store: SequenceStore, model_dir: Path, **kwargs) -> None:
        self.store = store
        self.model_dir = model_dir
        self.backlogs: dict[str, deque[Queued]] = {}
        self.running: set[str] = set()  # sequences with a request executing
        self.slots: dict[str, tuple[int, float]] = {}  # direct: cid -> (slot, last use)
        self.retry_at: dict[str, float] = {}  # busy elsewhere: not before this time
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------- intake

    def submit(self, msg: pb.ScheduleRequest, respond: Respond) -> None:
        cid = sequence_key(msg.sequence_id, msg.sequence_id_str)
        self.backlogs.setdefault(cid, deque()).append(Queued(msg, respond, time.monotonic_ns()))
        self._depth_changed()
        self._arrived.set()

    @property
    def pending(self) -> int:
        return sum(len(b) for b in self.backlogs.values())

    def _depth_changed(self) -> None:
        depth = self.pending
        self._depth_gauge.set(depth)

    def _fail_all(self, err: StageError) -> None:
        for cid in list(self.backlogs):
            if cid in self.running:
                continue
            for q in self.backlogs.pop(cid):
                q.respond(error_response(q.msg.id, err))
        self._depth_changed()

    # ---------------------------------------------------------------- batches

    @property
    def _seqspec(self):
        assert self.spec.sequence is not None
        return self.spec.sequence

    def _direct(self) -> bool:
        return self._seqspec.strategy == "direct"

    def _capacity(self) -> int:
        return max(1, self.spec.max_batch_size)

    def _free_idle_slots(self) -> None:
        idle_s = self._seqspec.max_idle_us / 1e6
        now = time.monotonic()
        for cid, (_, last) in list(self.slots.items()):
            if now - last > idle_s and cid not in self.running and not self.backlogs.get(cid):
                del self.slots[cid]

    def _eligible(self) -> list[str]:
        """Sequences whose next request may run now, oldest first."""
        now = time.monotonic()
        ready = [
            cid
            for cid, backlog in self.backlogs.items()
            if backlog and cid not in self.running and self.retry_at.get(cid, 0.0) <= now
        ]
        ready.sort(key=lambda cid: self.backlogs[cid][0].enqueue_ns)
        if not self._direct():
            return ready
        self._free_idle_slots()
        out = []
        for cid in ready:
            head = self.backlogs[cid][0]
            if head.msg.sequence_start:
                self.slots.pop(cid, None)  # START on an active id: a new sequence
            if cid in self.slots or self._free_slot() is not None:
                out.append(cid)
                if cid not in self.slots:
                    self.slots[cid] = (self._free_slot(), time.monotonic())
        return out

    def _free_slot(self) -> int | None:
        used = {slot for slot, _ in self.slots.values()}
        return next((s for s in range(self._capacity()) if s not in used), None)

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
        chosen = eligible[: self._capacity()]
        batch = []
        for cid in chosen:
            batch.append(self.backlogs[cid].popleft())
            self.running.add(cid)
        self._depth_changed()
        return batch

    # -------------------------------------------------------------- execution

    async def _execute(self, batch: list[Queued], grant: Granted, since: float) -> None:
        failed_instance: bool | None = False
        cids = [sequence_key(q.msg.sequence_id, q.msg.sequence_id_str) for q in batch]
        claimed: list[tuple[str, Queued, dict[str, bytes], int]] = []
        try:
            claims = await self.store.claim(
                [
                    (cid, q.msg.sequence_start, self.slots.get(cid, (-1, 0.0))[0])
                    for cid, q in zip(cids, batch, strict=True)
                ]
            )
            for cid, q, claim in zip(cids, batch, claims, strict=True):
                if claim.status == BUSY:  # another scheduler runs it: try again soon
                    self.backlogs.setdefault(cid, deque()).appendleft(q)
                    self.running.discard(cid)
                    self.retry_at[cid] = time.monotonic() + BUSY_RETRY_S
                    asyncio.get_running_loop().call_later(BUSY_RETRY_S, self._arrived.set)
                elif claim.status == UNKNOWN:
                    self.running.discard(cid)
                    self.slots.pop(cid, None)
                    q.respond(error_response(q.msg.id, self._unknown(q)))
                else:
                    claimed.append((cid, q, claim.states, claim.slot))
            if not claimed:
                return
            rows = self._rows(claimed)
            try:
                request = self._execute_request(grant.instance_id, rows)
            except StageError as err:
                await self.store.commit([(cid, False, None) for cid, *_ in claimed])
                for _, q, _, _ in claimed:
                    q.respond(error_response(q.msg.id, err))
                return
            compute_start = time.monotonic_ns()
            try:
                resp = await self.workers.execute(grant.worker_address, request)
            except WorkerCallError as exc:
                err, failed_instance = self._execution_error(exc, grant)
                await self.store.commit([(cid, False, None) for cid, *_ in claimed])
                for _, q, _, _ in claimed:
                    q.respond(error_response(q.msg.id, err))
                return
            await self._finish(rows, resp, compute_start)
        finally:
            for cid in cids:
                self.running.discard(cid)
                if cid in self.slots:
                    self.slots[cid] = (self.slots[cid][0], time.monotonic())
                if cid in self.backlogs and not self.backlogs[cid]:
                    del self.backlogs[cid]
            self.executing -= 1
            self._give_back(grant, since, failed_instance)
            self._arrived.set()

    def _unknown(self, q: Queued) -> StageError:
        ident = q.msg.sequence_id_str or q.msg.sequence_id
        return invalid(
            f"inference request for sequence {ident} to model '{self.model}' must specify the "
            f"START flag on the first request of the sequence (or the sequence idled out after "
            f"{self._seqspec.max_idle_us} us)"
        )

    def _rows(self, claimed) -> list[tuple[str, Queued, dict[str, bytes]] | None]:
        """Batch rows; for direct, row i is slot i and gaps are padding (None)."""
        if not self._direct():
            return [(cid, q, states) for cid, q, states, _ in claimed]
        by_slot = {}
        spill = []
        for cid, q, states, slot in claimed:
            slot = self.slots.get(cid, (slot, 0.0))[0]
            if 0 <= slot < self._capacity() and slot not in by_slot:
                by_slot[slot] = (cid, q, states)
            else:
                spill.append((cid, q, states))
        rows: list = [by_slot.get(i) for i in range(max(by_slot, default=-1) + 1)]
        for item in spill:  # a slot clash (e.g. after a restart): use a gap
            gap = rows.index(None) if None in rows else len(rows)
            if gap == len(rows):
                rows.append(item)
            else:
                rows[gap] = item
        return rows

    def _execute_request(self, instance_id: str, rows) -> pb.ExecuteRequest:
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
            raw = b"".join(
                self._state_row(state, r[1].msg.sequence_start, r[2]) if r else self._initial(state)
                for r in rows
            )
            req.inputs.append(
                pb.Tensor(
                    name=state.input_name,
                    datatype=state.datatype.triton,
                    shape=batch_dim + list(state.dims),
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

    def _state_row(self, state: StateSpec, start: bool, states: dict[str, bytes]) -> bytes:
        if not start and state.output_name in states:
            return states[state.output_name]
        return self._initial(state)

    def _initial(self, state: StateSpec) -> bytes:
        size = element_count(state.dims) * max(state.datatype.item_size, 1)
        if state.initial_file:
            path = self.model_dir / "initial_state" / state.initial_file
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise invalid(f"initial state file {path} unreadable: {exc}") from exc
            if len(data) != size:
                raise invalid(f"initial state file {path} holds {len(data)} bytes, needs {size}")
            return data
        return b"\0" * size

    async def _finish(self, rows, resp: pb.ExecuteResponse, compute_start: int) -> None:
        seq = self._seqspec
        state_names = {s.output_name for s in seq.states}
        declared = {o.name for o in self.spec.outputs}
        commits = []
        answers = []
        leader = True
        total = len(rows)
        for r, result in zip(rows, resp.results, strict=True):
            if r is None:
                continue
            cid, q, _ = r
            new_states = {t.name: t.raw for t in result.outputs if t.name in state_names}
            commits.append((cid, q.msg.sequence_end, new_states))
            if q.msg.sequence_end:
                self.slots.pop(cid, None)
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
