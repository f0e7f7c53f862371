"""`stageserve up`'s --metrics-port with several gateways: the stack's
Triton metrics, served by the `up` process.

Each gateway serves what it answered itself on a metrics port of its own.
On every scrape this server reads each live gateway's /metrics over
localhost HTTP, all at once with a short timeout, and answers their merge
(stageserve/metrics_merge.py). A gateway that does not answer in time (one
the supervisor is restarting) does not hold the answer up: its counters stay
in the sum as last read and carry over its restart (counter_carry.py), its
gauges are left out of that scrape.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

from stageserve.counter_carry import CounterCarry
from stageserve.metrics_merge import SHARED_CACHE_RULES, Rule, merge_samples
from stageserve.telemetry import serve_metrics

#: Per gateway and scrape: a live gateway renders its /metrics in
#: milliseconds; Prometheus' own scrape timeout is 10 s by default.
FETCH_TIMEOUT_S = 1.0


def fetch(port: int, timeout_s: float = FETCH_TIMEOUT_S) -> str | None:
    """The /metrics text on localhost:`port`, None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            return str(r.read().decode())
    except (OSError, ValueError):  # refused, reset, timed out, not HTTP
        return None


def scrape(ports: Sequence[int], timeout_s: float = FETCH_TIMEOUT_S) -> list[str | None]:
    """The texts of `ports` in their order, None for one that did not answer."""
    if not ports:
        return []
    with ThreadPoolExecutor(max_workers=len(ports)) as pool:
        return list(pool.map(lambda port: fetch(port, timeout_s), ports))


class StackMetrics:
    """What --metrics-port answers: the merge of the live gateways' texts,
    their counters carried over restarts and silences (counter_carry.py).
    `gateways()` lists (metrics port, pid) of the gateways running now, the
    first gateway first. Scrapes come on the server's threads: one at a time."""

    def __init__(
        self,
        gateways: Callable[[], Sequence[tuple[int, int]]],
        rules: Mapping[str, Rule] = SHARED_CACHE_RULES,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.gateways = gateways
        self.rules = rules
        self.timeout_s = timeout_s
        self._carry = CounterCarry()
        self._lock = threading.Lock()

    def render(self) -> bytes:
        with self._lock:
            running = list(self.gateways())
            texts = scrape([port for port, _ in running], self.timeout_s)
            reads = {port: text for (port, _), text in zip(running, texts, strict=True)}
            samples = self._carry.samples(reads, dict(running))
            return merge_samples(samples, self.rules).encode()


def serve_stack_metrics(
    port: int,
    gateways: Callable[[], Sequence[tuple[int, int]]],
    rules: Mapping[str, Rule] = SHARED_CACHE_RULES,
    host: str = "0.0.0.0",
) -> ThreadingHTTPServer:
    """Serve StackMetrics(gateways, rules) on `port` from a daemon thread
    (port 0 picks one). A port it cannot bind raises ListenFailed with
    Triton's message, as a gateway's metrics port does."""
    return serve_metrics(port, host, StackMetrics(gateways, rules).render)
