"""Batch formation: a pure state machine with no I/O (unit-tested exhaustively).

The scheduler asks for a batch only when an instance is free to run it, so
while every instance is busy requests accumulate and batches grow.

Queue order (Triton's dynamic batcher with priorities and queue policies):
priority levels from 1 (highest) down; inside a level, arrival order; then,
after every level's live requests, the requests whose timeout expired with
the DELAY action, again by level. A level may cap its queue
(max_queue_size); expired REJECT requests leave the queue at their deadline
(`expire`), whatever is executing.

Batch rules, taking requests in queue order from the head:
- a request whose non-batch shapes differ from the head's ends the batch (no
  mixing); inputs with allow_ragged_batch are left out of that comparison
  (`shape_key`), so requests of different lengths share a batch (ragged
  batching: the worker concatenates them into one 1-D tensor);
- a batch is sent at once when it reaches max_batch_size, or when the next
  queued request cannot join it (too big or a different shape): then the
  largest preferred-size prefix if there is one, else everything that fits;
- otherwise, if preferred batch sizes are configured and some prefix of the
  queue adds up to one, the largest such prefix is sent at once;
- otherwise the batch waits until the oldest request has waited
  max_queue_delay, then everything that fits is sent (delay 0: at once).
The default scheduler (no dynamic_batching) runs each request on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from services.scheduler.hold_tuner import HoldTuner

REJECT, DELAY = "REJECT", "DELAY"

T = TypeVar("T")


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy for one priority level."""

    timeout_action: str = REJECT
    default_timeout_us: int = 0  # 0: no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded

    def timeout_us(self, requested_us: int) -> int:
        """The timeout that applies. As in Triton's core, a request's timeout only
        counts when overrides are allowed and it is shorter than a (non-zero)
        default: it may shorten the default, never extend or create one."""
        if self.allow_timeout_override and 0 < requested_us < self.default_timeout_us:
            return requested_us
        return self.default_timeout_us


def shape_key(
    inputs: Iterable[tuple[str, Sequence[int]]],
    batching: bool,
    ragged: Collection[str] = (),
) -> tuple:
    """What must be equal for requests to share a batch: each input's name and
    its shape without the batch dimension. A ragged input keeps its name (the
    same inputs must be present) but not its shape."""
    skip = 1 if batching else 0
    return tuple((name, None if name in ragged else tuple(shape[skip:])) for name, shape in inputs)


@dataclass
class Pending:
    """A queued request, as the batcher sees it."""

    batch_size: int  # 1+ ; models without batching use 1
    shape_key: Hashable  # non-batch shapes of every input
    enqueue_ns: int
    payload: Any = field(default=None, compare=False)
    priority: int = 0  # 0: the model's default level
    deadline_ns: int | None = None  # set by the batcher from the queue policy
    timeout_action: str = REJECT


@dataclass(frozen=True)
class Decision(Generic[T]):
    """A batcher's Decision holds Pending entries; a strategy's, their Queued requests."""

    batch: list[T] | None  # send this now
    wake_at_ns: int | None  # else: ask again at this time (None: nothing queued)


class QueueFull(Exception):
    """The request's priority level already holds max_queue_size requests."""


class Batcher:
    """Priority levels of FIFO queues; subclasses decide how many form a batch."""

    def __init__(
        self,
        priority_levels: int = 0,
        default_priority_level: int = 0,
        default_policy: QueuePolicy | None = None,
        level_policies: dict[int, QueuePolicy] | None = None,
    ) -> None:
        self.priority_levels = max(priority_levels, 1)
        self.default_level = default_priority_level or (self.priority_levels + 1) // 2
        if not 1 <= self.default_level <= self.priority_levels:
            self.default_level = 1
        self.default_policy = default_policy or QueuePolicy()
        self.level_policies = level_policies or {}
        self._live: dict[int, deque[Pending]] = {}
        self._delayed: dict[int, deque[Pending]] = {}
        self._size = 0

    # ----------------------------------------------------------------- queue

    def level_of(self, priority: int) -> int:
        """Triton: 0 or out of range means the default level."""
        if priority <= 0 or priority > self.priority_levels:
            return self.default_level
        return priority

    def policy(self, level: int) -> QueuePolicy:
        return self.level_policies.get(level, self.default_policy)

    def __len__(self) -> int:
        return self._size

    @property
    def queue(self) -> list[Pending]:
        """Every queued request, in the order batches take them."""
        return list(self._ordered())

    def _ordered(self) -> Iterator[Pending]:
        for store in (self._live, self._delayed):
            for level in sorted(store):
                yield from store[level]

    def add(self, request: Pending, timeout_us: int = 0) -> None:
        """Queue a request (raises QueueFull); sets its level and deadline."""
        level = self.level_of(request.priority)
        policy = self.policy(level)
        live = self._live.get(level)
        if live is None:  # (not setdefault: it would build a deque per request)
            live = self._live[level] = deque()
        if policy.max_queue_size and len(live) + len(self._delayed.get(level, ())) >= (
            policy.max_queue_size
        ):
            raise QueueFull(f"exceeds maximum queue size {policy.max_queue_size}")
        request.priority = level
        timeout = policy.timeout_us(timeout_us)
        request.deadline_ns = request.enqueue_ns + timeout * 1000 if timeout else None
        request.timeout_action = policy.timeout_action
        live.append(request)
        self._size += 1

    def requeue_front(self, requests: list[Pending]) -> None:
        """Put requests back at the head of their levels, in the given order."""
        for request in reversed(requests):
            self._live.setdefault(request.priority, deque()).appendleft(request)
            self._size += 1

    def drain(self) -> list[Pending]:
        out = list(self._ordered())
        self._live.clear()
        self._delayed.clear()
        self._size = 0
        return out

    def remove(self, predicate: Callable[[Pending], bool]) -> list[Pending]:
        """Take out every request matching predicate (cancelled, timed out)."""
        removed: list[Pending] = []
        for store in (self._live, self._delayed):
            for level, q in store.items():
                kept: deque[Pending] = deque()
                for r in q:
                    (removed if predicate(r) else kept).append(r)
                store[level] = kept
        self._size -= len(removed)
        return removed

    # -------------------------------------------------------------- timeouts

    def next_deadline(self) -> int | None:
        deadlines = [r.deadline_ns for q in self._live.values() for r in q if r.deadline_ns]
        return min(deadlines) if deadlines else None

    def expire(self, now_ns: int) -> list[Pending]:
        """Apply timeouts: REJECT requests are returned (to be answered now),
        DELAY requests move behind every live request."""
        rejected: list[Pending] = []
        for level, q in self._live.items():
            if not any(r.deadline_ns is not None and r.deadline_ns <= now_ns for r in q):
                continue
            kept: deque[Pending] = deque()
            for r in q:
                if r.deadline_ns is None or r.deadline_ns > now_ns:
                    kept.append(r)
                elif r.timeout_action == DELAY:
                    r.deadline_ns = None
                    self._delayed.setdefault(level, deque()).append(r)
                else:
                    rejected.append(r)
            self._live[level] = kept
        self._size -= len(rejected)
        return rejected

    # --------------------------------------------------------------- batches

    def next_batch(self, now_ns: int) -> Decision[Pending]:
        raise NotImplementedError

    def _take(self, n: int) -> list[Pending]:
        out: list[Pending] = []
        for store in (self._live, self._delayed):
            for level in sorted(store):
                q = store[level]
                while q and len(out) < n:
                    out.append(q.popleft())
        self._size -= len(out)
        return out


class DefaultBatcher(Batcher):
    """Triton's default scheduler: one request per execution."""

    def next_batch(self, now_ns: int) -> Decision[Pending]:
        if not self._size:
            return Decision(None, None)
        return Decision(self._take(1), None)


class DynamicBatcher(Batcher):
    """Triton's dynamic batcher, plus an optional adaptive hold (beyond Triton).

    Adaptive hold (adaptive_delay_ns > 0): when a batch could go out but
    requests piled up while the instance was busy (two or more queued) and
    arrivals are still coming, keep the batch open while the next arrival is
    due (twice the recent mean gap between arrivals) and at most
    adaptive_delay_ns after its oldest request. Under load the batches grow,
    and with them the work shared per message on every hop; a lone request
    (concurrency 1) never waits, because one queued request never holds.
    Whether the hold is on at all is decided epoch by epoch from the traffic
    by the tuner (hold_tuner.py): off while requests arrive faster without it.
    """

    # Bounds on the gap after the last arrival that keeps a held batch open.
    MIN_GAP_NS = 50_000
    GAP_WEIGHT = 0.2  # EWMA weight of the newest gap

    def __init__(
        self,
        max_batch_size: int,
        preferred_batch_sizes: tuple[int, ...] = (),
        max_queue_delay_ns: int = 0,
        adaptive_delay_ns: int = 0,
        hold_tuner: HoldTuner | None = None,
        **queue_options: Any,
    ) -> None:
        super().__init__(**queue_options)
        if max_batch_size < 1:
            raise ValueError("dynamic batching needs max_batch_size >= 1")
        self.max_batch_size = max_batch_size
        self.preferred = frozenset(preferred_batch_sizes)
        self.max_queue_delay_ns = max_queue_delay_ns
        self.adaptive_delay_ns = adaptive_delay_ns
        # Whether holding pays is measured on the traffic (hold_tuner.py).
        self.tuner = (hold_tuner or HoldTuner()) if adaptive_delay_ns else None
        self.last_arrival_ns: int | None = None
        self.mean_gap_ns = 0.0

    def add(self, request: Pending, timeout_us: int = 0) -> None:
        super().add(request, timeout_us)
        if self.last_arrival_ns is not None:
            gap = max(0, request.enqueue_ns - self.last_arrival_ns)
            self.mean_gap_ns += self.GAP_WEIGHT * (gap - self.mean_gap_ns)
        self.last_arrival_ns = request.enqueue_ns
        if self.tuner is not None:
            self.tuner.arrived(request.enqueue_ns)

    def _hold_until(self, count: int, oldest: int, now_ns: int) -> int | None:
        """Until when the adaptive hold keeps a ready batch of `count` open."""
        if not self.adaptive_delay_ns or count < 2 or self.last_arrival_ns is None:
            return None
        if self.tuner is not None and not self.tuner.hold_on(now_ns):
            return None
        gap = min(max(2 * self.mean_gap_ns, self.MIN_GAP_NS), self.adaptive_delay_ns)
        return min(oldest + self.adaptive_delay_ns, self.last_arrival_ns + int(gap))

    def next_batch(self, now_ns: int) -> Decision[Pending]:
        if not self._size:
            return Decision(None, None)
        ordered = self._ordered()
        head = next(ordered)
        if head.batch_size > self.max_batch_size:  # the gateway prevents this
            return Decision(self._take(1), None)
        total = head.batch_size
        count = 1
        best_preferred = 1 if total in self.preferred else 0
        blocked = False
        oldest = head.enqueue_ns
        for r in ordered:
            if r.shape_key != head.shape_key or total + r.batch_size > self.max_batch_size:
                blocked = True
                break
            total += r.batch_size
            count += 1
            oldest = min(oldest, r.enqueue_ns)
            if total in self.preferred:
                best_preferred = count
        if total == self.max_batch_size:
            return Decision(self._take(count), None)
        if blocked:
            return Decision(self._take(best_preferred or count), None)
        if best_preferred:
            return Decision(self._take(best_preferred), None)
        deadline = oldest + self.max_queue_delay_ns
        if now_ns >= deadline:
            hold = self._hold_until(count, oldest, now_ns)
            if hold is not None and now_ns < hold:
                return Decision(None, hold)
            return Decision(self._take(count), None)
        return Decision(None, deadline)
