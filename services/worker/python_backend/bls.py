"""BLS: `pb_utils.InferenceRequest(...).exec()` from inside a model's execute.

A BLS request goes through the stack's scheduler like any client request
(dynamic batching, rate limiting, queue policies and ensembles apply), over
the gateway's own SchedulerLink client: one multiplexed stream per worker.
It is validated by the gateway's pure validation (the same errors a client
would get), and a failure comes back as `response.has_error()` /
`response.error()`, never raised, as in Triton. BLS requests count in the
target's ModelStatistics (and Triton's metrics), as in Triton: the worker
publishes its share to Redis like one more gateway.

`exec()` runs on the calling instance's thread and waits there; the stream
lives on the worker's event loop, which is why Python instances never run
inline on that loop. `async_exec()` sends the call at once too (an asyncio
Task of the instance's own loop then awaits its answer, as Triton's future).

`exec(decoupled=True)` / `await async_exec(decoupled=True)` return, as in
Triton 2.51 (checked), once the target's first response is in: an iterator
(bls_wire.ResponseIterator) that the worker's loop feeds with each response
as the scheduler link delivers it (`on_more`), so a BLS model forwarding a
decoupled model's tokens sends each on at once. The loop only queues (never
blocks); a caller that stops iterating early leaves the target to run to its
end, as in Triton, and what still arrives is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Coroutine
from typing import Any

import grpc

from services.worker.python_backend import pb_utils
from services.worker.python_backend.bls_wire import ResponseFeed, ResponseIterator
from stageserve.datatypes import from_numpy
from stageserve.errors import StageError, invalid, not_found, status_code
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.model_state import LoadedModel, ModelStateStore
from stageserve.recorder import RequestRecorder
from stageserve.scheduler_link import SchedulerLink
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.settings import Settings
from stageserve.shard_map import ShardView
from stageserve.shared_stats import SharedStats
from stageserve.statistics import StatsBook
from stageserve.tensors import TensorError, numpy_to_raw, raw_to_numpy
from stageserve.validation import validate_infer

# the status code a failure's reason has -> pb_utils.TritonError code (the
# inverse of Triton's mapping; INTERNAL for a code Triton's errors lack)
_TRITON_CODES = {
    grpc.StatusCode.UNKNOWN: pb_utils.TritonError.UNKNOWN,
    grpc.StatusCode.INTERNAL: pb_utils.TritonError.INTERNAL,
    grpc.StatusCode.NOT_FOUND: pb_utils.TritonError.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: pb_utils.TritonError.INVALID_ARG,
    grpc.StatusCode.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED: pb_utils.TritonError.UNSUPPORTED,
    grpc.StatusCode.ALREADY_EXISTS: pb_utils.TritonError.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED: pb_utils.TritonError.CANCELLED,
}


def _error(reason: pb.FailureReason, message: str) -> pb_utils.InferenceResponse:
    """A failed BLS response: a FailureReason as the model's TritonError."""
    code = _TRITON_CODES.get(status_code(reason), pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _answer(
    response: pb_utils.InferenceResponse, feed: ResponseFeed | None
) -> list[pb_utils.InferenceResponse]:
    """A call's last response: to its feed (a decoupled call), else as the list."""
    if feed is None:
        return [response]
    feed.put(response, last=True)
    return []


async def _first(future: concurrent.futures.Future) -> pb_utils.InferenceResponse:
    """The one response of a call that is not decoupled, awaited."""
    return (await asyncio.wrap_future(future))[0]


class BlsClient:
    def __init__(
        self,
        scheduler_address: str,
        state: ModelStateStore,
        loop: asyncio.AbstractEventLoop,
        settings: Settings,
    ) -> None:
        # A BLS call reaches the scheduler and publishes its statistics as a gateway does.
        # Routed by the called model to its scheduler (stageserve/scheduler_routing.py).
        self.link = SchedulerRouter(
            ShardView(state.redis),
            scheduler_address,
            lambda address: SchedulerLink(
                address,
                settings.gateway.scheduler_connect_timeout_s,
                settings.stage_tls,
                client=settings.gateway.stream_client,
            ),
        )
        self.model_cache_s = settings.worker.bls_model_cache_s
        self.state = state
        self.loop = loop
        self._models: dict[str, tuple[float, LoadedModel | None]] = {}
        # BLS requests count in their target's ModelStatistics, as in Triton:
        # this worker publishes its share like one more gateway (shared_stats.py).
        self.stats = StatsBook(self._generation_of)
        self.recorder = RequestRecorder(self.stats)
        self.shared = SharedStats(state.redis, self.stats, settings.gateway.stats_publish_s)
        self.shared.start()
        self._streams: set[concurrent.futures.Future] = set()  # decoupled calls running

    def _generation_of(self, model: str) -> int:
        cached = self._models.get(model)
        return cached[1].generation if cached is not None and cached[1] is not None else 0

    # Called by pb_utils.InferenceRequest ------------------------------------

    def execute(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if decoupled:
            return self.stream(request).wait_first()
        return self.response(request)

    def response(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        """A call that is not decoupled, waiting on this (non-loop) thread;
        also how a model.py in a stub process is answered (process_instance.py)."""
        future = asyncio.run_coroutine_threadsafe(self.infer(request), self.loop)
        return future.result()[0]

    def stream(self, request: pb_utils.InferenceRequest) -> ResponseIterator:
        """A decoupled call, at once: its iterator, fed from the worker's loop
        as the responses arrive; also how a stub's decoupled call is answered."""
        feed = ResponseFeed()
        future = asyncio.run_coroutine_threadsafe(self._stream(request, feed), self.loop)
        self._streams.add(future)  # a reference until it ends
        future.add_done_callback(self._streams.discard)
        return ResponseIterator(feed)

    def execute_async(
        self, request: pb_utils.InferenceRequest, decoupled: bool
    ) -> Coroutine[Any, Any, Any]:
        """For async_exec(): sends the call now (on the worker's loop) and
        returns what awaits its answer, without blocking the caller's loop."""
        if decoupled:
            return self.stream(request).wait_first_async()
        return _first(asyncio.run_coroutine_threadsafe(self.infer(request), self.loop))

    # On the worker's loop ----------------------------------------------------

    async def infer(
        self,
        request: pb_utils.InferenceRequest,
        decoupled: bool = False,
        feed: ResponseFeed | None = None,
    ) -> list[pb_utils.InferenceResponse]:
        """The target's responses: one, or (a decoupled target) each it sent,
        the final flag alone becoming an empty response, as in Triton. With a
        feed (a decoupled call's), each goes there as it arrives instead, the
        last one marked, and the list is empty."""
        try:
            loaded = await self._model(request.model_name())
            if loaded is None:
                return _answer(
                    _error(
                        pb.MODEL_NOT_FOUND,
                        f"Request for unknown model: '{request.model_name()}' is not found",
                    ),
                    feed,
                )
            if loaded.spec.decoupled and not decoupled:
                return _answer(
                    _error(
                        pb.INVALID_INPUT,
                        f"model '{request.model_name()}' is decoupled: "
                        f"use exec(decoupled=True) / async_exec(decoupled=True)",
                    ),
                    feed,
                )
            schedule = self._schedule_request(request, loaded)
        except StageError as err:
            return _answer(_error(err.reason, err.message), feed)
        start = time.monotonic_ns()
        earlier: list[pb.ScheduleResponse] = []
        on_more = (
            earlier.append if feed is None else lambda more: feed.put(self._response(request, more))
        )
        try:
            resp = await self.link.schedule(schedule, on_more=on_more)
        except StageError as err:
            resp = pb.ScheduleResponse(failure=err.reason, message=err.message)
        self._record(schedule, resp, time.monotonic_ns() - start)
        if feed is not None:
            return _answer(self._response(request, resp), feed)
        return [self._response(request, r) for r in (*earlier, resp)]

    async def _stream(self, request: pb_utils.InferenceRequest, feed: ResponseFeed) -> None:
        """A decoupled call; its iterator always ends: with the target's last
        response, an error response, or the exception the call raised."""
        try:
            await self.infer(request, True, feed)
        except asyncio.CancelledError:  # the worker stops: never leave the caller waiting
            feed.put(
                _error(pb.STAGE_UNAVAILABLE, "BLS request cancelled: the worker is stopping"),
                last=True,
            )
            raise
        except Exception as exc:  # raised to the caller, as a call without decoupled would
            feed.fail(exc)

    @staticmethod
    def _response(
        request: pb_utils.InferenceRequest, resp: pb.ScheduleResponse
    ) -> pb_utils.InferenceResponse:
        if resp.failure:
            return _error(resp.failure, resp.message)
        try:
            outputs = [
                pb_utils.Tensor(t.name, raw_to_numpy(t.raw, t.datatype, t.shape))
                for t in resp.outputs
            ]
        except TensorError as exc:
            return _error(pb.BACKEND_FAILED, f"BLS response from '{request.model_name()}': {exc}")
        return pb_utils.InferenceResponse(outputs)

    def _record(self, request: pb.ScheduleRequest, resp: pb.ScheduleResponse, ns: int) -> None:
        for st in resp.steps:  # an ensemble's composing executions
            if st.failure:
                self.recorder.failure(st.model, st.version, st.duration_ns, st.failure)
            else:
                self.recorder.success(
                    st.model, st.version, st.duration_ns, st.batch_size, st.timing
                )
        if resp.failure:
            self.recorder.failure(request.model, request.version, ns, resp.failure)
        else:
            self.recorder.success(
                request.model, request.version, ns, request.batch_size, resp.timing
            )

    def _schedule_request(
        self, request: pb_utils.InferenceRequest, loaded: LoadedModel
    ) -> pb.ScheduleRequest:
        name = request.model_name()
        version = request.model_version()
        if version <= 0:
            version = max(loaded.versions)
        elif version not in loaded.versions:
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        infer = gs.ModelInferRequest(model_name=name, id=request.request_id())
        for tensor in request.inputs():
            arr = tensor.as_numpy()
            try:
                dt = from_numpy(arr.dtype)
            except KeyError as exc:
                raise invalid(str(exc)) from None
            infer.inputs.add(name=tensor.name(), datatype=dt.triton, shape=list(arr.shape))
            infer.raw_input_contents.append(numpy_to_raw(arr, dt))
        for output in request.requested_output_names():
            infer.outputs.add(name=output)
        validated = validate_infer(infer, loaded.spec)
        return pb.ScheduleRequest(
            model=name,
            version=version,
            inputs=validated.inputs,
            outputs=validated.outputs,
            batch_size=validated.batch_size,
            priority=validated.priority,
            timeout_us=request.timeout() or validated.timeout_us,
            config_generation=loaded.generation,
            request_id=request.request_id(),
            parameters_json=request.parameters() if request.parameters() != "{}" else "",
        )

    async def _model(self, name: str) -> LoadedModel | None:
        cached = self._models.get(name)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.model_cache_s:
            return cached[1]
        loaded = await self.state.get(name)
        self._models[name] = (now, loaded)
        return loaded

    async def close(self) -> None:
        await self.shared.close()
        await self.link.close()


def install(scheduler_address: str, state: ModelStateStore, settings: Settings) -> BlsClient:
    """Make pb_utils.InferenceRequest.exec() reach this stack's scheduler (on the running loop)."""
    client = BlsClient(scheduler_address, state, asyncio.get_running_loop(), settings)
    pb_utils.InferenceRequest._bls = client
    return client
