"""When a batch runs on the event loop instead of its instance's thread.

Handing a batch to the instance's thread and back costs the worker about
50-80 µs of CPU (executor queue, thread wake-up, call_soon_threadsafe); for a
model that computes in a few tens of µs that is most of the worker's cost per
batch (py-spy, bench_identity at concurrency 64). A batch runs inline only when
the model has been fast so far *and* nothing else executes on this worker, so
inline runs never serialise instances that could compute in parallel, and a
slow model always keeps the loop free for heartbeats and new batches.
"""

from __future__ import annotations

from dataclasses import dataclass

INLINE_LIMIT_NS = 200_000  # recent executions shorter than this may run inline
_SMOOTHING = 0.2  # weight of the newest execution in the running mean


@dataclass
class InlinePolicy:
    limit_ns: int = INLINE_LIMIT_NS
    mean_ns: float | None = None  # None until the first execution was timed

    def runs_inline(self, executing_on_worker: int) -> bool:
        """`executing_on_worker`: batches already executing on this worker."""
        return (
            executing_on_worker == 0 and self.mean_ns is not None and self.mean_ns < self.limit_ns
        )

    def observe(self, elapsed_ns: int) -> None:
        if self.mean_ns is None:
            self.mean_ns = float(elapsed_ns)
        else:
            self.mean_ns += _SMOOTHING * (elapsed_ns - self.mean_ns)
