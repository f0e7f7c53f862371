"""Stack.stop's order: each stage stops after every client holding a stream to it."""

from __future__ import annotations

import sys

from stageserve.launcher import Child, stop_order


def _child(name: str, service: str) -> Child:
    cmd = [sys.executable, "-m", "stageserve.cli", service, "--listen", "127.0.0.1:0"]
    return Child(name, proc=None, cmd=cmd)  # type: ignore[arg-type]


def test_clients_stop_before_the_stages_they_call() -> None:
    started = [  # start_services' order, then stages added later (tests, supervision)
        _child("redis", "exec"),
        _child("ratelimiter", "ratelimiter"),
        _child("scheduler", "scheduler"),
        _child("worker-0", "worker"),
        _child("worker-1", "worker"),
        _child("gateway", "gateway"),
        _child("scheduler-2", "scheduler"),
        _child("gateway-2", "gateway"),
        _child("worker-extra", "worker"),
    ]
    assert [c.name for c in stop_order(started)] == [
        "gateway-2",
        "gateway",
        "scheduler-2",
        "scheduler",
        "worker-extra",
        "worker-1",
        "worker-0",
        "ratelimiter",
        "redis",
    ]
