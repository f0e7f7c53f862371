"""When an internal stream's writer sends what is queued: now, or a little later.

Each stream message costs a fixed amount of CPU on both ends (grpc.aio's
write, the peer's read and wake-up, the answer's message), whatever it
carries. Requests reach the gateway one unary call at a time, at the pace of
its own CPU, so its stream to the scheduler carried ~1.06 requests per
message at concurrency 64 (the scheduler's answers already carry a whole
batch, ~4 per message). Holding a write until more requests are queued
divides that cost between them.

What it is worth: at commit a6a28bc on the 2-core dev machine, `python -m
bench --models simple` (identity), perf_analyzer sharing the cores, a hold
of up to 2 ms after the first queued request, always on: requests per
message at c=64 1.06 -> 5-6; scheduler CPU per request ~205-225 -> ~125-145
us, gateway ~400-430 -> ~345-385 us; throughput c=32 +11-22%, c=64 +12-30%.
In bench.ceiling's `relay` (three do-nothing processes) at c=64: 2,510
infer/s and 578 us per request without a hold, 4,230 and 269 us with 1.5 ms.

Always on, it lost 24-38% at concurrency 2-4: with so few requests in
flight, the ones it waits for come from the clients whose requests it
holds. The link without a hold (gap between arrivals, round trip, mean in
flight): c=2 0.96 ms, 1.1 ms, 1.8; c=4 0.81, 1.8, 2.9; c=8 0.51, 2.4, 5.0;
c=32-64 0.49, 3.6, 7.9-9.2. The epoch tuner of the dynamic batcher's hold
(services/scheduler/hold_tuner.py) was tried here too: at ~2,000 arrivals/s
its half-second epochs differ by 20-30% from one to the next, more than the
difference it has to see, and it gave 0.85-0.96x at c=2-8 in some rounds.
So a rule decides alone:

- a request with nothing else in flight on the stream is written at once
  (concurrency 1 never waits);
- no hold while 4 or fewer requests are in flight on average (over the last
  ~50 arrivals), nor while the next request is not due within the cap (a
  slow stream gains nothing by waiting);
- otherwise the write waits while the next arrival is due (twice the mean
  gap between arrivals), and at most ``max_hold_ns`` after the first queued
  request.

With the rule, against no hold, two interleaved rounds (identity / mlp):
c=2 0.96-0.98x / 0.96-1.01x and c=4 0.92-0.93x / 1.01-1.02x (where the rule
never holds: run-to-run noise), c=8 0.96-0.99x / 1.14-1.19x, c=32
1.06-1.10x / 1.17-1.24x, c=64 1.05-1.08x / 1.24-1.26x.

Pure: times are passed in (monotonic ns), nothing is read from a clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WriteHold:
    max_hold_ns: int
    # Hold only while more than this many requests are in flight on average.
    min_mean_in_flight: float = 4.0
    # Bounds on the gap after the last arrival that keeps a held write open.
    min_gap_ns: int = 50_000
    gap_weight: float = 0.2  # EWMA weight of the newest gap
    in_flight_weight: float = 0.02  # EWMA weight of the newest in-flight count

    def __post_init__(self) -> None:
        if self.max_hold_ns <= 0:
            raise ValueError("a write hold needs max_hold_ns > 0")
        self.last_arrival_ns: int | None = None
        self.mean_gap_ns = 0.0
        self.mean_in_flight = 0.0

    def arrived(self, now_ns: int, in_flight: int) -> None:
        """A request was queued for the stream; `in_flight` counts it and
        every other request sent or queued and not yet answered."""
        if self.last_arrival_ns is not None:
            gap = max(0, now_ns - self.last_arrival_ns)
            self.mean_gap_ns += self.gap_weight * (gap - self.mean_gap_ns)
        self.last_arrival_ns = now_ns
        self.mean_in_flight += self.in_flight_weight * (in_flight - self.mean_in_flight)

    def write_at(self, first_ns: int, queued: int, in_flight: int, now_ns: int) -> int | None:
        """When to write the `queued` requests (the first queued at
        `first_ns`), with `in_flight` requests sent or queued and not yet
        answered: a time in the future, or None for now."""
        if in_flight <= queued or self.last_arrival_ns is None:
            return None  # nothing else in flight: a lone request never waits
        if self.mean_in_flight <= self.min_mean_in_flight:
            return None
        if self.mean_gap_ns >= self.max_hold_ns:
            return None  # the next request is not due within the cap
        gap = min(max(2 * self.mean_gap_ns, self.min_gap_ns), self.max_hold_ns)
        at = min(first_ns + self.max_hold_ns, self.last_arrival_ns + int(gap))
        return at if at > now_ns else None
