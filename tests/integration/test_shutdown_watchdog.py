"""A stage whose teardown hangs still exits after SIGTERM, and says where it hung.

Every stage serves through stageserve.service_runtime.run_server; these run a
real gRPC server in a separate process whose teardown blocks (on the event
loop's thread, which is also where a lock wait would block it) and check that
SIGTERM ends it within the grace plus the watchdog's slack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_STAGE = textwrap.dedent(
    """
    import asyncio, ctypes, sys, threading, time
    import grpc
    from stageserve import service_runtime

    service_runtime.SHUTDOWN_SLACK_S = float(sys.argv[1])

    def teardown_that_never_ends():
        threading.Event().wait()  # a lock wait nobody will release

    def exit_that_never_ends():
        # A C exit-time handler (as a library's static destructor is) that
        # blocks: exit() runs it after the interpreter finalized.
        libc = ctypes.CDLL(None)
        libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None)

    async def main():
        server = grpc.aio.server()
        try:
            await service_runtime.run_server(
                server, "127.0.0.1:0", "stuck", stage_tls=None, grace_s=0.5
            )
        finally:
            if sys.argv[2] == "hang":
                teardown_that_never_ends()
            if sys.argv[2] == "hang_at_exit":
                exit_that_never_ends()

    asyncio.run(main())
    """
)


def _start(slack_s: float, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _STAGE, str(slack_s), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line: handlers are installed
    assert line.startswith("STAGESERVE_READY"), line
    return proc


def _terminate(proc: subprocess.Popen) -> tuple[str, float]:
    """SIGTERM; the stage's stderr and the seconds it took to exit."""
    try:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
        return stderr, time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stuck_teardown_is_ended_with_every_thread_stack() -> None:
    proc = _start(slack_s=1.0, mode="hang")
    stderr, took = _terminate(proc)
    assert proc.returncode == 1
    assert 1.4 <= took < 10, took  # grace 0.5 s + slack 1 s, then gone
    assert "Timeout" in stderr and "teardown_that_never_ends" in stderr, stderr


def test_a_hang_after_the_interpreter_finalized_is_ended_by_the_alarm() -> None:
    proc = _start(slack_s=1.0, mode="hang_at_exit")
    stderr, took = _terminate(proc)
    # faulthandler's watchdog is gone by then; SIGALRM's default action ends
    # it at ceil(grace 0.5 s + slack 1 s) + EXIT_BACKSTOP_S = 4 s
    assert proc.returncode == -signal.SIGALRM, (proc.returncode, stderr)
    assert 3.5 <= took < 10, took


def test_a_clean_teardown_exits_zero_before_the_watchdog() -> None:
    proc = _start(slack_s=30.0, mode="clean")
    stderr, took = _terminate(proc)
    assert proc.returncode == 0, stderr
    assert took < 10, took
    assert "Timeout" not in stderr


def test_sigusr1_prints_every_thread_and_keeps_serving() -> None:
    proc = _start(slack_s=30.0, mode="clean")
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # still serving
    finally:
        stderr, _ = _terminate(proc)
    assert proc.returncode == 0
    assert "Current thread" in stderr or "Thread 0x" in stderr, stderr
