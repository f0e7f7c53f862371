"""Run the HTTP front inside the gateway process, on the gateway's event loop.

The front shares the DataPlane (and so the scheduler stream, statistics and
shared-memory registrations) with the gRPC front, which is why it runs
embedded on the same asyncio loop rather than as separate server workers:
one gateway process serves both protocols, and more gateways scale both.

Two embeddable servers were measured with perf_analyzer -i http
(docs/benchmarks.md, `python -m bench.http --http-servers`): uvicorn with its
httptools protocol, and granian's experimental embedded mode (Rust HTTP on its
own threads, handing each request to our loop). uvicorn served as much or
more at every concurrency in two runs, with a lower p99 at concurrency 1; it
is the default, also because it takes an already bound socket (port 0 works
without a race) and is not experimental. GatewaySettings.http_server
(STAGESERVE_GATEWAY_HTTP_SERVER=granian) selects the other one, for that
comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Protocol

import uvicorn

from services.gateway.http.app import HttpFront

log = logging.getLogger(__name__)


class HttpServer(Protocol):
    address: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def http_server(
    app: HttpFront, host: str, port: int, kind: str = "uvicorn", reuse_port: bool = False
) -> HttpServer:
    """`kind`: GatewaySettings.http_server (its choices are checked with the tree).
    `reuse_port`: Triton's --reuse-http-port, several gateways on one port."""
    if kind == "granian":
        return GranianServer(app, host, port, reuse_port)
    return UvicornServer(app, host, port, reuse_port)


def _listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        # Every gateway binds with it, so the kernel accepts several listeners
        # on the port and spreads new connections over them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted connections inherit it. Without it a response written in two
    # parts (headers, body) waits for the client's delayed ACK: measured 48 ms
    # per request at concurrency 1 instead of 2 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _EmbeddedUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gateway's own SIGTERM handling stops everything in order.
        yield


class UvicornServer:
    def __init__(self, app: HttpFront, host: str, port: int, reuse_port: bool = False) -> None:
        self.sock = _listen(host, port, reuse_port)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(
            app,
            loop="none",
            http="httptools",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
        )
        self._server = _EmbeddedUvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the reason it stopped
                raise RuntimeError("HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP front serving", extra={"address": self.address, "server": "uvicorn"})

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()


class GranianServer:
    """granian binds itself: port 0 is resolved to a free port first."""

    def __init__(self, app: HttpFront, host: str, port: int, reuse_port: bool = False) -> None:
        if reuse_port:  # its embedded Server binds itself and takes no socket option
            raise ValueError("the granian HTTP server cannot share its port: use uvicorn")
        from granian.constants import HTTPModes, Interfaces
        from granian.server.embed import Server

        if port == 0:
            with contextlib.closing(_listen(host, 0)) as probe:
                port = probe.getsockname()[1]
        self.address = f"{host}:{port}"
        self._server = Server(
            app,
            address=host,
            port=port,
            interface=Interfaces.ASGINL,
            http=HTTPModes.http1,
            websockets=False,
            backlog=1024,
            log_enabled=False,
        )
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        host, port = self.address.rsplit(":", 1)
        for _ in range(500):  # ready once it accepts connections
            if self._task.done():
                self._task.result()
                raise RuntimeError("HTTP server stopped while starting")
            try:
                _, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.01)
                continue
            writer.close()
            log.info("HTTP front serving", extra={"address": self.address, "server": "granian"})
            return
        raise RuntimeError(f"granian did not start listening on {self.address}")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.stop()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, 10)
