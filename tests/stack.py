"""Start a real StageServe stack for tests: real Redis, each service its own process.

Ports are picked at runtime (port 0, announced by each service); every
process is stopped by PID when the test is done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc as grpcclient

from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.launcher import Child, Stack, start_services


@dataclass
class RunningStack:
    stack: Stack
    redis_url: str
    ratelimiter: Child
    scheduler: Child
    gateway: Child
    workers: list[Child]
    repository: Path

    @property
    def url(self) -> str:
        return self.gateway.address

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url)

    def start_worker(self, name: str = "worker-extra") -> Child:
        w = self.stack.start_service(
            name,
            [
                "worker",
                "--listen",
                "127.0.0.1:0",
                "--redis-url",
                self.redis_url,
                "--ratelimiter",
                self.ratelimiter.address,
                "--scheduler",
                self.scheduler.address,
                "--device",
                "cpu",
            ],
        )
        self.workers.append(w)
        return w

    def child(self, name: str) -> Child:
        return next(c for c in self.stack.children if c.name == name)


def start_stack(
    repository: Path,
    control_mode: str = "none",
    load_models: tuple[str, ...] = (),
    workers: int = 1,
    autocomplete: AutoComplete = TRITON_DEFAULT,
    ratelimiter_args: tuple[str, ...] = (),
    repository_poll_secs: float = 15.0,
    metrics_port: int = 0,
    stage_metrics: bool = False,
    gateway_extra: tuple[str, ...] = (),
    scheduler_extra: tuple[str, ...] = (),
    device: str = "cpu",
) -> RunningStack:
    """metrics_port: the gateway's Triton /metrics (0: none); stage_metrics:
    the other stages serve /metrics too (each Child's metrics_port);
    gateway_extra, scheduler_extra: more gateway and scheduler flags;
    device: the workers' device ("cuda:0" for a GPU worker)."""
    stack = Stack()
    try:
        s = start_services(
            stack,
            repository,
            control_mode=control_mode,
            load_models=load_models,
            workers=workers,
            device=device,
            autocomplete=autocomplete,
            ratelimiter_args=ratelimiter_args,
            repository_poll_secs=repository_poll_secs,
            metrics_port=metrics_port,
            stage_metrics=stage_metrics,
            gateway_extra=gateway_extra,
            scheduler_extra=scheduler_extra,
        )
    except BaseException:
        stack.stop()
        raise
    return RunningStack(
        stack, s.redis_url, s.ratelimiter, s.scheduler, s.gateway, s.workers, repository
    )


@contextlib.contextmanager
def running_stack(repository: Path, **kwargs) -> Iterator[RunningStack]:
    running = start_stack(repository, **kwargs)
    try:
        yield running
    finally:
        running.stack.stop()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
