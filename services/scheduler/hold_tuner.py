"""Whether the dynamic batcher's adaptive hold is on right now: tried, not guessed.

The hold (batcher.py) keeps a ready batch open while requests keep arriving.
Under load on a CPU-bound stack it grows batches and cuts every stage's CPU
per request: +22-39% throughput at concurrency 32-64 on the 2-core dev
machine. At concurrency 8 it cost identity 22%: the clients it waits for are
the ones whose requests sit in the held batch, and the cores idle meanwhile.
The scheduler cannot tell those cases apart from what it sees (queue depth
~2-3 and ~2,000 arrivals/s in both; docs/benchmarks.md), so the tuner asks
the traffic: it runs a short trial epoch with the hold on and one with it
off, keeps the mode under which requests arrived faster (in a closed loop,
clients send again as soon as they are answered, so arrivals are
throughput), and re-tries every few epochs, as load changes. Ties go to the
hold (bigger batches, less CPU per request): with open-loop traffic the
arrival rate does not depend on the mode, and the hold never delays a lone
request.

Pure: times are passed in (monotonic ns), nothing is read from a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

_TRIAL_ON, _TRIAL_OFF, _KEEP = range(3)


@dataclass
class HoldTuner:
    # One trial or kept epoch. Long enough to count ~1,000 arrivals at the
    # rates that matter (~2,000/s), short enough to follow load changes.
    epoch_ns: int = 500_000_000
    # Epochs the winner is kept before the next pair of trials: the losing
    # mode runs 1 epoch in KEEP_EPOCHS + 2 (a 22% loss costs ~2% overall).
    keep_epochs: int = 8
    # The hold must lose by more than this to be switched off.
    margin: float = 0.03

    def __post_init__(self) -> None:
        self._phase = _TRIAL_ON
        self._epoch_start: int | None = None
        self._epochs_left = 1
        self._arrivals = 0
        self._rate_on = 0
        self._rate_off = 0
        self._kept_on = True
        self._trial_first_on = True  # alternates, so neither trial always goes first

    def arrived(self, now_ns: int) -> None:
        self._advance(now_ns)
        self._arrivals += 1

    def hold_on(self, now_ns: int) -> bool:
        self._advance(now_ns)
        if self._phase == _KEEP:
            return self._kept_on
        return self._phase == _TRIAL_ON

    def _advance(self, now_ns: int) -> None:
        if self._epoch_start is None:
            self._epoch_start = now_ns
            return
        while now_ns - self._epoch_start >= self.epoch_ns:
            rate = self._arrivals
            self._arrivals = 0
            self._epoch_start += self.epoch_ns
            if now_ns - self._epoch_start >= self.epoch_ns:
                # Idle for more than an epoch: nothing to compare; start over
                # from a trial of the hold (a lone request never waits).
                self._epoch_start = now_ns
                self._start_trials()
                return
            self._end_epoch(rate)

    def _end_epoch(self, arrivals: int) -> None:
        self._epochs_left -= 1
        if self._epochs_left > 0:
            return
        if self._phase == _KEEP:
            self._start_trials()
            return
        first_on = self._trial_first_on
        if (self._phase == _TRIAL_ON) == first_on:  # the first trial of the pair
            if self._phase == _TRIAL_ON:
                self._rate_on = arrivals
            else:
                self._rate_off = arrivals
            self._phase = _TRIAL_OFF if self._phase == _TRIAL_ON else _TRIAL_ON
            self._epochs_left = 1
            return
        if self._phase == _TRIAL_ON:
            self._rate_on = arrivals
        else:
            self._rate_off = arrivals
        self._kept_on = self._rate_on >= self._rate_off * (1 - self.margin)
        self._phase = _KEEP
        self._epochs_left = self.keep_epochs
        self._trial_first_on = not first_on

    def _start_trials(self) -> None:
        self._phase = _TRIAL_ON if self._trial_first_on else _TRIAL_OFF
        self._epochs_left = 1
        self._rate_on = 0
        self._rate_off = 0
