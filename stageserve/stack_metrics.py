"""`stageserve up`'s --metrics-port with several gateways: the stack's
Triton metrics, served by the `up` process.

Each gateway serves what it answered itself on a metrics port of its own.
On every scrape this server reads each live gateway's /metrics over
localhost HTTP, all at once with a short timeout, and answers their merge
(stageserve/metrics_merge.py). A gateway that does not answer in time (one
the supervisor is restarting) is left out of that scrape; the answer still
comes, from the others.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

from stageserve.metrics_merge import SHARED_CACHE_RULES, Rule, merge
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


def scrape(ports: Sequence[int], timeout_s: float = FETCH_TIMEOUT_S) -> list[str]:
    """The texts of those of `ports` that answered, in `ports`' order."""
    if not ports:
        return []
    with ThreadPoolExecutor(max_workers=len(ports)) as pool:
        texts = list(pool.map(lambda port: fetch(port, timeout_s), ports))
    return [text for text in texts if text is not None]


def serve_stack_metrics(
    port: int,
    gateway_ports: Callable[[], Sequence[int]],
    rules: Mapping[str, Rule] = SHARED_CACHE_RULES,
    host: str = "0.0.0.0",
) -> ThreadingHTTPServer:
    """Serve the merge of `gateway_ports()`' /metrics on `port` from a daemon
    thread (port 0 picks one). A port it cannot bind raises ListenFailed with
    Triton's message, as a gateway's metrics port does."""
    return serve_metrics(port, host, lambda: merge(scrape(gateway_ports()), rules).encode())
