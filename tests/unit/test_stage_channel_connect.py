"""A stage channel gives a slow peer time to finish its HTTP/2 handshake:
the first RPC to a peer whose SETTINGS frame comes late (a process starved
on a loaded machine) is answered, not failed with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stageserve.net import stage_channel

#: how late the peer's first bytes (its SETTINGS frame) reach the client
HANDSHAKE_DELAY_S = 0.5


def _pump(src: socket.socket, dst: socket.socket, delay_first_s: float) -> None:
    first = True
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            break
        if not data:
            break
        if first:
            time.sleep(delay_first_s)
            first = False
        try:
            dst.sendall(data)
        except OSError:
            break
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _slow_proxy(listener: socket.socket, target_port: int) -> None:
    """Forwards connections to target_port; the server's first bytes late."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", target_port))
        threading.Thread(target=_pump, args=(conn, upstream, 0.0), daemon=True).start()
        threading.Thread(
            target=_pump, args=(upstream, conn, HANDSHAKE_DELAY_S), daemon=True
        ).start()


def test_the_first_rpc_waits_for_a_slow_handshake() -> None:
    async def main() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        threading.Thread(target=_slow_proxy, args=(listener, port), daemon=True).start()
        channel = stage_channel(f"127.0.0.1:{listener.getsockname()[1]}", None)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status
        finally:
            await channel.close()
            await server.stop(0)
            listener.close()

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.SERVING
