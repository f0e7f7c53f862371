"""How fast can one Python gRPC process answer Triton's protocol on this machine?

StageServe is a pipeline of Python gRPC processes (gateway -> scheduler ->
worker). This module measures the *ceiling* of such a design: servers that do
no inference at all, only speak ``GRPCInferenceService`` for one model
``id16`` (FP32 ``INPUT0``/``OUTPUT0``, dims [16], max_batch_size 64) and
answer ``OUTPUT0`` = the raw input bytes. Each variant runs in its own child
process on a free port, one variant at a time:

``direct``
    one ``grpc.aio`` server answering ``ModelInfer`` itself.
``h2-direct``
    ``direct`` on StageServe's own HTTP/2 gRPC server (stageserve/h2grpc/),
    the gateway's public front by default: the same handlers, grpcio's
    per-call machinery replaced by a few frames parsed and built in Python.
``forward``
    the same front as ``direct``, but every ``ModelInfer`` goes over ONE long-lived
    bidirectional stream to a second process that echoes each stream message
    back: the cheapest possible one-hop pipeline (a gateway with a zero-cost
    backend). Requests carry an 8-byte id (plus a 4-byte length) and each
    stream write carries everything queued since the last one, as StageServe's
    gateway does.
``relay``
    ``forward`` with a third process in the middle, StageServe's shape
    (gateway -> scheduler -> worker) with nothing in any stage: the front's
    stream goes to a relay that passes every message, as bytes, over its own
    stream to the echo, packing everything queued since its last write into
    one message, and passes the echo's messages back unchanged. No stage
    parses anything it does not have to, so this is the floor of a
    three-process Python gRPC pipeline on this machine.
``h2-relay``
    ``relay`` with every process on StageServe's own HTTP/2 gRPC server and
    every stream on its own client (stageserve/h2grpc/), as the stack's
    stages run by default: the floor of the stack's shape on its own parts.
``sync-direct``
    like ``direct`` on the synchronous ``grpc.server`` with 8 worker threads.
``sync-bridged``
    ``sync-direct`` whose ModelInfer is answered by a coroutine on an asyncio
    event loop in its own thread, as the gateway's asyncio dataplane would
    answer behind a thread-pool front: each server thread queues its request
    for the loop and waits for the answer; the loop is woken once per batch of
    queued requests, not once per request (:class:`LoopBridge`). It prices the
    hand-off a thread-pool public front would add (issue 26 item 4).

For each variant and concurrency it runs ``perf_analyzer`` and divides the
server process's CPU time (user + system, psutil) over the run by the number
of ``ModelInfer`` requests it answered (the servers report their counters in
``ServerMetadata``: ``version`` is the request count, ``extensions`` carry
the stream counters of ``forward``).

Why: on the 2-core development VM (perf_analyzer sharing the cores) a
prototype reached ~6,000-6,700 infer/s at c=64 with ``direct`` (~175-185 us
of CPU per request), ~8,500 with ``sync-direct`` (~128 us) and only
~3,400-3,500 with ``forward`` (~300 us in the front alone, ~1.05 requests per
stream message), while real Triton 2.51 served ``identity`` at 8,300-12,300
infer/s (c=8-64) in the same week's ``bench.compare`` run. A pipeline whose
every hop is a Python gRPC process therefore cannot reach Triton's throughput
on 2 cores, whatever its scheduling does.

The floor of StageServe's own shape, ``relay`` (three processes), at c=64 on
the same machine (one run): 2,510 infer/s and 578 us of CPU per
request with every write going out at once (1.07 requests per message),
against ``direct``'s 6,150 and 181 us. With the front holding its writes
(``--front-hold-us``) 0.5 ms: 3,486 infer/s, 351 us (3.6 requests per
message); 1.5 ms: 4,230 infer/s, 269 us (7.9). Fewer, fuller messages are
what a pipeline of Python gRPC processes can still win; the gateway's write
hold (stageserve/write_hold.py) rests on these figures.

  python -m bench.ceiling [--concurrency 1 64] [--measurement-ms 3000] [--csv PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import functools
import itertools
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
from google.protobuf.message import Message

from bench.perf_analyzer import (
    PerfAnalyzerError,
    PerfAnalyzerNotInstalled,
    run_perf,
    text_table,
)
from bench.references import stop_process
from bench.stream_vs_unary import SERVICE as ECHO_SERVICE
from bench.stream_vs_unary import start_echo_server
from stageserve import event_loop
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import model_config_pb2 as mc
from stageserve.grpc_io import choose_grpc_io
from stageserve.h2grpc.client import H2Channel
from stageserve.h2grpc.server import H2GrpcServer
from stageserve.net import free_port
from stageserve.settings import StackSettings, from_env

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "id16"
VARIANTS = ("direct", "h2-direct", "forward", "relay", "h2-relay", "sync-direct", "sync-bridged")
#: The variants whose front forwards over a stream, and the ones with a middle process.
FORWARDING = ("forward", "relay", "h2-relay")
RELAYS = ("relay", "h2-relay")
ECHO_METHOD = f"/{ECHO_SERVICE}/Stream"  # bench.stream_vs_unary's echo server
FRAME = struct.Struct("<QI")  # request id, payload length
START_TIMEOUT_S = 20.0
#: How long the front of forward/relay holds a stream write for more requests
#: (--front-hold-us, passed to the child processes through their environment).
FRONT_HOLD_ENV = "STAGESERVE_CEILING_FRONT_HOLD_US"
#: FP32 elements of the model's input and output (--elements): 16 by default,
#: 12,288 for the 49,152 bytes of issue 26's per-stage target.
ELEMENTS_ENV = "STAGESERVE_CEILING_ELEMENTS"
DEFAULT_ELEMENTS = 16
STOP_TIMEOUT_S = 5.0

# --------------------------------------------------------------------------- protocol


def elements() -> int:
    """The model's elements per request ([N] FP32): --elements, passed to the child
    processes through their environment."""
    return int(os.environ.get(ELEMENTS_ENV, DEFAULT_ELEMENTS))


def config(n: int) -> mc.ModelConfig:
    return mc.ModelConfig(
        name=MODEL,
        max_batch_size=64,
        input=[mc.ModelInput(name="INPUT0", data_type=mc.TYPE_FP32, dims=[n])],
        output=[mc.ModelOutput(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[n])],
    )


_Tensor = gs.ModelMetadataResponse.TensorMetadata


def metadata(n: int) -> gs.ModelMetadataResponse:
    return gs.ModelMetadataResponse(
        name=MODEL,
        versions=["1"],
        platform="bench",
        inputs=[_Tensor(name="INPUT0", datatype="FP32", shape=[-1, n])],
        outputs=[_Tensor(name="OUTPUT0", datatype="FP32", shape=[-1, n])],
    )


class Counters:
    """What the server reports through ServerMetadata (safe across threads)."""

    def __init__(self) -> None:
        self.requests = 0  # ModelInfer answered
        self.messages = 0  # stream messages written (forward)
        self.forwarded = 0  # requests carried by those messages (forward)
        self._lock = threading.Lock()

    def answered(self) -> None:
        with self._lock:
            self.requests += 1

    def metadata(self) -> gs.ServerMetadataResponse:
        return gs.ServerMetadataResponse(
            name="bench-ceiling",
            version=str(self.requests),
            extensions=[f"messages={self.messages}", f"forwarded={self.forwarded}"],
        )


def echo_response(request: gs.ModelInferRequest, raw: bytes) -> gs.ModelInferResponse:
    response = gs.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
    response.outputs.add(name="OUTPUT0", datatype="FP32", shape=request.inputs[0].shape)
    response.raw_output_contents.append(raw)
    return response


class Forwarder:
    """One bidirectional stream to the echo process, multiplexed by request id."""

    def __init__(
        self, channel: grpc.aio.Channel | H2Channel, counters: Counters, hold_s: float = 0.0
    ) -> None:
        self._hold_s = hold_s
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._ids = itertools.count()
        self._counters = counters
        self._call = channel.stream_stream(ECHO_METHOD)(self._writes())
        self._reader = asyncio.create_task(self._read())

    async def _writes(self) -> AsyncIterator[bytes]:
        while True:
            frames = [await self._outbox.get()]
            if self._hold_s:  # wait for more requests before writing (--front-hold-us)
                await asyncio.sleep(self._hold_s)
            while not self._outbox.empty():
                frames.append(self._outbox.get_nowait())
            self._counters.messages += 1
            self._counters.forwarded += len(frames)
            yield b"".join(frames)

    async def _read(self) -> None:
        async for message in self._call:
            view, at = memoryview(message), 0
            while at < len(view):
                rid, size = FRAME.unpack_from(view, at)
                at += FRAME.size
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(bytes(view[at : at + size]))
                at += size

    async def send(self, raw: bytes) -> bytes:
        rid = next(self._ids)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._outbox.put_nowait(FRAME.pack(rid, len(raw)) + raw)
        return await fut


SERVICE_NAME = gs.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
#: Unary methods: name -> (request type, callable).
Methods = dict[str, tuple[type[Message], Callable[..., Any]]]


def _answers(counters: Counters) -> Methods:
    """What perf_analyzer calls besides ModelInfer: method -> (request type, answer)."""
    model_config, model_metadata = config(elements()), metadata(elements())
    return {
        "ServerLive": (gs.ServerLiveRequest, lambda r: gs.ServerLiveResponse(live=True)),
        "ServerReady": (gs.ServerReadyRequest, lambda r: gs.ServerReadyResponse(ready=True)),
        "ModelReady": (
            gs.ModelReadyRequest,
            lambda r: gs.ModelReadyResponse(ready=r.name == MODEL),
        ),
        "ServerMetadata": (gs.ServerMetadataRequest, lambda r: counters.metadata()),
        "ModelMetadata": (gs.ModelMetadataRequest, lambda r: model_metadata),
        "ModelConfig": (
            gs.ModelConfigRequest,
            lambda r: gs.ModelConfigResponse(config=model_config),
        ),
    }


def _handler(methods: Methods) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            name: grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=request_type.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
            for name, (request_type, fn) in methods.items()
        },
    )


def _aio_handler(counters: Counters, forwarder: Forwarder | None) -> grpc.GenericRpcHandler:
    def awaitable(answer: Callable) -> Callable:
        async def call(request, context):
            return answer(request)

        return call

    async def infer(request: gs.ModelInferRequest, context) -> gs.ModelInferResponse:
        raw = request.raw_input_contents[0]
        if forwarder is not None:
            raw = await forwarder.send(raw)
        counters.answered()
        return echo_response(request, raw)

    methods = {name: (t, awaitable(fn)) for name, (t, fn) in _answers(counters).items()}
    methods["ModelInfer"] = (gs.ModelInferRequest, infer)
    return _handler(methods)


def _sync_handler(counters: Counters) -> grpc.GenericRpcHandler:
    def infer(request: gs.ModelInferRequest, context) -> gs.ModelInferResponse:
        counters.answered()
        return echo_response(request, request.raw_input_contents[0])

    methods: Methods = {
        name: (t, lambda r, c, fn=fn: fn(r)) for name, (t, fn) in _answers(counters).items()
    }
    methods["ModelInfer"] = (gs.ModelInferRequest, infer)
    return _handler(methods)


class LoopBridge:
    """Server threads hand coroutines to one asyncio loop and wait for their
    results. A hand-off wakes the loop only when no drain is already
    scheduled, so a burst of requests costs one wake-up of the loop (one
    write to its self-pipe); each answer still wakes its waiting thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable[[Any], Any], Any, futures.Future[Any]]] = []
        self._scheduled = False

    def call(self, answer: Callable[[Any], Any], arg: Any) -> Any:
        """`await answer(arg)` on the loop; blocks this thread until it is done."""
        done: futures.Future[Any] = futures.Future()
        with self._lock:
            self._queued.append((answer, arg, done))
            wake = not self._scheduled
            self._scheduled = True
        if wake:
            self._loop.call_soon_threadsafe(self._drain)
        return done.result()

    def _drain(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
            self._scheduled = False
        for answer, arg, done in queued:
            task = self._loop.create_task(answer(arg))
            task.add_done_callback(functools.partial(_settle, done=done))


def _settle(task: asyncio.Task[Any], *, done: futures.Future[Any]) -> None:
    if task.cancelled():
        done.cancel()
    elif (exc := task.exception()) is not None:
        done.set_exception(exc)
    else:
        done.set_result(task.result())


def _bridged_handler(counters: Counters, bridge: LoopBridge) -> grpc.GenericRpcHandler:
    async def answer(request: gs.ModelInferRequest) -> gs.ModelInferResponse:
        counters.answered()
        return echo_response(request, request.raw_input_contents[0])

    def infer(request: gs.ModelInferRequest, context) -> gs.ModelInferResponse:
        return bridge.call(answer, request)

    methods: Methods = {
        name: (t, lambda r, c, fn=fn: fn(r)) for name, (t, fn) in _answers(counters).items()
    }
    methods["ModelInfer"] = (gs.ModelInferRequest, infer)
    return _handler(methods)


# --------------------------------------------------------------------------- child processes


async def _serve_h2(port: int, backend: str | None = None) -> None:
    """``h2-direct``, or with `backend` the front of ``h2-relay``."""
    counters = Counters()
    forwarder = None
    if backend is not None:
        channel = H2Channel(backend)
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)
        hold_us = float(os.environ.get(FRONT_HOLD_ENV, "0"))
        forwarder = Forwarder(channel, counters, hold_us / 1e6)
    server = H2GrpcServer()
    server.add_generic_rpc_handlers([_aio_handler(counters, forwarder)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_aio(port: int, backend: str | None) -> None:
    counters = Counters()
    forwarder = None
    if backend is not None:
        channel = grpc.aio.insecure_channel(backend)
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)
        hold_us = float(os.environ.get(FRONT_HOLD_ENV, "0"))
        forwarder = Forwarder(channel, counters, hold_us / 1e6)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([_aio_handler(counters, forwarder)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_relay(port: int, backend: str, own: bool = False) -> None:
    """The middle of ``relay``: the front's stream messages to the echo and back,
    as bytes; `own`: on the own HTTP/2 server and client (``h2-relay``)."""
    channel: grpc.aio.Channel | H2Channel = (
        H2Channel(backend) if own else grpc.aio.insecure_channel(backend)
    )
    await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)

    async def stream(request_iterator, context) -> AsyncIterator[bytes]:
        outbox: asyncio.Queue[bytes] = asyncio.Queue()

        async def writes() -> AsyncIterator[bytes]:
            while True:
                parts = [await outbox.get()]
                while not outbox.empty():
                    parts.append(outbox.get_nowait())
                yield b"".join(parts)

        async def intake() -> None:
            async for message in request_iterator:
                outbox.put_nowait(message)

        call = channel.stream_stream(ECHO_METHOD)(writes())
        reading = asyncio.create_task(intake())
        try:
            async for message in call:
                yield message
        finally:
            reading.cancel()

    await _serve_stream(stream, port, own)


async def _serve_stream(stream: Callable[..., Any], port: int, own: bool) -> None:
    """Serve `stream` as the echo service's Stream method until terminated;
    `own`: on the own HTTP/2 server, else grpc.aio's."""
    server: grpc.aio.Server | H2GrpcServer = H2GrpcServer() if own else grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(ECHO_SERVICE, {"Stream": handler})]
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_echo(port: int, own: bool = False) -> None:
    """The end of ``forward`` and ``relay``; `own`: on the own HTTP/2 server."""
    if not own:
        server = await start_echo_server(port)
        await server.wait_for_termination()
        return

    async def stream(request_iterator, context) -> AsyncIterator[bytes]:
        async for message in request_iterator:
            yield message

    await _serve_stream(stream, port, own=True)


def _serve_sync(port: int, bridged: bool = False) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    if bridged:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="loop", daemon=True).start()
        server.add_generic_rpc_handlers([_bridged_handler(Counters(), LoopBridge(loop))])
    else:
        server.add_generic_rpc_handlers([_sync_handler(Counters())])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve(role: str, port: int, backend: str | None = None) -> None:
    """Child-process entry: ``direct``/``forward`` (aio front), ``sync-direct``,
    ``sync-bridged``, ``relay``
    (the middle process of the relay variant) or ``echo``. The asyncio roles
    run on the event loop the stack's stages run on (StackSettings.event_loop,
    uvloop by default): like with like."""
    loop = from_env(StackSettings, "stack").event_loop
    if role in ("sync-direct", "sync-bridged"):
        _serve_sync(port, bridged=role == "sync-bridged")
    elif role in ("echo", "h2-echo"):
        event_loop.run(_serve_echo(port, own=role == "h2-echo"), loop)
    elif role in ("h2-direct", "h2-relay"):
        event_loop.run(_serve_h2(port, backend if role == "h2-relay" else None), loop)
    elif role in ("relay-middle", "h2-relay-middle"):
        assert backend is not None
        event_loop.run(_serve_relay(port, backend, own=role == "h2-relay-middle"), loop)
    else:
        event_loop.run(_serve_aio(port, backend if role in FORWARDING else None), loop)


@dataclass
class Running:
    """A started variant: its front (what perf_analyzer talks to), for forward and relay the
    echo, for relay the process in the middle."""

    variant: str
    url: str
    front: subprocess.Popen[bytes]
    backend: subprocess.Popen[bytes] | None = None
    middle: subprocess.Popen[bytes] | None = None


def _spawn(role: str, port: int, backend: str | None = None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "bench.ceiling", "--serve", role, "--port", str(port)]
    if backend is not None:
        args += ["--backend", backend]
    env = dict(os.environ)
    choose_grpc_io(env)  # the same gRPC I/O path as StageServe's services: like with like
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, start_new_session=True
    )


def _wait_listening(proc: subprocess.Popen[bytes], address: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        # One future, cancelled at the end: a future left waiting keeps grpc's
        # connectivity thread polling the channel after it is closed, where
        # it raises in that thread.
        ready = grpc.channel_ready_future(channel)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server for {address} exited with {proc.returncode}")
                try:
                    ready.result(timeout=0.2)
                    return
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"server for {address} did not start") from None
        finally:
            ready.cancel()


def _stop_proc(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        stop_process(proc, STOP_TIMEOUT_S)


def start(variant: str) -> Running:
    """Start ``variant``'s process(es) on free loopback ports; ready when this returns."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    backend_proc = middle_proc = None
    backend = None
    try:
        own = variant.startswith("h2-")
        if variant in FORWARDING:
            backend = f"127.0.0.1:{free_port()}"
            backend_proc = _spawn("h2-echo" if own else "echo", int(backend.rsplit(":", 1)[1]))
            _wait_listening(backend_proc, backend)
        if variant in RELAYS:
            middle = f"127.0.0.1:{free_port()}"
            role = "h2-relay-middle" if own else "relay-middle"
            middle_proc = _spawn(role, int(middle.rsplit(":", 1)[1]), backend)
            _wait_listening(middle_proc, middle)
            backend = middle
        url = f"127.0.0.1:{free_port()}"
        front = _spawn(variant, int(url.rsplit(":", 1)[1]), backend)
        running = Running(variant, url, front, backend_proc, middle_proc)
    except BaseException:
        _stop_proc(middle_proc)
        _stop_proc(backend_proc)
        raise
    try:
        _wait_listening(front, url)
    except BaseException:
        stop(running)
        raise
    return running


def stop(running: Running) -> None:
    """Stop the front, the middle, then the echo: terminate, kill after a timeout."""
    try:
        _stop_proc(running.front)
    finally:
        try:
            _stop_proc(running.middle)
        finally:
            _stop_proc(running.backend)


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Row:
    variant: str
    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float
    front_cpu_us: float
    backend_cpu_us: float | None = None
    requests_per_message: float | None = None
    middle_cpu_us: float | None = None

    @property
    def total_cpu_us(self) -> float:
        """Every server process's CPU per request (perf_analyzer not counted)."""
        return self.front_cpu_us + (self.backend_cpu_us or 0.0) + (self.middle_cpu_us or 0.0)


def _cpu_s(proc: subprocess.Popen[bytes] | None) -> float:
    if proc is None:
        return 0.0
    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


def read_counters(url: str) -> tuple[int, int, int]:
    """(requests answered, stream messages, requests forwarded) from ServerMetadata."""
    import tritonclient.grpc as triton  # here: the child processes do not need it

    client = triton.InferenceServerClient(url)
    try:
        meta = client.get_server_metadata()
    finally:
        client.close()
    extra = dict(e.split("=", 1) for e in meta.extensions)
    return int(meta.version), int(extra["messages"]), int(extra["forwarded"])


def measure(running: Running, concurrency: int, measurement_ms: int, stability_pct: int) -> Row:
    n0, m0, f0 = read_counters(running.url)
    front0, back0, mid0 = _cpu_s(running.front), _cpu_s(running.backend), _cpu_s(running.middle)
    perf = run_perf(
        running.url,
        MODEL,
        concurrency,
        measurement_ms=measurement_ms,
        stability_pct=stability_pct,
        extra_args=["--max-trials", "6"],
    )
    front1, back1, mid1 = _cpu_s(running.front), _cpu_s(running.backend), _cpu_s(running.middle)
    n1, m1, f1 = read_counters(running.url)
    requests = max(1, n1 - n0)
    forward = running.backend is not None
    return Row(
        variant=running.variant,
        concurrency=concurrency,
        throughput=perf.throughput,
        p50_ms=perf.p50_us / 1000,
        p99_ms=perf.p99_us / 1000,
        front_cpu_us=(front1 - front0) / requests * 1e6,
        backend_cpu_us=(back1 - back0) / requests * 1e6 if forward else None,
        requests_per_message=(f1 - f0) / max(1, m1 - m0) if forward else None,
        middle_cpu_us=(mid1 - mid0) / requests * 1e6 if running.middle is not None else None,
    )


def format_table(rows: Sequence[Row]) -> str:
    header = ("variant", "conc", "infer/s", "p50 ms", "p99 ms", "front us/req",
              "middle us/req", "backend us/req", "total us/req", "req/msg")  # fmt: skip

    def opt(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    body = [
        (
            r.variant,
            str(r.concurrency),
            f"{r.throughput:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.front_cpu_us:.0f}",
            opt(r.middle_cpu_us, ".0f"),
            opt(r.backend_cpu_us, ".0f"),
            f"{r.total_cpu_us:.0f}",
            opt(r.requests_per_message, ".2f"),
        )
        for r in rows
    ]
    return text_table(header, body)


def write_csv(path: str, rows: Sequence[Row]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(Row.__dataclass_fields__))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(row).items()}
            )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--measurement-ms", type=int, default=3000)
    ap.add_argument("--stability-pct", type=int, default=30)
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    ap.add_argument(
        "--front-hold-us",
        type=float,
        default=0.0,
        help="forward/relay: the front waits this long for more requests before each stream "
        "write (coalescing at the cost of latency); 0 writes at once",
    )
    ap.add_argument(
        "--elements",
        type=int,
        default=DEFAULT_ELEMENTS,
        help="FP32 elements per request's input and output (12288: the 49,152 bytes of "
        "bench.scale's identity_49k)",
    )
    ap.add_argument(
        "--serve",
        choices=[*VARIANTS, "echo", "h2-echo", "relay-middle", "h2-relay-middle"],
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.serve is not None:
        serve(ns.serve, ns.port, ns.backend)
        return 0
    os.environ[FRONT_HOLD_ENV] = str(ns.front_hold_us)
    os.environ[ELEMENTS_ENV] = str(ns.elements)
    rows: list[Row] = []
    for variant in ns.variants:
        running = start(variant)
        try:
            for c in ns.concurrency:
                try:
                    rows.append(measure(running, c, ns.measurement_ms, ns.stability_pct))
                except PerfAnalyzerNotInstalled as exc:
                    print(exc, file=sys.stderr)
                    return 1
                except PerfAnalyzerError as exc:
                    print(f"{variant} c={c}: {exc}", file=sys.stderr)
                    continue
                r = rows[-1]
                print(f"{variant} c={c}: {r.throughput:,.0f} infer/s", file=sys.stderr)
        finally:
            stop(running)
    print()
    print(format_table(rows))
    if ns.csv:
        write_csv(ns.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
