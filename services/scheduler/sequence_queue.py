"""Triton's sequence batcher for stateful models: the Redis adapter.

Requests of one sequence (correlation id) run one at a time, in order; a
batch takes at most one request per sequence. The scheduler fills the
control inputs (START / END / READY / CORRID, in the int32, fp32 or bool form
the config asks for) and the implicit state inputs, and keeps the state
outputs in Redis (sequence_store.py), so the worker stays stateless and any
scheduler process can continue a sequence.

Which requests form a batch is SequenceStrategy's (sequence_strategy.py, no
I/O); the dispatch loop is ModelQueue's, as for every model. This module is
the I/O around them: `SequenceIO` lists each accepted request in its
sequence's backlog in Redis (the order of a sequence's requests, and which
one may run, is decided there, so several schedulers interleave one
sequence in arrival order; a request becomes eligible once its entry is
listed), claims a formed batch's sequences and their states before it runs
(`prepare`), and commits the new states after (`SequenceJob`).

While this scheduler owns the model (sharding: a shard term, shard_lua.py),
every commit checks the term, so only the model's current owner keeps
states, and a request needs no listing or claim when it has nothing to
read: a START, or a request of a sequence whose last batch this scheduler
committed in the term (its states are kept here, sequence_cache.py). The
commit is then its one Redis call. Other requests, and every request
without sharding (no term), are listed and claimed.

States with variable dims (-1, Triton's growable state) keep their shape in
Redis next to their bytes; a batch only joins sequences whose inputs and
states have the same shapes, the others run in a following batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from services.scheduler.batch_strategy import Queued
from services.scheduler.execute_request import add_request_info, error_response
from services.scheduler.model_queue import ModelQueue
from services.scheduler.sequence_cache import Kept, SequenceCache
from services.scheduler.sequence_controls import ControlFill
from services.scheduler.sequence_store import (
    UNKNOWN,
    WAIT,
    Claim,
    Finished,
    PinsSnapshot,
    SequenceStore,
    StateUpdate,
)
from services.scheduler.sequence_strategy import SequenceStrategy
from stageserve.config import ModelSpec, SequenceBatching, StateSpec
from stageserve.errors import StageError, invalid, unavailable
from stageserve.generated import stageserve_pb2 as pb
from stageserve.script_lane import ScriptLane
from stageserve.settings import SchedulerSettings
from stageserve.tensors import element_count, serialize_bytes_elements

log = logging.getLogger(__name__)

# How soon to retry a sequence whose earlier request runs at another scheduler.
BUSY_RETRY_NS = 5_000_000

# A claimed request's kept states: (raw bytes, shapes) by state output name.
States = tuple[dict[str, bytes], dict[str, tuple[int, ...]]]


class SequenceIO:
    """The sequences' Redis side, for ModelQueue: listing, claims, commits."""

    def __init__(
        self,
        store: SequenceStore,
        strategy: SequenceStrategy,
        model: str,
        model_dir: Path,
        cache_capacity: int = 0,
    ) -> None:
        self.store = store
        self.strategy = strategy
        self.model = model
        self.model_dir = model_dir
        self.cache = SequenceCache(cache_capacity)
        # The model's shard term while this scheduler owns it (the service
        # sets it from ShardMember.term); None: no kept states are used.
        self.term: Callable[[], str | None] = lambda: None
        self._unlisted: list[Queued] = []  # accepted, entries not yet in Redis
        self._listing: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._changed: Callable[[], None] = lambda: None
        self._fills: list[ControlFill] = []
        self._fills_for: SequenceBatching | None = None
        self._state_names: frozenset[str] = frozenset()
        self._names_for: SequenceBatching | None = None
        # the strategy's pins (a reload makes new ones) and version last saved
        self._pins_saved: tuple[int, int] = (0, 0)
        self._pins_serial = itertools.count()

    def bind(self, changed: Callable[[], None]) -> None:
        """`changed`: the queue's depth or eligibility changed (wakes its loop)."""
        self._changed = changed

    def close(self) -> None:
        self.cache.clear()
        self.store.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- intake

    def _unclaimed(self, q: Queued, term: str | None, now: float) -> Kept | None:
        """What `q` runs with, when it needs no claim in this term."""
        if term is None or not self.cache.capacity:  # capacity 0: all claimed
            return None
        kept = self.cache.get(q.cid, term, now)
        if q.msg.sequence_start:
            return Kept(term, self.strategy.slot(q.cid), {}, {}, now)
        return kept

    def accepted(self, q: Queued) -> None:
        if self._unclaimed(q, self.term(), time.monotonic()) is not None:
            q.entry = ""  # never listed: its batch runs it unclaimed (prepare)
            q.listed = True
            self._changed()
            return
        q.entry = self.store.new_entry()
        self._unlisted.append(q)
        if self._listing is None:
            self._listing = asyncio.create_task(self._list_arrivals())

    async def _list_arrivals(self) -> None:
        """Append new requests to their sequences' backlogs in Redis, in
        arrival order; each burst of arrivals is one round trip."""
        try:
            while self._unlisted:
                items, self._unlisted = self._unlisted, []
                strategy = self.strategy
                try:
                    placement = await self.store.enqueue(
                        [(q.cid, q.entry, strategy.wants_placement(q)) for q in items]
                    )
                except Exception as exc:  # Redis unreachable: answer, never hang
                    err = unavailable(f"sequence backlog in Redis unavailable: {exc}")
                    for q in items:
                        if self.strategy.drop(q):
                            q.respond(error_response(q.msg.id, err))
                    self._changed()
                    continue
                # (gone: answered meanwhile, failed)
                gone = strategy.listed(items, placement, time.monotonic_ns())
                if gone:
                    await self.store.forget([(q.cid, q.entry) for q in gone])
                self._changed()
        except Exception:
            log.exception("listing sequence requests failed", extra={"model": self.model})
        finally:
            self._listing = None

    def pins_to_save(self) -> tuple[PinsSnapshot | None, tuple[int, int]]:
        """The instance pins a commit carries (None: Redis has them already)
        and what to pass to `pins_saved` once it landed. Every commit after a
        change carries them until one lands, so they are in Redis before the
        answers of the batch that pinned a group go out; a snapshot's serial
        keeps an older one landing late from replacing a newer one."""
        pins = self.strategy.pins
        version = (id(pins), pins.version)
        if version == self._pins_saved:
            return None, version
        return PinsSnapshot(next(self._pins_serial), pins.snapshot()), version

    def pins_saved(self, version: tuple[int, int]) -> None:
        self._pins_saved = version

    def dropped(self, failed: list[Queued]) -> None:
        """Requests answered without running: their listed entries leave Redis."""
        listed = [(q.cid, q.entry) for q in failed if q.listed]
        if listed:
            self._spawn(self.store.forget(listed))

    # -------------------------------------------------------------- execution

    async def prepare(self, batch: list[Queued], instance_id: str) -> SequenceJob | None:
        """Claim the batch's sequences and build its ExecuteRequest. Requests
        whose earlier one runs elsewhere go back (retried soon), requests of
        unknown sequences are answered; None: nothing left to run. Unlisted
        requests that still need no claim (a START, kept states) run
        unclaimed."""
        strategy = self.strategy
        term = self.term()
        now = time.monotonic()
        held: dict[str, Kept] = {}
        to_claim: list[Queued] = []
        for q in batch:
            kept = self._unclaimed(q, term, now) if not q.entry else None
            if kept is not None:
                held[q.cid] = kept
                continue
            if not q.entry:  # kept when it came, gone since: the claim lists it
                q.entry = self.store.new_entry()
            to_claim.append(q)
        claims: dict[str, Claim] = {}
        if to_claim:
            answers = await self.store.claim(
                [(q.cid, q.entry, q.msg.sequence_start, strategy.slot(q.cid)) for q in to_claim]
            )
            claims = {q.cid: c for q, c in zip(to_claim, answers, strict=True)}
        job = SequenceJob(self, term)
        claimed: list[tuple[Queued, int]] = []
        for q in batch:
            kept = held.get(q.cid)
            if kept is not None:
                job.held.add(q.cid)
                job.states[q.cid] = (kept.states, kept.shapes)
                claimed.append((q, kept.slot))
                continue
            claim = claims[q.cid]
            if claim.status == WAIT:  # an earlier request runs elsewhere: soon again
                strategy.put_back(q, time.monotonic_ns() + BUSY_RETRY_NS)
            elif claim.status == UNKNOWN:
                strategy.refused(q)
                q.respond(error_response(q.msg.id, self._unknown(q, self.store.lost(q.cid))))
            else:
                job.unsettled[q.cid] = q.entry
                job.states[q.cid] = _start_states(q, claim)
                claimed.append((q, claim.slot))
        claimed = self._same_state_shapes(claimed, job)
        if len(claimed) < len(batch):  # some went back to their backlogs
            self._changed()
        if not claimed:
            job.close()
            return None
        job.claimed = [q for q, _ in claimed]
        job.slots = {q.cid: slot for q, slot in claimed}
        job.rows = strategy.layout(claimed)
        try:
            job.request = self._execute_request(instance_id, job)
        except StageError as err:
            await job.settle_failed()
            for q in job.claimed:
                q.respond(error_response(q.msg.id, err))
            job.close()
            return None
        return job

    def _state_shape(self, state: StateSpec, q: Queued, states: States) -> tuple[int, ...]:
        raw, shapes = states
        if q.msg.sequence_start or state.output_name not in raw:
            return state.initial_dims
        return shapes.get(state.output_name, state.initial_dims)

    def _same_state_shapes(
        self, claimed: list[tuple[Queued, int]], job: SequenceJob
    ) -> list[tuple[Queued, int]]:
        """Keep the rows whose variable states match the first row's shapes; the
        others go back (still heading their backlogs) for the next batch."""
        seq = self.strategy.seq
        variable = [s for s in seq.states if s.variable]
        if not variable or len(claimed) < 2:
            return claimed

        def key(q: Queued) -> tuple:
            return tuple(self._state_shape(s, q, job.states[q.cid]) for s in variable)

        want = key(claimed[0][0])
        keep = []
        for q, slot in claimed:
            if key(q) == want:
                keep.append((q, slot))
            else:
                job.unsettled.pop(q.cid, None)
                self.strategy.put_back(q)
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
            f"{self.strategy.seq.max_idle_us} us)"
        )

    def _execute_request(self, instance_id: str, job: SequenceJob) -> pb.ExecuteRequest:
        spec = self.strategy.spec
        seq = self.strategy.seq
        rows = job.rows
        head = job.claimed[0]
        req = pb.ExecuteRequest(instance_id=instance_id)
        n = len(rows)
        batch_dim = [n] if spec.batching else []
        for i, t in enumerate(head.msg.inputs):
            parts = []
            for r in rows:
                parts.append(r.msg.inputs[i].raw if r is not None else _padding(t))
            req.inputs.add(  # built in place: an appended message is a copy
                name=t.name,
                datatype=t.datatype,
                shape=batch_dim + list(t.shape[1:] if spec.batching else t.shape),
                raw=b"".join(parts),
            )
        msgs = [r.msg if r is not None else None for r in rows]
        for fill in self._control_fills(seq):
            fill.add_to(req.inputs, msgs, batch_dim)
        for state in seq.states:
            shape = self._state_shape(state, head, job.states[head.cid])  # every row has it
            raw = b"".join(
                self._state_row(state, r, job.states[r.cid], shape)
                if r
                else self._initial(state, shape)
                for r in rows
            )
            req.inputs.add(
                name=state.input_name,
                datatype=state.datatype.triton,
                shape=batch_dim + list(shape),
                raw=raw,
            )
        state_outputs = [s.output_name for s in seq.states]
        every = [o.name for o in spec.outputs]  # a request naming no outputs gets them all
        every += [s for s in state_outputs if s not in every]
        request_info = spec.backend == "python"  # only Python models read it
        req.request_batch_sizes.extend([1] * n)
        for r in rows:
            if r is None:
                req.requested.add(names=state_outputs)
            elif not r.msg.outputs:
                req.requested.add(names=every)
            else:
                wanted = list(r.msg.outputs)
                req.requested.add(names=wanted + [s for s in state_outputs if s not in wanted])
            if request_info:
                add_request_info(req, r.msg if r is not None else None)
        return req

    @property
    def state_names(self) -> frozenset[str]:
        """The model's state output names (a reload may change them)."""
        seq = self.strategy.seq
        if self._names_for is not seq:
            self._state_names = frozenset(s.output_name for s in seq.states)
            self._names_for = seq
        return self._state_names

    def _control_fills(self, seq: SequenceBatching) -> list[ControlFill]:
        """The model's control inputs, encoded once per config (a reload may change them)."""
        if self._fills_for is not seq:
            self._fills = [ControlFill(c) for c in seq.controls]
            self._fills_for = seq
        return self._fills

    def _state_row(
        self, state: StateSpec, q: Queued, states: States, shape: tuple[int, ...]
    ) -> bytes:
        raw, _ = states
        if not q.msg.sequence_start and state.output_name in raw:
            return raw[state.output_name]
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


class SequenceJob:
    """One claimed batch: its rows (None: a direct-strategy padding row), its
    request, and what Redis must be told when it ends. `term`: the model's
    shard term when the batch formed (None: no sharding); its commit keeps
    nothing unless the term is still Redis's."""

    def __init__(self, io: SequenceIO, term: str | None = None) -> None:
        self.io = io
        self.term = term
        self.claimed: list[Queued] = []
        self.rows: list[Queued | None] = []
        self.request = pb.ExecuteRequest()
        self.states: dict[str, States] = {}  # cid -> the states it runs with
        self.slots: dict[str, int] = {}  # cid -> its slot
        self.held: set[str] = set()  # cids run with kept states (unclaimed, unlisted)
        self.unsettled: dict[str, str] = {}  # claimed entries not yet committed: cid -> entry
        declared = {o.name for o in io.strategy.spec.outputs}
        # state outputs the client did not ask for by declaring them
        self.hidden = io.state_names - declared

    async def settle_failed(self) -> None:
        """A failed execution leaves each sequence's state as it was (the
        kept copies too); only listed entries leave their backlogs."""
        listed = [q for q in self.claimed if q.cid not in self.held]
        if listed:
            await self.io.store.commit([Finished(q.cid, q.entry, False) for q in listed])
        self.unsettled.clear()

    async def commit(self, resp: pb.ExecuteResponse | None) -> dict[int, StageError]:
        """Keep the new states, end the sequences whose request had END.
        None: a decoupled batch, which has no state outputs. Returns the rows
        (indexes) that must fail instead of answering: all of them when the
        model changed owner since the batch formed, or an unclaimed row whose
        sequence Redis lost."""
        io = self.io
        state_names = io.state_names
        skip = 1 if io.strategy.spec.batching else 0  # a row's state shape has no batch dim
        finished: list[Finished] = []
        indexes: list[int] = []
        results = resp.results if resp is not None else [pb.RequestOutputs()] * len(self.rows)
        held, slots = self.held, self.slots
        for i, (q, result) in enumerate(zip(self.rows, results, strict=True)):
            if q is None:
                continue
            cid, msg = q.cid, q.msg
            finished.append(
                Finished(
                    cid,
                    q.entry,
                    msg.sequence_end,
                    _state_updates(result.outputs, state_names, skip),
                    msg.sequence_start,
                    cid in held,
                    slots.get(cid, -1),
                )
            )
            indexes.append(i)
        sent = time.monotonic()
        pins, version = io.pins_to_save()
        committed = await io.store.commit(finished, self.term, pins)
        if committed.fenced:  # another scheduler may run these sequences now
            io.cache.clear()  # (close() takes the listed entries back out)
            err = unavailable(
                f"model '{io.model}' moved to another scheduler while this request ran; "
                f"its sequence's state is unchanged, retry"
            )
            return dict.fromkeys(indexes, err)
        self.unsettled.clear()
        io.pins_saved(version)
        failed: dict[int, StageError] = {}
        lost = committed.lost
        store, cache, term = io.store, io.cache, self.term
        until = sent + store.idle_ms / 1000
        for k, row in enumerate(finished):
            cid = row.cid
            if lost and k in lost:
                q = self.rows[indexes[k]]
                assert q is not None
                cache.drop(cid)
                io.strategy.refused(q)
                failed[indexes[k]] = io._unknown(q, store.lost(cid))
                continue
            if row.end:
                q = self.rows[indexes[k]]
                assert q is not None
                cache.drop(cid)
                io.strategy.ended(q)
                continue
            store.opened(cid, sent)
            if term is not None:
                raw, shapes = self.states[cid]
                if row.states:
                    raw, shapes = dict(raw), dict(shapes)
                    for name, update in row.states.items():
                        raw[name] = update.raw
                        shapes[name] = update.shape
                cache.put(cid, Kept(term, row.slot, raw, shapes, until))
        return failed

    def close(self) -> None:
        """After the batch, whatever happened: an unexpected error leaves
        claimed entries uncommitted; they leave the backlogs."""
        if self.unsettled:
            self.io._spawn(self.io.store.forget(list(self.unsettled.items())))
            self.unsettled.clear()


def _state_updates(
    outputs: Sequence[pb.Tensor], names: frozenset[str], skip: int
) -> dict[str, StateUpdate]:
    """A row's new states among its outputs. Searched from the end: the
    batch asks for the state outputs after the client's (`_execute_request`)."""
    found: dict[str, StateUpdate] = {}
    for k in range(len(outputs) - 1, -1, -1):
        t = outputs[k]
        if t.name in names:
            found[t.name] = StateUpdate(t.raw, tuple(t.shape[skip:]))
            if len(found) == len(names):
                break
    return found


def _start_states(q: Queued, claim: Claim) -> States:
    """The states a request runs with: the kept ones, or initial at START."""
    if q.msg.sequence_start:
        return {}, {}
    return claim.states, claim.shapes


def _padding(t: pb.Tensor) -> bytes:
    """One row of zeros (or empty strings) shaped like `t`'s rows."""
    if t.datatype == "BYTES":
        return serialize_bytes_elements([b""] * element_count(t.shape[1:]))
    rows = t.shape[0] if t.shape else 1
    return b"\0" * (len(t.raw) // max(rows, 1))


def make_sequence_queue(
    model: str,
    version: int,
    spec: ModelSpec,
    ratelimiter,
    workers,
    redis,
    model_dir: Path,
    settings: SchedulerSettings,
    lane: ScriptLane | None = None,
) -> ModelQueue:
    assert spec.sequence is not None
    store = SequenceStore(
        redis,
        model,
        version,
        spec.sequence.max_idle_us // 1000,
        settings.sequence_owner_ttl_ms,
        lane,
    )
    strategy = SequenceStrategy(spec)
    sequences = SequenceIO(store, strategy, model, model_dir, settings.sequence_cache_entries)
    return ModelQueue(
        model,
        version,
        spec,
        ratelimiter,
        workers,
        settings,
        strategy=strategy,
        sequences=sequences,
    )
