"""Does a long-lived stream between stages beat one unary call per request?

Starts a grpc.aio echo server in a child process with a unary method and a
bidirectional stream method, then drives each from this process with the
same payload (a `simple`-sized request, 2 x 64 bytes) at several numbers of
requests in flight, and prints requests/s and CPU microseconds per request
on each side.

  python -m bench.stream_vs_unary [--seconds 3] [--inflight 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import time

import grpc
import psutil

from stageserve.net import free_port

SERVICE = "bench.Echo"
PAYLOAD = b"x" * 160


async def start_echo_server(port: int) -> grpc.aio.Server:
    """`bench.Echo`: Unary answers the request, Stream yields every message back."""

    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(request_iterator, context):
        async for request in request_iterator:
            yield request

    server = grpc.aio.server()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _serve(port: int, ready) -> None:
    async def main() -> None:
        server = await start_echo_server(port)
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def _drive_unary(channel: grpc.aio.Channel, inflight: int, seconds: float) -> int:
    call = channel.unary_unary(f"/{SERVICE}/Unary")
    done = 0
    deadline = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await call(PAYLOAD)
            done += 1

    await asyncio.gather(*(loop() for _ in range(inflight)))
    return done


async def _drive_stream(channel: grpc.aio.Channel, inflight: int, seconds: float) -> int:
    """Multiplex like the gateway does: ids in a header byte string, futures by id."""
    outbox: asyncio.Queue[bytes] = asyncio.Queue()
    pending: dict[int, asyncio.Future] = {}
    ids = itertools.count()

    async def requests():
        while True:
            yield await outbox.get()

    call = channel.stream_stream(f"/{SERVICE}/Stream")(requests())

    async def reader() -> None:
        async for msg in call:
            pending.pop(int.from_bytes(msg[:8], "little")).set_result(msg)

    reading = asyncio.create_task(reader())
    done = 0
    deadline = time.monotonic() + seconds
    loop_ = asyncio.get_running_loop()

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            i = next(ids)
            fut = loop_.create_future()
            pending[i] = fut
            outbox.put_nowait(i.to_bytes(8, "little") + PAYLOAD)
            await fut
            done += 1

    await asyncio.gather(*(loop() for _ in range(inflight)))
    reading.cancel()
    call.cancel()
    return done


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _run(port: int, server_pid: int, inflights: list[int], seconds: float) -> None:
    print(f"{'mode':>6} {'inflight':>8} {'req/s':>8} {'client us/req':>14} {'server us/req':>14}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        for inflight in inflights:
            for mode, drive in (("unary", _drive_unary), ("stream", _drive_stream)):
                c0, s0 = _cpu(os.getpid()), _cpu(server_pid)
                t0 = time.monotonic()
                n = await drive(channel, inflight, seconds)
                elapsed = time.monotonic() - t0
                c1, s1 = _cpu(os.getpid()), _cpu(server_pid)
                print(
                    f"{mode:>6} {inflight:>8} {n / elapsed:>8.0f} "
                    f"{(c1 - c0) / n * 1e6:>14.0f} {(s1 - s0) / n * 1e6:>14.0f}",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_vs_unary", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--inflight", nargs="+", type=int, default=[1, 16, 64])
    args = parser.parse_args(argv)
    port = free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(20):
            raise RuntimeError("echo server did not start")
        assert server.pid is not None  # set by start()
        asyncio.run(_run(port, server.pid, args.inflight, args.seconds))
    finally:
        server.kill()
        server.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
