"""When a supervised stage that exited is started again (pure; the launcher applies it).

The first restart is almost immediate: a kill -9 or an OOM kill is usually a
one-off, and the stack is degraded until the stage is back. Exits that follow
each other double the delay up to a cap, so a stage that cannot start (bad
flag, port taken, Redis gone for good) costs a retry every few seconds rather
than a busy loop. A stage that stayed up long enough is healthy again: its
next exit starts from the first delay.
"""

from __future__ import annotations

from dataclasses import dataclass

from stageserve.settings import SupervisorSettings


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float
    max_delay_s: float
    # Uptime after which an exit counts as a fresh failure (delay back to the first).
    healthy_after_s: float

    @classmethod
    def of(cls, settings: SupervisorSettings) -> RestartPolicy:
        return cls(
            settings.restart_first_delay_s,
            settings.restart_max_delay_s,
            settings.restart_healthy_after_s,
        )

    def delay(self, consecutive_failures: int) -> float:
        """Delay before the restart that follows the n-th consecutive failure (n >= 1)."""
        n = max(1, consecutive_failures)
        return min(self.max_delay_s, self.first_delay_s * 2 ** (n - 1))


@dataclass
class RestartState:
    """One stage's failure streak under a RestartPolicy."""

    policy: RestartPolicy
    consecutive_failures: int = 0

    def on_exit(self, uptime_s: float) -> float:
        """Record an exit after `uptime_s` of running; returns the delay before restarting."""
        if uptime_s >= self.policy.healthy_after_s:
            self.consecutive_failures = 0
        self.consecutive_failures += 1
        return self.policy.delay(self.consecutive_failures)
