"""Run the HTTP front inside the gateway process, on the gateway's event loop.

The front shares the DataPlane (and so the scheduler stream, statistics and
shared-memory registrations) with the gRPC front, which is why it runs
embedded on the same asyncio loop rather than as separate server workers:
one gateway process serves both protocols, and more gateways scale both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from services.gateway.http.app import HttpFront

log = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gateway's own SIGTERM handling stops everything in order.
        yield


class HttpServer:
    """The front on uvicorn's httptools protocol (chosen by measurement:
    docs/benchmarks.md), bound to a socket we open so port 0 works."""

    def __init__(self, app: HttpFront, host: str, port: int) -> None:
        self.sock = socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
        )
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.sock.listen(1024)
        self.sock.setblocking(False)
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
        import os

        if os.environ.get("STAGESERVE_HTTP_SERVER") == "granian":
            from granian.constants import Interfaces
            from granian.server.embed import Server

            port = int(self.address.rsplit(":", 1)[1])
            self.sock.close()
            self._server = Server(
                self._server.config.app,
                address=self.address.rsplit(":", 1)[0],
                port=port,
                interface=Interfaces.ASGINL,
                log_enabled=False,
                websockets=False,
                http="1",
                backlog=1024,
            )
            self._task = asyncio.create_task(self._server.serve())
            await asyncio.sleep(0.5)
            return
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the reason it stopped
                raise RuntimeError("HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP front serving", extra={"address": self.address})

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()
