"""Supervision under `stageserve up`: a stage that exits is started again.

Each child is restarted on the address it had announced (services) or on its
port (the embedded Redis, which comes back empty: the stages rebuild what it
held, see docs/deployment.md). Peers keep their gRPC channels to that address
and reconnect on their own; nothing needs to re-resolve anything.

A restarted gateway serves the models that load and does not exit for those
that fail (launcher.RESTART_FLAGS: --exit-on-error is about the stack's start).

Restarts follow stageserve/restart_policy.py, are logged (`stage exited`,
`stage restarting`, `stage restarted` with the downtime) and counted in
`stageserve_stage_restarts_total{stage}`, served on the supervisor's own
/metrics port (the launcher is the only process that sees every exit).

Every restart is spawned from the supervisor's one long-lived thread: the
children's PR_SET_PDEATHSIG fires when the *thread* that forked them ends,
so a child forked from a short-lived thread would be killed with it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, start_http_server

from stageserve.restart_policy import RestartPolicy, RestartState
from stageserve.settings import SupervisorSettings

if TYPE_CHECKING:
    from stageserve.launcher import Child

log = logging.getLogger(__name__)

TICK_S = 0.05

RUNNING, WAITING, STARTING = "running", "waiting", "starting"


@dataclass
class _Watch:
    child: Child
    restarts: RestartState
    state: str = RUNNING
    since: float = field(default_factory=time.monotonic)  # entered this state
    restart_at: float = 0.0
    down_since: float = 0.0


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        settings: SupervisorSettings,
        metrics_port: int | None = None,
    ) -> None:
        self.children = children  # the stack's list: children added later are watched too
        self.policy = RestartPolicy.of(settings)
        self.start_timeout_s = settings.start_timeout_s  # never announced: killed and retried
        self.registry = CollectorRegistry()
        self.restart_counter = Counter(
            "stageserve_stage_restarts",
            "Stages that exited and were started again by `stageserve up`",
            ["stage"],
            registry=self.registry,
        )
        self.metrics_port: int | None = None
        if metrics_port is not None:
            server, _ = start_http_server(metrics_port, addr="0.0.0.0", registry=self.registry)
            self.metrics_port = int(server.server_port)
        self._watches: dict[int, _Watch] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(TICK_S):
            now = time.monotonic()
            for child in list(self.children):
                watch = self._watches.get(id(child))
                if watch is None:
                    watch = self._watches[id(child)] = _Watch(child, RestartState(self.policy))
                try:
                    self._step(watch, now)
                except Exception:  # a failed spawn is one more failure, not the end
                    log.exception("supervising failed", extra={"stage": child.name})
                    self._failed(watch, now, None)

    def _step(self, watch: _Watch, now: float) -> None:
        child = watch.child
        if watch.state == RUNNING:
            if child.proc.poll() is not None:
                watch.down_since = now
                self._failed(watch, now, child.proc.returncode)
        elif watch.state == WAITING:
            if now >= watch.restart_at:
                self._spawn(watch, now)
        elif self._is_ready(child):
            watch.state, watch.since = RUNNING, now
            extra: dict[str, object] = {
                "stage": child.name,
                "address": child.address,
                "pid": child.proc.pid,
                "down_s": round(now - watch.down_since, 3),
            }
            if child.startup_failures:  # a gateway serves on without these (launcher.RESTART_FLAGS)
                extra["models_not_loaded"] = sorted({f["model"] for f in child.startup_failures})
            log.warning("stage restarted", extra=extra)
        elif child.proc.poll() is not None:
            self._failed(watch, now, child.proc.returncode)
        elif now - watch.since > self.start_timeout_s:
            child.proc.kill()
            child.proc.wait()
            self._failed(watch, now, child.proc.returncode)

    def _failed(self, watch: _Watch, now: float, code: int | None) -> None:
        delay = watch.restarts.on_exit(now - watch.since if watch.state == RUNNING else 0.0)
        watch.state, watch.since, watch.restart_at = WAITING, now, now + delay
        log.warning(
            "stage exited",
            extra={"stage": watch.child.name, "code": code, "restart_in_s": round(delay, 3)},
        )

    def _spawn(self, watch: _Watch, now: float) -> None:
        from stageserve.launcher import spawn_redis, spawn_service

        child = watch.child
        watch.state, watch.since = STARTING, now
        child.restarts += 1
        self.restart_counter.labels(child.name).inc()
        if child.name == "redis":
            spawn_redis(child)
        else:
            spawn_service(child, child.restart_cmd())
        log.warning(
            "stage restarting",
            extra={"stage": child.name, "pid": child.proc.pid, "restart": child.restarts},
        )

    @staticmethod
    def _is_ready(child: Child) -> bool:
        from stageserve.launcher import redis_answers

        if child.proc.poll() is not None:
            return False
        if child.name == "redis":
            return redis_answers(int(child.address.rsplit(":", 1)[1]))
        return child.ready.is_set() and bool(child.address)
