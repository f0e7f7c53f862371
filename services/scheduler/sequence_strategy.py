"""The sequence batcher's batch forming: a strategy with no I/O (time passed in).

Requests wait in their sequence's backlog, in arrival order; a batch takes
at most one request per sequence, the head of its backlog, and only once its
entry is listed in Redis (`listed`), while no request of the sequence runs
and no retry is pending (sequence_slots.ready_in_age_order). Rows of one
batch share their input shapes (the oldest head's).

- oldest: up to max_batch_size sequences, oldest head first, among the
  candidate sequences: a sequence is a candidate from its START to its END
  (or idle timeout), and a START waits while max_candidate_sequences per
  instance are candidates (unset: max_batch_size per instance, as Triton
  2.51 does; tests/integration/test_sequence_candidates.py);
- direct: every instance has max_batch_size slots, as in Triton 2.51; a
  sequence owns one from its START to its END (or idle timeout), and a
  START waits while every slot is taken.

With G instances in the config, slot s belongs to instance group s % G
(lowest free slot first, so sequences spread over the instances as in
Triton) and, for direct, is row s // G of that group's batches, gaps being
padding (`layout`). A batch holds the sequences of one group, and a group
runs on one instance from its first batch while any of its slots is taken
(instance_pins.py): a sequence's requests all run on one instance, as
Triton promises. `instance_filter` says which grants can run a batch now;
`next_batch(instance=...)` forms one for the granted instance.

Both admit sequences with `DirectSlots`; `wake_at_ns` says when the least
recently used idle one frees.

A batch waits for max_queue_delay after its oldest head unless it is full.
The Redis side (listing, claims, states) is the adapter's,
sequence_queue.py: it reports back with `listed`, `put_back`, `refused`,
`ended`; ModelQueue calls `finished` when the batch is over.
"""

from __future__ import annotations

from collections import deque

from services.scheduler.batch_strategy import Queued, shape_key
from services.scheduler.batcher import Decision
from services.scheduler.instance_pins import InstanceFilter, InstancePins
from services.scheduler.sequence_slots import DirectSlots, ready_in_age_order
from services.scheduler.sequence_store import Placement, sequence_key
from stageserve.config import ModelSpec, SequenceBatching

_S = 1e-9  # ns -> s: the slots keep seconds


class SequenceStrategy:
    def __init__(self, spec: ModelSpec) -> None:
        self.backlogs: dict[str, deque[Queued]] = {}
        self.running: set[str] = set()  # sequences with a request executing
        self.slots: DirectSlots = DirectSlots()  # admitted sequences (direct: their slots)
        self.retry_at: dict[str, float] = {}  # busy elsewhere: not before this time (s)
        self._count = 0
        self._waiting_for_slot = False
        self.reconfigure(spec)

    def reconfigure(self, spec: ModelSpec) -> None:
        assert spec.sequence is not None
        self.spec = spec
        self.seq: SequenceBatching = spec.sequence
        self.direct = self.seq.strategy == "direct"
        self.capacity = max(1, spec.max_batch_size)
        # how many sequences may be active at once
        instances = sum(g.count * max(1, len(g.gpus)) for g in spec.instance_groups)
        per_instance = self.capacity if self.direct else self.seq.max_candidates or self.capacity
        self.admitted = per_instance * max(1, instances)
        self.pins = InstancePins(instances)  # a reload's instances are new ones
        self.idle_s = self.seq.max_idle_us / 1e6
        self.delay_ns = self.seq.max_queue_delay_us * 1000
        for backlog in self.backlogs.values():  # batching may have changed
            for q in backlog:
                q.shape = shape_key(q.msg, spec.batching)

    def __len__(self) -> int:
        return self._count

    # ----------------------------------------------------------------- intake

    def add(self, q: Queued) -> bool:
        q.cid = sequence_key(q.msg.sequence_id, q.msg.sequence_id_str)
        q.listed = False
        q.shape = shape_key(q.msg, self.spec.batching)
        self.backlogs.setdefault(q.cid, deque()).append(q)
        self._count += 1
        return False

    def wants_placement(self, q: Queued) -> bool:
        """Whether `q` continues a sequence this scheduler has no slot for
        (the model moved here, or the scheduler restarted): the adapter then
        fetches the slot and pins its previous owner saved (`listed`)."""
        return not q.msg.sequence_start and q.cid not in self.slots

    def listed(
        self, items: list[Queued], placement: Placement | None = None, now_ns: int = 0
    ) -> list[Queued]:
        """Their entries are in Redis now; returns those no longer queued
        (answered meanwhile), whose entries the adapter takes back out.
        `placement`: the previous owner's slots of continuing sequences and
        its pins, so they run on the instance they ran on."""
        if placement is not None:
            for cid, slot in placement.slots.items():
                self.slots.admit_at(cid, slot, self.pins.groups, self.admitted, now_ns * _S)
            self.pins.adopt(placement.pins)
        gone = []
        for q in items:
            q.listed = True
            if not self._queued(q):
                gone.append(q)
        return gone

    def drop(self, q: Queued) -> bool:
        """Take a still-queued request out (its listing failed): True if it was."""
        if not self._queued(q):
            return False
        backlog = self.backlogs[q.cid]
        backlog.remove(q)
        self._count -= 1
        if not backlog and q.cid not in self.running:
            del self.backlogs[q.cid]
        return True

    def _queued(self, q: Queued) -> bool:
        return any(x is q for x in self.backlogs.get(q.cid, ()))

    # ---------------------------------------------------------------- batches

    def _eligible(self, now_ns: int) -> list[str]:
        """Sequences whose next request may run now, oldest first."""
        now = now_ns * _S
        ready = ready_in_age_order(
            ((cid, b[0].listed, b[0].enqueue_ns) for cid, b in self.backlogs.items() if b),
            self.running,
            self.retry_at,
            now,
        )
        self._waiting_for_slot = False
        reclaimed = False
        out = []
        for cid in ready:
            start = self.backlogs[cid][0].msg.sequence_start
            admitted = self.slots.admit(cid, start, self.admitted, now)
            if not admitted and not reclaimed:
                # Idle sequences give their slots up only when a new one needs
                # one: walking every slot on each call cost more than the
                # rest of this method at c=8 (py-spy, docs/benchmarks.md).
                reclaimed = True
                self.slots.free_idle(now, self.idle_s, self._busy)
                admitted = self.slots.admit(cid, start, self.admitted, now)
            if admitted:
                out.append(cid)
            else:
                self._waiting_for_slot = True
        return out

    def _busy(self, cid: str) -> bool:
        return cid in self.running or bool(self.backlogs.get(cid))

    def has_work(self, now_ns: int) -> bool:
        now = now_ns * _S
        running, retry_at, slots = self.running, self.retry_at, self.slots
        for cid, backlog in self.backlogs.items():
            # the common case first: a continuing sequence's listed request
            if (
                backlog
                and backlog[0].listed
                and not backlog[0].msg.sequence_start
                and cid in slots
                and cid not in running
                and retry_at.get(cid, 0.0) <= now
            ):
                return True
        return bool(self._eligible(now_ns))

    def wake_at_ns(self, now_ns: int) -> int | None:
        """A pending retry, or (a START waiting for a slot) the least recently
        used idle slot timing out, 1 ms after, as free_idle wants it older."""
        now = now_ns * _S
        for cid in [c for c, t in self.retry_at.items() if t <= now]:
            del self.retry_at[cid]
        times = list(self.retry_at.values())
        if self._waiting_for_slot:
            expiry = self.slots.next_idle_expiry(self.running, self.idle_s)
            if expiry is not None:  # else a running sequence's finish wakes the queue
                times.append(max(expiry, now) + 0.001)
        return round(min(times) * 1e9) if times else None

    def _group(self, cid: str) -> int:
        return self.pins.group_of(self.slots.slot(cid))

    def _unpin_empty_groups(self) -> None:
        if self.pins.groups == 1:
            if not len(self.slots):
                self.pins.clear()
        else:
            self.pins.keep_only({self.pins.group_of(s) for s in self.slots.taken()})

    def instance_filter(self, now_ns: int) -> InstanceFilter | None:
        """Which grants can run a batch now (None: any)."""
        self._unpin_empty_groups()
        pins = self.pins
        if pins.groups == 1:  # no eligibility walk: one group holds every sequence
            pinned = pins.instance_of(0)
            return None if pinned is None else InstanceFilter(only=frozenset((pinned,)))
        return pins.filter({self._group(cid) for cid in self._eligible(now_ns)}, now_ns * _S)

    def _runnable(self, eligible: list[str], instance: str | None, now_ns: int) -> list[str]:
        """The eligible sequences of the one group a batch on `instance` takes
        (None: the oldest eligible sequence's group), oldest first."""
        pins = self.pins
        if pins.groups == 1:
            pinned = pins.instance_of(0)
            return eligible if instance is None or pinned in (None, instance) else []
        if instance is None:
            first = self._group(eligible[0])
            return [cid for cid in eligible if self._group(cid) == first]
        own = [cid for cid in eligible if pins.instance_of(self._group(cid)) == instance]
        if not own and pins.may_adopt(instance, now_ns * _S):
            own = [cid for cid in eligible if pins.instance_of(self._group(cid)) is None]
        if not own:
            return []
        first = self._group(own[0])
        return [cid for cid in own if self._group(cid) == first]

    def next_batch(self, now_ns: int, instance: str | None = None) -> Decision[Queued]:
        """A batch for `instance` (the granted one; None: any instance)."""
        eligible = self._eligible(now_ns)
        if not eligible:
            return Decision(None, None)
        self._unpin_empty_groups()
        eligible = self._runnable(eligible, instance, now_ns)
        if not eligible:
            return Decision(None, None)
        oldest = self.backlogs[eligible[0]][0].enqueue_ns
        full = len(eligible) >= self.capacity
        if not full and self.delay_ns and now_ns < oldest + self.delay_ns:
            wake = self.wake_at_ns(now_ns)
            deadline = oldest + self.delay_ns
            return Decision(None, deadline if wake is None else min(wake, deadline))
        # Rows of one batch share their input shapes (the oldest one's).
        want = self.backlogs[eligible[0]][0].shape
        chosen = [cid for cid in eligible if self.backlogs[cid][0].shape == want]
        chosen = chosen[: self.capacity]
        if instance is not None:
            self.pins.pin(self._group(chosen[0]), instance)
        batch = []
        for cid in chosen:
            batch.append(self.backlogs[cid].popleft())
            self.running.add(cid)
        self._count -= len(batch)
        return Decision(batch, None)

    def forget_instance(self, instance: str) -> None:
        """The instance went away: its groups run on another one."""
        self.pins.forget(instance)

    def crowded(self, now_ns: int) -> None:
        """A grant named an instance the filter excluded (no other is there)."""
        self.pins.crowd(now_ns * _S)

    def layout(self, claimed: list[tuple[Queued, int]]) -> list[Queued | None]:
        """Batch rows for (request, slot it claimed with in Redis); for direct,
        slot s is row s // G and gaps are padding (None)."""
        if not self.direct:
            return [q for q, _ in claimed]
        return self.slots.layout([(q.cid, q, slot) for q, slot in claimed], self.pins.groups)

    def slot(self, cid: str) -> int:
        return self.slots.slot(cid)

    # --------------------------------------------------------------- outcomes

    def put_back(self, q: Queued, retry_at_ns: int | None = None) -> None:
        """Return a request to the head of its backlog (not eligible before
        retry_at_ns: an earlier request of its sequence runs elsewhere)."""
        self.backlogs.setdefault(q.cid, deque()).appendleft(q)
        self.running.discard(q.cid)
        self._count += 1
        if retry_at_ns is not None:
            self.retry_at[q.cid] = retry_at_ns * _S

    def refused(self, q: Queued) -> None:
        """Its sequence is unknown in Redis: no slot, nothing running."""
        self.running.discard(q.cid)
        self.slots.release(q.cid)

    def ended(self, q: Queued) -> None:
        """Its END request ran: the slot comes free."""
        self.slots.release(q.cid)

    def finished(self, batch: list[Queued], now_ns: int) -> None:
        now = now_ns * _S
        for q in batch:
            cid = q.cid
            self.running.discard(cid)
            self.slots.touch(cid, now)
            if cid in self.backlogs and not self.backlogs[cid]:
                del self.backlogs[cid]

    def requeue(self, batch: list[Queued]) -> bool:
        return False  # its state may have moved on: the client resends

    def expire(self, now_ns: int) -> list[Queued]:
        return []

    def next_deadline(self) -> int | None:
        return None

    def drain(self) -> list[Queued]:
        out: list[Queued] = []
        for cid in list(self.backlogs):
            if cid in self.running:
                continue
            out.extend(self.backlogs.pop(cid))
        self._count -= len(out)
        return out

    def level_of(self, priority: int) -> int:
        return 0
