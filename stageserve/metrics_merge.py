"""The stack's Triton metrics from several gateways' /metrics texts.

`stageserve up --gateways N` (N > 1) serves `--metrics-port` from the `up`
process: each scrape reads every live gateway's own /metrics and answers
what one Triton process would (stageserve/stack_metrics.py does the
fetching and serving; this module is the pure part: texts in, text out).

Only Triton's families (telemetry.TRITON_FAMILIES) are read; StageServe's
own `stageserve_*` families stay on each stage's own port. The answer is
rendered by telemetry.TritonMetrics, so names, HELP/TYPE lines, label order
and number format are the gateways' own.

How each family combines across gateways (RULES, one entry per family):

* SUM, per identical label set: every Triton counter (requests, failures by
  reason, inferences, executions, durations, per-model cache hits and
  misses), which each gateway counts for what it answered itself; the
  cache-wide lookup, hit, miss, eviction and duration figures, typed gauge
  as in Triton but counted per gateway (services/gateway/cache_metrics.py).
* MAX for `nv_inference_pending_request_count`: every gateway reports the
  whole stack's backlog, asked of the schedulers as it is scraped
  (services/gateway/queue_metrics.py), so the figures are the same but for
  a scheduler one gateway could not reach in time; the highest is the
  fullest view.
* FIRST, the first text that has the label set: host readings every
  process takes alike (`nv_cpu_*`, `nv_gpu_*`, `nv_energy_consumption`: one
  host, so summing would count it N times), and `nv_model_load_duration_secs`
  (the first gateway runs the stack's startup loads; the others adopt them).
* LATEST for `nv_cache_num_entries` / `nv_cache_util` with a shared (redis)
  cache: each gateway reports the one cache as its own last insertion left
  it, so the highest is the most recent view of a filling cache (a gateway
  that has inserted nothing reports 0). With a `local` cache each gateway
  has its own LRU of the same size: entries are summed (SUM) and the
  utilization is the mean (MEAN), the stack's bytes held over its bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum

from stageserve.telemetry import CACHE_COUNTS, TRITON_FAMILIES, Labels, TritonMetrics


class Rule(Enum):
    SUM = "sum"
    FIRST = "first"
    LATEST = "latest"  # the highest value: see the module's docstring
    MAX = "max"
    MEAN = "mean"


_HOST_GAUGES = (
    "nv_pinned_memory_pool_total_bytes",
    "nv_pinned_memory_pool_used_bytes",
    "nv_cpu_utilization",
    "nv_cpu_memory_total_bytes",
    "nv_cpu_memory_used_bytes",
    "nv_gpu_utilization",
    "nv_gpu_memory_total_bytes",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_power_usage",
    "nv_gpu_power_limit",
    "nv_energy_consumption",
    "nv_model_load_duration_secs",
)

#: With the response cache in Redis (or none): one cache behind every gateway.
SHARED_CACHE_RULES: dict[str, Rule] = {
    **{name: Rule.SUM for name, (kind, _) in TRITON_FAMILIES.items() if kind == "counter"},
    **{name: Rule.SUM for name in CACHE_COUNTS},
    **{name: Rule.FIRST for name in _HOST_GAUGES},
    "nv_inference_pending_request_count": Rule.MAX,
    "nv_cache_num_entries": Rule.LATEST,
    "nv_cache_util": Rule.LATEST,
}
#: With `--cache-config local`: an LRU of the same size in every gateway.
LOCAL_CACHE_RULES: dict[str, Rule] = {
    **SHARED_CACHE_RULES,
    "nv_cache_num_entries": Rule.SUM,
    "nv_cache_util": Rule.MEAN,
}

Samples = dict[str, dict[Labels, float]]

# Parsed here, not with prometheus_client's text parser: that one drops a
# counter's samples whose name lacks `_total`, and Triton's counters have none.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str) -> Samples:
    """The Triton families' samples in one /metrics text (in the text's
    order, labels in the text's order); every other line is skipped."""
    out: Samples = {}
    for line in text.splitlines():
        if not line.startswith("nv_"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in TRITON_FAMILIES:
            continue
        name, label_text, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.setdefault(name, {})[_labels(label_text or "")] = number
    return out


def _labels(text: str) -> Labels:
    return tuple(
        (key, re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value))
        for key, value in _LABEL.findall(text)
    )


def merge(texts: Iterable[str], rules: Mapping[str, Rule] = SHARED_CACHE_RULES) -> str:
    """One Triton exposition of several processes' /metrics `texts` (the
    first first: FIRST takes its values), each family combined by `rules`."""
    return merge_samples([parse(text) for text in texts], rules)


def merge_samples(parsed: Sequence[Samples], rules: Mapping[str, Rule] = SHARED_CACHE_RULES) -> str:
    """As merge, of texts already parsed."""
    merged = TritonMetrics()
    for name in TRITON_FAMILIES:
        rule = rules.get(name, Rule.FIRST)
        seen: dict[Labels, list[float]] = {}
        for samples in parsed:
            for labels, value in samples.get(name, {}).items():
                seen.setdefault(labels, []).append(value)
        for labels, values in seen.items():
            merged.set(name, labels, _combine(rule, values))
    return merged.render()


def _combine(rule: Rule, values: list[float]) -> float:
    if rule is Rule.SUM:
        return sum(values)
    if rule in (Rule.LATEST, Rule.MAX):
        return max(values)
    if rule is Rule.MEAN:
        return sum(values) / len(values)
    return values[0]
