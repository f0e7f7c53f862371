"""Batch formation: a pure state machine with no I/O (unit-tested exhaustively).

The scheduler asks for a batch only when an instance is free to run it, so
while every instance is busy requests accumulate and batches grow.

Triton's dynamic batcher rules, as implemented here:
- requests are taken in arrival order from the head of the queue; a request
  whose non-batch shapes differ from the head's ends the batch (no mixing);
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
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pending:
    """A queued request, as the batcher sees it."""

    batch_size: int  # 1+ ; models without batching use 1
    shape_key: Hashable  # non-batch shapes of every input
    enqueue_ns: int
    payload: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Decision:
    batch: list[Pending] | None  # send this now
    wake_at_ns: int | None  # else: ask again at this time (None: nothing queued)


class Batcher:
    """Shared queue handling; subclasses decide how many requests form a batch."""

    def __init__(self) -> None:
        self.queue: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, request: Pending) -> None:
        self.queue.append(request)

    def drain(self) -> list[Pending]:
        out = list(self.queue)
        self.queue.clear()
        return out

    def remove(self, predicate) -> list[Pending]:
        """Take out every request matching predicate (cancelled, timed out)."""
        kept: deque[Pending] = deque()
        removed = []
        for r in self.queue:
            (removed if predicate(r) else kept).append(r)
        self.queue = kept
        return removed

    def next_batch(self, now_ns: int) -> Decision:
        raise NotImplementedError

    def _take(self, n: int) -> list[Pending]:
        return [self.queue.popleft() for _ in range(n)]


class DefaultBatcher(Batcher):
    """Triton's default scheduler: one request per execution."""

    def next_batch(self, now_ns: int) -> Decision:
        if not self.queue:
            return Decision(None, None)
        return Decision(self._take(1), None)


class DynamicBatcher(Batcher):
    def __init__(
        self,
        max_batch_size: int,
        preferred_batch_sizes: tuple[int, ...] = (),
        max_queue_delay_ns: int = 0,
    ) -> None:
        super().__init__()
        if max_batch_size < 1:
            raise ValueError("dynamic batching needs max_batch_size >= 1")
        self.max_batch_size = max_batch_size
        self.preferred = frozenset(preferred_batch_sizes)
        self.max_queue_delay_ns = max_queue_delay_ns

    def next_batch(self, now_ns: int) -> Decision:
        if not self.queue:
            return Decision(None, None)
        head = self.queue[0]
        total = 0
        count = 0
        best_preferred = 0  # request count of the largest preferred prefix
        blocked = False
        for r in self.queue:
            if r.shape_key != head.shape_key or total + r.batch_size > self.max_batch_size:
                blocked = count > 0
                break
            total += r.batch_size
            count += 1
            if total in self.preferred:
                best_preferred = count
        if count == 0:  # the head alone exceeds max: the gateway prevents this
            return Decision(self._take(1), None)
        if total == self.max_batch_size:
            return Decision(self._take(count), None)
        if blocked:
            return Decision(self._take(best_preferred or count), None)
        if best_preferred:
            return Decision(self._take(best_preferred), None)
        deadline = head.enqueue_ns + self.max_queue_delay_ns
        if now_ns >= deadline:
            return Decision(self._take(count), None)
        return Decision(None, deadline)
