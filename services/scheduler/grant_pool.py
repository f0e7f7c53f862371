"""The grants one model queue holds between batches: a pure state machine
(no I/O, time passed in), unit-tested on its own; ModelQueue does the
releasing.

Grants are reused: a batch that finishes hands its grant back, and the pool
keeps it while the queue has work (up to `reuse_s` after it was acquired,
then it goes back to the rate limiter so other schedulers get their turn)
and for `standby_s` once the queue is idle. At steady load no rate-limiter
round trip is on a request's path. Not kept: a grant whose execution failed
or whose instance went away, and a grant holding rate_limiter resources
(`--rate-limit=execution_count`): other instances wait for those resources,
so it goes back after every execution, as in Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

G = TypeVar("G")


class Usable(Enum):
    OK = "ok"
    BROKEN = "broken"  # its worker's stream broke: release it as failed
    LOST = "lost"  # the rate limiter dropped it: release it (a no-op there)


@dataclass(frozen=True)
class Held(Generic[G]):
    grant: G
    since: float  # when it was acquired


class GrantPool(Generic[G]):
    def __init__(self, reuse_s: float, standby_s: float) -> None:
        """`reuse_s`: how long one grant may be reused before it goes back to
        the rate limiter (well inside the grant lease, so a held grant never
        expires under us); `standby_s`: how long an idle queue keeps its grants
        (SchedulerSettings.grant_reuse_s, standby_hold_s)."""
        self.reuse_s = reuse_s
        self.standby_s = standby_s
        self._spare: list[Held[G]] = []
        self._idle_since: float | None = None

    def __len__(self) -> int:
        return len(self._spare)

    def acquired(self, grant: G, now: float) -> None:
        """A grant fresh from the rate limiter, not used yet."""
        self._spare.append(Held(grant, now))

    def put_back(self, held: Held[G]) -> None:
        """A grant taken for a batch that did not form."""
        self._spare.append(held)

    def finished(
        self, held: Held[G], failed: bool | None, holds_resources: bool, now: float
    ) -> bool:
        """A batch ended on this grant: True if the pool keeps it, False if the
        caller must release it (as failed when `failed` is True)."""
        if failed is not False or holds_resources or now - held.since > self.reuse_s:
            return False
        self._spare.append(held)
        return True

    def take(
        self,
        usable: Callable[[G], Usable],
        fits: Callable[[G], bool] | None = None,
        now: float = 0.0,
    ) -> tuple[Held[G] | None, list[tuple[G, bool]]]:
        """A usable held grant that `fits` (most recent first) or None, and
        the unusable ones met on the way: (grant, release as failed) for the
        caller. Grants that do not fit stay held (a sequence's instance may
        be needed again soon) until `reuse_s` after they were acquired, then
        go back (not failed) so other queues get their instances."""
        releases: list[tuple[G, bool]] = []
        unfit: list[Held[G]] = []
        found: Held[G] | None = None
        while self._spare:
            held = self._spare.pop()
            state = usable(held.grant)
            if state is not Usable.OK:
                releases.append((held.grant, state is Usable.BROKEN))
            elif fits is None or fits(held.grant):
                found = held
                break
            elif now - held.since > self.reuse_s:
                releases.append((held.grant, False))
            else:
                unfit.append(held)
        self._spare.extend(reversed(unfit))
        return found, releases

    def busy(self) -> None:
        """The queue has work: no standby hold is running."""
        self._idle_since = None

    def idle(self, now: float) -> float | None:
        """The queue has no work. None: nothing held (wait for an arrival);
        0.0: the standby hold ran out (the caller releases `drain()`); else the
        seconds the hold has left."""
        if not self._spare:
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = now
        remaining = self.standby_s - (now - self._idle_since)
        if remaining <= 0:
            self._idle_since = None
            return 0.0
        return remaining

    def drain(self) -> list[G]:
        spare, self._spare = self._spare, []
        return [h.grant for h in spare]
