"""The stub process of one Python-backend instance (`python -m` this module).

Started by process_instance.py when a model runs a process per instance.
It hosts one PythonInstance exactly as the worker would in-process, and
speaks to its worker over one socket (stub_wire.py: tuples, the batches'
bytes framed by hand, the rest pickled):

    worker -> stub: ("init", InitArgs) once, then ("exec", batch_id, ExecuteRequest
                    bytes), ("bls_part", call_id, response wire) for each
                    response of a decoupled BLS call as it arrives but its last,
                    ("bls_result", call_id, ok, value) once per BLS call (ok:
                    value is the list of its responses left: the one response,
                    or a decoupled call's last one; else the message of the
                    TritonModelException that exec(), or next() on a decoupled
                    call's iterator, raises), ("close",)
    stub -> worker: ("ready",) or ("init_failed", message) once, then
                    ("part", batch_id, ExecuteResponse bytes) for each decoupled
                    message sent early, ("done", batch_id, ExecuteResponse bytes)
                    for each batch's last message, ("bls", call_id, decoupled,
                    request wire), ("closed",)

The main thread only reads the socket; batches run on the instance's own
thread (initialize ran there too), so a BLS call that waits in `execute` is
answered while it waits. The stub exits at once when the socket closes: its
worker is gone, and nothing it computes can be delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.backends import StillSending
from services.worker.blas_threads import limit_blas_threads
from services.worker.python_backend import pb_utils
from services.worker.python_backend.bls_wire import (
    ResponseFeed,
    ResponseIterator,
    request_to_wire,
    response_from_wire,
    responses_from_wire,
)
from services.worker.python_backend.instance import INTERNAL, PythonInstance, PythonModelError
from services.worker.python_backend.loader import register_pb_utils
from services.worker.python_backend.stub_wire import StubSocket
from stageserve.config import ModelSpec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.logs import setup_child_logging
from stageserve.settings import settings_from_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitArgs:
    """What PythonInstance takes, sent once as the stub's first message."""

    model_file: str
    spec: ModelSpec
    config_json: str
    instance_name: str
    kind: str
    device_id: int
    version: int


async def _first(future: concurrent.futures.Future) -> pb_utils.InferenceResponse:
    """The one response of a call that is not decoupled, awaited."""
    return (await asyncio.wrap_future(future))[0]


class _BlsProxy:
    """pb_utils.InferenceRequest._bls in a stub: the call goes to the worker.
    A decoupled call's responses come one by one as they arrive ("bls_part")
    into the iterator its exec() returned, as in-process."""

    def __init__(self, channel: StubSocket) -> None:
        self._channel = channel
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, concurrent.futures.Future | ResponseFeed] = {}

    def _call(
        self, request: pb_utils.InferenceRequest, waiting: concurrent.futures.Future | ResponseFeed
    ) -> None:
        call_id = next(self._ids)
        with self._lock:
            self._waiting[call_id] = waiting
        decoupled = isinstance(waiting, ResponseFeed)
        self._channel.send(("bls", call_id, decoupled, request_to_wire(request)))

    def _stream(self, request: pb_utils.InferenceRequest) -> ResponseIterator:
        feed = ResponseFeed()
        responses = ResponseIterator(feed)
        self._call(request, feed)
        return responses

    def execute(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if decoupled:
            return self._stream(request).wait_first()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._call(request, future)
        return future.result()[0]

    def execute_async(
        self, request: pb_utils.InferenceRequest, decoupled: bool
    ) -> Coroutine[Any, Any, Any]:
        """For async_exec(): sends the call to the worker now and returns
        what awaits its answer."""
        if decoupled:
            return self._stream(request).wait_first_async()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._call(request, future)
        return _first(future)

    def part(self, call_id: int, wire: dict) -> None:
        with self._lock:
            feed = self._waiting.get(call_id)
        if isinstance(feed, ResponseFeed):
            feed.put(response_from_wire(wire))

    def answered(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            waiting = self._waiting.pop(call_id, None)
        if waiting is None:
            return
        if isinstance(waiting, ResponseFeed):
            if not ok:
                waiting.fail(pb_utils.TritonModelException(value))
                return
            responses = responses_from_wire(value)
            for response in responses[:-1]:
                waiting.put(response)
            if responses:
                waiting.put(responses[-1], last=True)
            else:  # ended without a last response: so does the iteration
                waiting.end()
        elif ok:
            waiting.set_result(responses_from_wire(value))
        else:
            waiting.set_exception(pb_utils.TritonModelException(value))


def _run_batch(instance: PythonInstance, channel: StubSocket, batch_id: int, raw: bytes) -> None:
    def emit(message: pb.ExecuteResponse) -> None:
        channel.send(("part", batch_id, message.SerializeToString()))

    def done(message: pb.ExecuteResponse) -> None:
        channel.send(("done", batch_id, message.SerializeToString()))

    try:
        result = instance.execute_batch(pb.ExecuteRequest.FromString(raw), emit)
    except Exception as exc:  # a bug of ours, not the model's: answer, never hang
        log.exception("stub execute failed", extra={"instance": instance.instance_name})
        done(pb.ExecuteResponse(failure=INTERNAL, message=f"stub execute failed: {exc}"))
        return
    if isinstance(result, StillSending):
        result.last.add_done_callback(lambda f: done(f.result()))
    else:
        done(result)


def serve(channel: StubSocket) -> None:
    """channel.send may be called from any thread: the instance's, the model's own."""
    bls = _BlsProxy(channel)
    pb_utils.InferenceRequest._bls = bls
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="instance")
    kind, init = channel.recv()
    assert kind == "init"
    try:
        instance = executor.submit(
            PythonInstance,
            Path(init.model_file),
            init.spec,
            init.config_json,
            instance_name=init.instance_name,
            kind=init.kind,
            device_id=init.device_id,
            version=init.version,
        ).result()
    except PythonModelError as exc:
        channel.send(("init_failed", str(exc)))
        return
    channel.send(("ready",))
    while True:
        message = channel.recv()
        if message[0] == "exec":
            executor.submit(_run_batch, instance, channel, message[1], message[2])
        elif message[0] == "bls_part":
            bls.part(message[1], message[2])
        elif message[0] == "bls_result":
            bls.answered(*message[1:])
        elif message[0] == "close":
            executor.submit(instance.close).result()  # finalize, after the last batch
            channel.send(("closed",))
            return


def main(argv: list[str]) -> None:
    setup_child_logging("worker-stub")  # follows the stack's log settings
    # The stub's settings: the worker's environment, which it inherits.
    limit_blas_threads(os.environ, settings_from_env().worker.blas_threads)
    register_pb_utils()
    conn = StubSocket(socket.socket(fileno=int(argv[1])))
    # EOFError / OSError: the worker is gone, nothing this process does can be delivered.
    with contextlib.suppress(EOFError, OSError):
        serve(conn)
    # Threads the model started must not keep a stub alive without its worker.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
