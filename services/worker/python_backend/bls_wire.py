"""BLS requests and responses as plain values, for a model.py in a stub process;
and the iterator a decoupled BLS call returns, in-process and in a stub.

A model.py hosted in its own process (process_instance.py) calls
`exec()` / `async_exec()` there; the call travels to the worker, which sends
it through its one BLS client (bls.py) as for an in-process instance, so
batching, rate limiting and statistics apply the same way. These functions
turn both ends of the call into picklable values (numpy arrays included,
BYTES as object arrays) and back.

`exec(decoupled=True)` answers a `ResponseIterator` fed through a
`ResponseFeed` as the target's responses arrive (bls.py feeds it from the
worker's loop, stub.py from its socket): what Triton 2.51 does, checked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
from typing import Any

from services.worker.python_backend import pb_utils

Wire = dict[str, Any]
_END = object()


class ResponseFeed:
    """The producing end of a ResponseIterator: `put()` from one thread (a
    loop's, a socket reader's), and it never blocks. Once the iterator is
    dropped (its caller stopped early), what still arrives is dropped."""

    __slots__ = ("_queue", "arrived", "abandoned")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        #: done once the first item is in: what async_exec awaits
        self.arrived: concurrent.futures.Future = concurrent.futures.Future()
        self.abandoned = False

    def put(self, response: pb_utils.InferenceResponse, last: bool = False) -> None:
        self._add(response, last)

    def fail(self, exc: BaseException) -> None:
        """The call raised: the caller's exec() or next() raises it, and the stream ends."""
        self._add(exc, True)

    def end(self) -> None:
        """The stream ends without one more response."""
        self._add(_END, True)

    def _add(self, item: Any, last: bool) -> None:
        if self.abandoned:
            while True:  # free what the caller will never read
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    return
        self._queue.put((item, last))
        if not self.arrived.done():
            # InvalidStateError: its awaiting caller was cancelled
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.arrived.set_result(None)


class ResponseIterator:
    """What `exec(decoupled=True)` returns, as Triton 2.51's ResponseIterator
    (checked): each response of the target as it arrives; `next()` waits
    for the next one. The final flag alone is an empty response; a final
    flag sent with a response ends the iteration after that response. `iter()`
    on a finished iterator starts it again from its first response. Errors the
    target sends are error responses here (Triton 2.51 drops them, and never
    ends the iteration after one sent with the final flag)."""

    def __init__(self, feed: ResponseFeed) -> None:
        self._feed = feed
        self._seen: list[pb_utils.InferenceResponse] = []
        self._index = 0
        self._total: int | None = None  # how many responses, once the last is in
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """True once the last response was returned."""
        return self._total is not None and self._index >= self._total

    def wait_first(self) -> ResponseIterator:
        """Wait for the first response (Triton's exec() returns then); raise
        what the call raised before answering anything."""
        if not self._seen and self._total is None:
            self._take()
        if not self._seen and self._error is not None:
            raise self._error
        return self

    async def wait_first_async(self) -> ResponseIterator:
        """wait_first() for async_exec: awaits, never blocks its loop."""
        await asyncio.wrap_future(self._feed.arrived)
        return self.wait_first()  # the first is in: no wait

    def _take(self) -> None:
        item, last = self._feed._queue.get()
        if item is _END:
            self._total = len(self._seen)
            return
        if isinstance(item, BaseException):
            self._error = item
            self._total = len(self._seen)
            return
        self._seen.append(item)
        if last:
            self._total = len(self._seen)

    def __iter__(self) -> ResponseIterator:
        if self.finished and self._error is None:
            self._index = 0
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        if self._index >= len(self._seen) and self._total is None:
            self._take()
        if self._index < len(self._seen):
            self._index += 1
            return self._seen[self._index - 1]
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def __del__(self) -> None:
        self._feed.abandoned = True


def request_to_wire(request: pb_utils.InferenceRequest) -> Wire:
    return {
        "model_name": request.model_name(),
        "requested_output_names": list(request._requested),  # the order given
        "inputs": [(t.name(), t.as_numpy()) for t in request.inputs()],
        "model_version": request.model_version(),
        "correlation_id": request.correlation_id(),
        "request_id": request.request_id(),
        "flags": request.flags(),
        "timeout": request.timeout(),
        "parameters": request.parameters(),
    }


def request_from_wire(wire: Wire) -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(
        model_name=wire["model_name"],
        requested_output_names=wire["requested_output_names"],
        inputs=[pb_utils.Tensor(name, arr) for name, arr in wire["inputs"]],
        model_version=wire["model_version"],
        correlation_id=wire["correlation_id"],
        request_id=wire["request_id"],
        flags=wire["flags"],
        timeout=wire["timeout"],
        parameters=wire["parameters"],
    )


def response_to_wire(r: pb_utils.InferenceResponse) -> Wire:
    err = r.error()
    return {
        "error": None if err is None else (err.message(), err.code()),
        "outputs": [(t.name(), t.as_numpy()) for t in r.output_tensors()],
        "parameters": r.parameters(),
    }


def response_from_wire(r: Wire) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, arr) for name, arr in r["outputs"]],
        error=None if r["error"] is None else pb_utils.TritonError(*r["error"]),
        parameters=r["parameters"],
    )


def responses_from_wire(wire: list[Wire]) -> list[pb_utils.InferenceResponse]:
    return [response_from_wire(r) for r in wire]
