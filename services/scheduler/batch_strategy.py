"""How a model queue forms its batches: a strategy object with no I/O.

ModelQueue (model_queue.py) asks its strategy, with the time passed in,
whether a batch could form (`has_work`), for the batch (`next_batch`), and
tells it what became of each batch (`finished`, `requeue`); the strategy
never sleeps, awaits or talks to anything. Two strategies:

- `QueueStrategy` (here): the default scheduler and the dynamic batcher,
  batcher.py's queue over `Queued` requests (priorities, queue policies,
  preferred sizes, max queue delay, adaptive hold);
- `SequenceStrategy` (sequence_strategy.py): the sequence batcher's direct
  and oldest strategies over per-sequence backlogs.

The interface (`Strategy`) is the shape of vLLM v1's scheduler: requests go
in (`add`), batches come out (`next_batch`), outcomes come back
(`finished`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from services.scheduler.batcher import (
    Batcher,
    Decision,
    DefaultBatcher,
    DynamicBatcher,
    Pending,
    QueuePolicy,
)
from services.scheduler.batcher import shape_key as batch_shape_key
from services.scheduler.instance_pins import InstanceFilter
from stageserve.config import ModelSpec, QueuePolicySpec
from stageserve.generated import stageserve_pb2 as pb

Respond = Callable[[pb.ScheduleResponse], None]

# How often a batch is retried when its instance disappeared under it (a reload).
MAX_ATTEMPTS = 3


@dataclass(slots=True)
class Queued:
    """One accepted request, as every part of the queue sees it."""

    msg: pb.ScheduleRequest
    respond: Respond
    enqueue_ns: int
    seq: int = 0  # dispatch order, for preserve_ordering
    pending: Pending | None = None  # its batcher entry, to requeue it
    attempts: int = 0
    cid: str = ""  # sequences: its sequence (sequence_store.sequence_key)
    entry: str = ""  # sequences: its backlog entry in Redis
    listed: bool = True  # sequences: the entry is in Redis, the request may run
    shape: tuple = ()  # sequences: its inputs' shape_key, which rows of a batch share


class Strategy(Protocol):
    """What ModelQueue needs from a batch-forming strategy (times: monotonic ns)."""

    def __len__(self) -> int:
        """Requests waiting (the queue depth)."""
        ...

    def add(self, q: Queued) -> bool:
        """Queue a request (raises batcher.QueueFull); True when it has a deadline."""
        ...

    def has_work(self, now_ns: int) -> bool:
        """Whether a batch could form now, or once a queue delay passes."""
        ...

    def wake_at_ns(self, now_ns: int) -> int | None:
        """When has_work may turn true with no arrival and no batch finishing
        (a retry or an idle-out coming due); None: only those wake it."""
        ...

    def instance_filter(self, now_ns: int) -> InstanceFilter | None:
        """Which instances can run the next batch (None: any); a sequence
        model's sequences stay on their instance (instance_pins.py)."""
        ...

    def next_batch(self, now_ns: int, instance: str | None = None) -> Decision[Queued]:
        """A batch to run on `instance` (None: any); Decision.batch holds
        Queued requests (not batcher entries)."""
        ...

    def forget_instance(self, instance: str) -> None:
        """The instance went away (its worker died or unloaded the model)."""
        ...

    def crowded(self, now_ns: int) -> None:
        """The rate limiter granted an instance the filter excluded: no other
        instance was there."""
        ...

    def finished(self, batch: list[Queued], now_ns: int) -> None:
        """A batch ended, however it ended."""
        ...

    def requeue(self, batch: list[Queued]) -> bool:
        """Put back a batch whose instance went away; False: answer it instead."""
        ...

    def expire(self, now_ns: int) -> list[Queued]:
        """Requests whose queue timeout expired (REJECT): answer them."""
        ...

    def next_deadline(self) -> int | None: ...

    def drain(self) -> list[Queued]:
        """Take out every request that may be failed now (none executing)."""
        ...

    def level_of(self, priority: int) -> int: ...

    def reconfigure(self, spec: ModelSpec) -> None:
        """A reloaded model's settings; queued requests stay."""
        ...


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
    """batcher.shape_key of a request's inputs. Without ragged inputs it is
    built here in one pass (it runs per request: 1.2 against 1.8 us through
    the general one, timeit on the 2-core VM)."""
    if ragged:
        return batch_shape_key(((t.name, t.shape) for t in msg.inputs), batching, ragged)
    skip = 1 if batching else 0
    return tuple([(t.name, tuple(t.shape[skip:])) for t in msg.inputs])


class QueueStrategy:
    """The default scheduler and the dynamic batcher (batcher.py)."""

    def __init__(self, spec: ModelSpec, adaptive_delay_us: int = 0) -> None:
        self.spec = spec
        self.adaptive_delay_us = adaptive_delay_us
        self.batcher = make_batcher(spec, adaptive_delay_us)

    def __len__(self) -> int:
        return len(self.batcher)

    def add(self, q: Queued) -> bool:
        msg = q.msg
        spec = self.spec
        pending = q.pending = Pending(
            batch_size=msg.batch_size if spec.batching else 1,
            shape_key=shape_key(msg, spec.batching, spec.ragged_inputs),
            enqueue_ns=q.enqueue_ns,
            payload=q,
            priority=int(msg.priority),
        )
        self.batcher.add(pending, timeout_us=int(msg.timeout_us))
        return pending.deadline_ns is not None

    def has_work(self, now_ns: int) -> bool:
        return len(self.batcher) > 0

    def wake_at_ns(self, now_ns: int) -> int | None:
        return None

    def instance_filter(self, now_ns: int) -> InstanceFilter | None:
        return None

    def forget_instance(self, instance: str) -> None:
        pass

    def crowded(self, now_ns: int) -> None:
        pass

    def next_batch(self, now_ns: int, instance: str | None = None) -> Decision[Queued]:
        decision = self.batcher.next_batch(now_ns)
        batch: list = decision.batch or []
        for i, p in enumerate(batch):  # in place: no new list per batch
            batch[i] = p.payload
        return cast("Decision[Queued]", decision)  # its entries are now their requests

    def finished(self, batch: list[Queued], now_ns: int) -> None:
        pass

    def requeue(self, batch: list[Queued]) -> bool:
        if any(q.pending is None or q.attempts >= MAX_ATTEMPTS for q in batch):
            return False
        for q in batch:
            q.attempts += 1
        self.batcher.requeue_front([q.pending for q in batch if q.pending is not None])
        return True

    def expire(self, now_ns: int) -> list[Queued]:
        rejected: list = self.batcher.expire(now_ns)
        for i, p in enumerate(rejected):
            rejected[i] = p.payload
        return rejected

    def next_deadline(self) -> int | None:
        return self.batcher.next_deadline()

    def drain(self) -> list[Queued]:
        return [p.payload for p in self.batcher.drain()]

    def level_of(self, priority: int) -> int:
        return self.batcher.level_of(priority)

    def reconfigure(self, spec: ModelSpec) -> None:
        pending = self.batcher.drain()
        self.spec = spec
        self.batcher = make_batcher(spec, self.adaptive_delay_us)
        for p in pending:  # the new config may make other inputs ragged
            p.shape_key = shape_key(p.payload.msg, spec.batching, spec.ragged_inputs)
        self.batcher.requeue_front(pending)
