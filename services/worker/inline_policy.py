"""When a batch runs on the event loop instead of its instance's thread.

Handing a batch to the instance's thread and back costs the worker about
50-80 µs of CPU (executor queue, thread wake-up, call_soon_threadsafe); for a
model that computes in a few tens of µs that is most of the worker's cost per
batch (py-spy, bench_identity at concurrency 64). A batch runs inline only when
the model has been fast so far *and* nothing else executes on this worker, so
inline runs never serialise instances that could compute in parallel, and a
slow model always keeps the loop free for heartbeats and new batches.

What is observed is the CPU time of the thread that executed the batch
(time.thread_time_ns), not its wall time: wall time counted what the batch
waited for a core, not what it cost. Measured with `python -m bench
--models simple -c 64` (2 cores shared by every stage and perf_analyzer):
the identity model's batch of ~5 costs 68 us alone (timeit) but its inline
runs took a median 180 us of wall time in the stack, descheduled, so the mean
sat around the 200 us limit and about half of the batches went to the
thread, 420 us from hand-off to answer (those two medians from one
instrumented run that shared the cores with a second benchmark: orders of
magnitude, not figures). With CPU time, three interleaved
rounds against wall time (measured together with the gateway's lighter
per-request records): simple c=64 2,195 / 2,202 / 2,283 against 2,109 /
2,204 / 1,996 infer/s, worker CPU 86-90 against 93-108 us per request; mlp
c=64 2,136 / 2,274 / 2,231 against 2,013 / 2,179 / 2,071. A model whose
execute runs ORT's or torch's thread pool is measured on the calling thread,
which does its share of the work, so a heavy model still measures far above
the limit; on a GPU the thread waits for the device and wall time is kept
(HostedInstance._inline_cost).

The limit is 500 µs of CPU: what an inline run can delay is a batch for
another instance arriving meanwhile, by at most that. At 200 µs two common
models sat just above it in the stack and went to the thread for most
batches: the example accumulator (6 inputs, 6 outputs; a mean 243 µs per
batch in the stack, 114 µs for its execute_batch alone; 215 of 5,454
batches inline at c=8) and `simple` at c=64 (batches of ~7). Three
interleaved rounds on the 2-core VM (docs/benchmarks.md "The inline
limit"), 200 µs against 500 µs: the accumulator's worker CPU per inference
1.21-1.55x `simple`'s against 1.23-1.28x, `simple` c=64 worker 69-89
against 56-63 µs per inference, mlp (batches of ~22, above either limit)
unchanged within noise. A GPU instance keeps 200 µs (GPU_INLINE_LIMIT_NS):
its cost is wall time, an inline run holds the loop while the device
computes, and the larger limit was not measured on a GPU host.
"""

from __future__ import annotations

from dataclasses import dataclass

INLINE_LIMIT_NS = 500_000  # recent executions shorter than this may run inline
GPU_INLINE_LIMIT_NS = 200_000  # the same for a GPU instance, whose cost is wall time
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
