"""`stageserve up` run as a user runs it: the CLI in its own process.

Every port is 0 (the gateway binds what the kernel gives and `up` announces
it), so no other process on the machine can take a port between its choice
and its bind. stdout and stderr are read to their end in threads (a full pipe
would block the server); the JSON lines on them are the announce line, the
startup summary and every stage's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from bench.references import stop_process
from stageserve.net import free_port


def collect(stream: IO[str] | None, into: list[str]) -> threading.Thread:
    """Read a pipe to its end in a thread, line by line into `into`."""
    assert stream is not None
    thread = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    thread.start()
    return thread


def json_line(line: str) -> dict[str, Any]:
    """A JSON object line, else {}."""
    if not line.startswith("{"):
        return {}
    try:
        parsed = json.loads(line)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class UpProcess:
    """`stageserve up` on `repository` with `args` (after the ports and
    `--device cpu`), in its own session; `env` replaces os.environ. One
    gateway, scheduler and worker unless `args` say otherwise: `up` sizes
    them from the host by default, and a test must start the same stack on
    any machine."""

    def __init__(
        self, repository: Path, args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            self.command(repository, args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env if env is not None else os.environ.copy(),
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [collect(self.proc.stdout, self.out), collect(self.proc.stderr, self.err)]

    @staticmethod
    def command(repository: Path, args: Sequence[str] = ()) -> list[str]:
        """The command line it runs."""
        return [
            sys.executable, "-m", "stageserve.cli", "up",
            "--model-repository", str(repository),
            "--grpc-port", "0", "--grpc-address", "127.0.0.1",
            "--http-port", "0", "--http-address", "127.0.0.1",
            "--metrics-port", "0",
            "--device", "cpu",
            *(
                arg
                for flag in ("--gateways", "--schedulers", "--workers")
                if flag not in args
                for arg in (flag, "1")
            ),
            *args,
        ]  # fmt: skip

    def info(self) -> dict[str, Any] | None:
        """The `stageserve up` announce line, once printed."""
        for line in list(self.out):
            entry = json_line(line)
            if entry.get("event") == "stageserve up":
                return entry
        return None

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Until `up` announced its services (returns the line) or exited (None)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.info()
            if info is not None:
                return info
            if self.proc.poll() is not None:
                for reader in self._readers:
                    reader.join(10)
                return self.info()
            time.sleep(0.1)
        raise TimeoutError(f"stageserve up neither served nor exited within {timeout_s:.0f}s")

    def grpc_url(self) -> str:
        info = self.info()
        assert info is not None
        return str(info["grpc"])

    def http_url(self) -> str:
        info = self.info()
        assert info is not None
        return str(info["http"])

    def gateway_metrics_ports(self) -> list[int]:
        """Each gateway's own metrics port (with several gateways)."""
        info = self.info()
        assert info is not None
        return [int(g["metrics_port"]) for g in info["gateways"]]

    def events(self, event: str, stream: str = "both") -> list[dict[str, Any]]:
        """The JSON lines whose `event` is this (the launcher's own lines)."""
        lines = {"out": self.out, "err": self.err, "both": [*self.out, *self.err]}[stream]
        return [e for e in map(json_line, list(lines)) if e.get("event") == event]

    def logs(self, msg: str) -> list[dict[str, Any]]:
        """The stages' log lines (stderr) whose message is this."""
        return [e for e in map(json_line, list(self.err)) if e.get("msg") == msg]

    def stop(self) -> int:
        """SIGTERM `up` (it stops its stages) and wait; its exit code."""
        stop_process(self.proc)
        for reader in self._readers:
            reader.join(10)
        return self.proc.wait()

    def __enter__(self) -> UpProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def up_with_gateways(repository: Path, gateways: int = 2) -> Iterator[tuple[UpProcess, int]]:
    """`stageserve up --gateways N --metrics-port P` once it serves: (it, P),
    P the stack's merged metrics port."""
    port = free_port()
    with UpProcess(repository, ["--gateways", str(gateways), "--metrics-port", str(port)]) as up:
        info = up.wait(240)
        assert info is not None, "".join(up.err[-40:])
        yield up, port


def scrape_metrics(port: int) -> str:
    """The /metrics text on localhost:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())
