"""Keep the stack's merged Triton counters monotonic while gateways restart.

`stageserve up --gateways N` serves --metrics-port as the sum of every
gateway's counters (stageserve/metrics_merge.py). A gateway the supervisor
restarts comes back at 0, and one that does not answer a scrape in time
has no figures in it; summed as read, the stack's counter would go down,
and Prometheus reads any decrease as a counter reset: `rate()` and
`increase()` then count the whole remaining total as new, a spike of N-1
gateways' lifetime traffic. One Triton process only resets when it
restarts as a whole, so its counters never do this.

`CounterCarry` holds, per gateway (its metrics port, which a restart keeps),
what each counter read last and a base carried over its resets:

- a value below the last read (the gateway restarted) adds the last read
  to the base, so base + value goes on from where it was;
- a label set the gateway no longer shows (a restarted gateway shows a
  model's counters from its first request on) counts as a reset to 0;
- a gateway that does not answer keeps its last counters in the sum (its
  gauges, readings of the moment, are left out).

Only the counter families (telemetry.TRITON_FAMILIES' kind "counter") are
carried; the rest merge as read.
"""

from __future__ import annotations

from collections.abc import Mapping

from stageserve.metrics_merge import Samples, parse
from stageserve.telemetry import TRITON_FAMILIES, Labels

COUNTERS = frozenset(name for name, (kind, _) in TRITON_FAMILIES.items() if kind == "counter")

_Series = tuple[str, Labels]


class CounterCarry:
    def __init__(self) -> None:
        self._last: dict[int, dict[_Series, float]] = {}  # as read
        self._base: dict[int, dict[_Series, float]] = {}
        self._incarnation: dict[int, int | None] = {}

    def samples(
        self,
        texts: Mapping[int, str | None],
        incarnations: Mapping[int, int] | None = None,
    ) -> list[Samples]:
        """Each gateway's samples to merge, counters carried: `texts` maps
        each gateway's metrics port to its /metrics text, None for one that
        did not answer; a gateway read before and missing from `texts` (not
        running) is held as one that did not answer. `incarnations` (each
        gateway's pid) tells a restart that a counter's value alone would
        not show (a restarted gateway past its old count by the next scrape)."""
        out: list[Samples] = []
        for source, text in texts.items():
            incarnation = (incarnations or {}).get(source)
            if text is None:
                if source in self._last:
                    out.append(self._carried(source, {}))
                continue
            if self._incarnation.setdefault(source, incarnation) != incarnation:
                self._incarnation[source] = incarnation
                self._reset_where_lower(source, {})  # all of it
            read = parse(text)
            now = {(n, labels): v for n in COUNTERS for labels, v in read.pop(n, {}).items()}
            self._reset_where_lower(source, now)
            out.append(self._carried(source, read))
        out.extend(self._carried(source, {}) for source in self._last if source not in texts)
        return out

    def _reset_where_lower(self, source: int, now: dict[_Series, float]) -> None:
        last = self._last.get(source, {})
        base = self._base.setdefault(source, {})
        for series, before in last.items():
            if now.get(series, 0.0) < before:
                base[series] = base.get(series, 0.0) + before
        # a series read before and missing now is carried at its base
        self._last[source] = {**dict.fromkeys(base, 0.0), **now}

    def _carried(self, source: int, samples: Samples) -> Samples:
        base = self._base.get(source, {})
        for (name, labels), value in self._last[source].items():
            samples.setdefault(name, {})[labels] = base.get((name, labels), 0.0) + value
        return samples
