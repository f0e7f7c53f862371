"""What one internal stream costs per request (stageserve/transport.py, isolated).

Starts an echo server in a child process whose ``Schedule`` stream is
``serve_stream`` answering every ScheduleRequest with a ScheduleResponse
carrying its inputs back, then drives it from this process through a
``StreamLink`` with N calls in flight. Prints calls/s, client and server CPU
microseconds per call, and requests per stream message each way: the fixed
cost of a stream message against the cost of one more request in it. The
echo server runs on each server an internal stage may serve with
(stageserve/net.py ``stage_server``: grpc.aio's, and StageServe's own HTTP/2
server), interleaved, so their costs compare in one run.

The client end runs on each client a stage may dial with (grpc.aio's
channel, and the own HTTP/2 client, stageserve/h2grpc/client.py), each
against each server.

  python -m bench.transport [--seconds 3] [--inflight 1 16 64] [--servers grpcio h2]
      [--clients grpcio h2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from typing import Any

import grpc
import psutil

from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.h2grpc.client import H2Channel
from stageserve.net import free_port, stage_server
from stageserve.transport import StreamLink, serve_stream

# A `simple`-sized request: two INT32 [1, 16] inputs.
INPUTS = [
    pb.Tensor(name=f"INPUT{i}", datatype="INT32", shape=[1, 16], raw=bytes(64)) for i in range(2)
]


class _Echo(pb_grpc.SchedulerServicer):
    def __init__(self, counters) -> None:
        self.counters = counters  # [messages in, messages out, requests]

    async def Schedule(self, request_iterator, context):
        counters = self.counters

        def unpack(message: pb.ScheduleBatch):
            counters[0] += 1
            counters[2] += len(message.requests)
            return message.requests

        def pack(responses: list[pb.ScheduleResponse]) -> pb.ScheduleResponses:
            counters[1] += 1
            return pb.ScheduleResponses(responses=responses)

        def handle(request: pb.ScheduleRequest, respond) -> None:
            respond(pb.ScheduleResponse(id=request.id, outputs=request.inputs))

        # grpc.aio wants the servicer method itself to be an async generator.
        async for message in serve_stream(
            request_iterator, unpack=unpack, pack=pack, handle=handle
        ):
            yield message


def _serve(kind: str, port: int, ready, counters) -> None:
    async def main() -> None:
        server = stage_server(kind)
        pb_grpc.add_SchedulerServicer_to_server(_Echo(counters), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _drive(client: str, port: int, inflight: int, seconds: float) -> tuple[int, int]:
    """(calls answered, messages written by the client) in `seconds`."""
    written = 0

    def pack(requests: list[pb.ScheduleRequest]) -> pb.ScheduleBatch:
        nonlocal written
        written += 1
        return pb.ScheduleBatch(requests=requests)

    address = f"127.0.0.1:{port}"
    channel: Any = H2Channel(address) if client == "h2" else grpc.aio.insecure_channel(address)
    try:
        await channel.channel_ready()
        link: StreamLink[pb.ScheduleRequest, pb.ScheduleResponse] = StreamLink(
            name="echo",
            open_call=pb_grpc.SchedulerStub(channel).Schedule,
            pack=pack,
            unpack=lambda message: message.responses,
            on_break=lambda code, details: RuntimeError(f"{code.name}: {details}"),
        )
        done = 0
        deadline = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await link.call(pb.ScheduleRequest(model="echo", inputs=INPUTS))
                done += 1

        await asyncio.gather(*(loop() for _ in range(inflight)))
        await link.close()
    finally:
        await channel.close()
    return done, written


def _row(
    args: argparse.Namespace,
    client: str,
    kind: str,
    inflight: int,
    port: int,
    counters: Any,
    child: multiprocessing.Process,
) -> None:
    assert child.pid is not None  # set by start()
    before = list(counters)
    c0, s0, t0 = _cpu(os.getpid()), _cpu(child.pid), time.monotonic()
    n, written = asyncio.run(_drive(client, port, inflight, args.seconds))
    elapsed = time.monotonic() - t0
    c1, s1 = _cpu(os.getpid()), _cpu(child.pid)
    msgs_in = counters[0] - before[0]
    msgs_out = max(1, counters[1] - before[1])
    print(
        f"{client:>7} {kind:>7} {inflight:>8} {n / elapsed:>8.0f} "
        f"{(c1 - c0) / n * 1e6:>9.0f} {(s1 - s0) / n * 1e6:>9.0f} "
        f"{n / max(1, msgs_in or written):>10.2f} {n / msgs_out:>11.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--inflight", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole table")
    parser.add_argument("--servers", nargs="+", choices=("grpcio", "h2"), default=["grpcio", "h2"])
    parser.add_argument("--clients", nargs="+", choices=("grpcio", "h2"), default=["grpcio", "h2"])
    args = parser.parse_args(argv)
    servers: dict[str, tuple[int, Any, multiprocessing.Process]] = {}
    print(
        f"{'client':>7} {'server':>7} {'inflight':>8} {'calls/s':>8} {'client us':>9} "
        f"{'server us':>9} {'req/msg in':>10} {'req/msg out':>11}"
    )
    try:
        for kind in args.servers:
            port = free_port()
            ready = multiprocessing.Event()
            counters = multiprocessing.Array("q", 3, lock=False)
            child = multiprocessing.Process(
                target=_serve, args=(kind, port, ready, counters), daemon=True
            )
            servers[kind] = (port, counters, child)
            child.start()
            if not ready.wait(20):
                raise RuntimeError(f"echo server ({kind}) did not start")
        for _ in range(args.rounds):
            for inflight in args.inflight:
                for kind, (port, counters, child) in servers.items():
                    for client in args.clients:
                        _row(args, client, kind, inflight, port, counters, child)
    finally:
        for _, _, child in servers.values():
            child.kill()
            child.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
