"""What every service process does the same way: health, bind, signals, ready line."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stageserve import heap_freeze, loop_lag
from stageserve.net import add_stage_port, listen_failed
from stageserve.stage_tls import StageTls
from stageserve.telemetry import EVENT_LOOP_LAG

log = logging.getLogger(__name__)

READY_MARKER = "STAGESERVE_READY"
# The gateway's startup load outcome: a JSON list of {model, version, reason}
# for each startup model that is not ready (`stageserve up` prints a summary).
STARTUP_MARKER = "STAGESERVE_STARTUP"
# Why a stage exits before it is ready (a port it cannot bind), for the
# launcher's "did not become ready" line: a JSON string.
FAILED_MARKER = "STAGESERVE_FAILED"

# How long after SIGTERM/SIGINT, beyond the gRPC grace, a stage may take to
# finish its teardown (deregistering, finalizing models, closing clients)
# before it dumps every thread's stack to stderr and exits with status 1.
# Measured on an idle stack, every stage is gone 0.02-0.41 s after its
# launcher is killed (the worker last); a stage still alive 10 s past its
# grace is stuck (a worker has been seen alive 20 s after its launcher was
# killed), and a stuck stage must not outlive its launcher.
SHUTDOWN_SLACK_S = 10.0
# The faulthandler watchdog is cancelled as the interpreter finalizes, so a
# hang after that (a C/C++ library's exit-time destructor, run by exit()) is
# not covered by it: SIGALRM's default action ends the process this long
# after the watchdog's deadline, whatever state the interpreter is in.
EXIT_BACKSTOP_S = 2


def announce_ready(service: str, address: str, extra: dict | None = None) -> None:
    """One machine-readable line on stdout; `stageserve up` waits for it."""
    fields = {"service": service, "address": address, **(extra or {})}
    print(f"{READY_MARKER} {json.dumps(fields)}", flush=True)


def announce_startup(failures: list[dict[str, str]]) -> None:
    """One machine-readable line on stdout once the startup models are loaded."""
    print(f"{STARTUP_MARKER} {json.dumps(failures)}", flush=True)


def announce_failed(reason: str) -> None:
    """One machine-readable line on stdout: why this stage ends before ready."""
    print(f"{FAILED_MARKER} {json.dumps(reason)}", flush=True)


def end_on_listen_failure(exc: Exception) -> NoReturn:
    """tritonserver's one line and exit code (1) for a port a stage cannot
    bind, at once: nothing was served, so nothing is wound down (a stage's
    clean-up awaits, its background tasks' cancellation, have been seen to
    keep such an exit from ever coming)."""
    log.error(str(exc))
    announce_failed(str(exc))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def run_server(
    server: grpc.aio.Server,
    listen: str,
    service: str,
    *,
    stage_tls: StageTls | None,
    grace_s: float = 5.0,
    bound: bool = False,
    before_ready: asyncio.Future | None = None,
    announce: dict | None = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Bind (unless `bound`: the caller bound it), serve gRPC health, announce
    (with `announce`'s extra fields), stop cleanly on SIGTERM/SIGINT.

    `stage_tls` is what `listen` is bound with: an internal stage passes its
    Settings.stage_tls (mutual TLS when configured); None binds plaintext, as
    the gateway's public port without --grpc-use-ssl. Required, so no internal
    stage listens in plaintext by omission."""
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else None
    if health_servicer is None:  # pragma: no cover - older grpcio-health-checking
        health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if bound:
        address = listen
    else:
        host = listen.rsplit(":", 1)[0]
        port = add_stage_port(server, listen, stage_tls)
        if port == 0:
            end_on_listen_failure(listen_failed("GRPC", listen))
        address = f"{host}:{port}"
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    if before_ready is not None:
        # Live but not ready (e.g. the gateway loading models): probes wait.
        await _set_status(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("started, getting ready", extra={"address": address})
        await before_ready
    await _set_status(health_servicer, "", serving)
    log.info("serving", extra={"address": address})
    # Handlers before the ready line: whoever reads it may signal at once.
    stop = asyncio.Event()
    _stop_on_signals(stop, grace_s + SHUTDOWN_SLACK_S)
    heap_freeze.settle("ready")
    announce_ready(service, address, announce)
    lag = asyncio.create_task(loop_lag.probe(EVENT_LOOP_LAG.labels().observe))

    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping", extra={"grace_s": grace_s})
    if before_stop is not None:  # still serving: e.g. a scheduler hands its models over
        try:  # half the grace, so the watchdog's deadline still holds
            await asyncio.wait_for(before_stop(), grace_s / 2)
        except Exception as exc:
            log.warning("before stop failed", extra={"error": repr(exc)})
    await _set_status(health_servicer, "", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_s)
    stopper.cancel()
    lag.cancel()
    sys.stdout.flush()


def _stop_on_signals(stop: asyncio.Event, deadline_s: float) -> None:
    """SIGTERM/SIGINT set `stop`, and arm a watchdog that ends the process
    `deadline_s` later whatever it is doing.

    A plain signal handler rather than loop.add_signal_handler: Python runs it
    on the main thread even while the event loop is blocked (in a lock wait,
    say), so the watchdog is armed whatever state teardown is in. The watchdog
    is faulthandler's C thread: it needs neither the GIL nor the loop. It
    dumps every thread's stack and exits; the kernel's alarm (SIGALRM, default
    action: terminate) ends the process EXIT_BACKSTOP_S later if it is then
    past the interpreter's finalization, where faulthandler no longer runs.
    """
    loop = asyncio.get_running_loop()

    def on_signal(signum: int, _frame: object) -> None:
        faulthandler.dump_traceback_later(deadline_s, exit=True)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(math.ceil(deadline_s) + EXIT_BACKSTOP_S)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how a stage
    # that looks stuck is diagnosed without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


async def _set_status(servicer, name: str, status) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result
