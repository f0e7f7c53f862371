"""Adapter of the public inference.GRPCInferenceService: grpcio method
handlers, served by stageserve/h2grpc's server (or grpc.aio's, by setting).

Each handler hands its request to the DataPlane (dataplane.py: validation,
conversion, statistics and metrics, shared with the HTTP front) and returns
its answer. Errors are StageErrors carrying Triton's status code; the
`grpc_errors` decorator ends the call with that code and message, and an
unexpected exception with INTERNAL, a short message naming the method and a
log line with the detail and traceback. Without it grpc.aio answers UNKNOWN
with the Python exception text ("Unexpected <class 'OSError'>: [Errno 36]
File name too long: '/path/...'"), which leaks paths and says nothing a
client can act on. Every handler wears it, streaming ones included.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from services.gateway.dataplane import DataPlane
from services.gateway.header_forward import grpc_headers
from services.gateway.infer_answer import Answer, serialize, whole
from services.gateway.infer_request import InferCall, parse_infer_request
from services.gateway.log_control import grpc_log_settings
from services.gateway.python_models import mark_final
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc
from stageserve.h2grpc.server import H2GrpcServer
from stageserve.telemetry import GATEWAY_RPC_DURATION
from stageserve.transport import serve_stream

log = logging.getLogger(__name__)

R = TypeVar("R")
Handler = Callable[..., Awaitable[R] | AsyncIterator[R]]

_PASS_THROUGH = (asyncio.CancelledError, grpc.aio.AbortError)


def internal_message(rpc: str) -> str:
    return f"internal error in {rpc}; the server log has the detail"


def _one(request: gs.ModelInferRequest) -> tuple[gs.ModelInferRequest]:
    return (request,)


def client_message(exc: BaseException, rpc: str) -> str:
    """What a client is told of `exc` (a status message, or the error_message
    of one streamed response): a StageError's own message; for anything else
    the short INTERNAL text, with the detail and traceback in the log."""
    if isinstance(exc, StageError):
        return exc.message
    log.error(
        "unexpected error in a public RPC",
        exc_info=(type(exc), exc, exc.__traceback__),
        extra={"rpc": rpc, "error": f"{type(exc).__name__}: {exc}"[:500]},
    )
    return internal_message(rpc)


async def _abort(exc: Exception, rpc: str, context) -> None:
    code = exc.code if isinstance(exc, StageError) else grpc.StatusCode.INTERNAL
    await context.abort(code, client_message(exc, rpc))


def grpc_errors(handler: Handler) -> Handler:
    """StageError -> its status and message; anything else -> INTERNAL, logged.

    Works on unary handlers and on streaming ones (async generators). The
    client never sees Python exception text: the log line has it."""
    rpc = handler.__name__
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def streamed(self, request, context):
            try:
                async for item in handler(self, request, context):
                    yield item
            except _PASS_THROUGH:
                raise
            except Exception as exc:
                await _abort(exc, rpc, context)

        return streamed

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            await _abort(exc, rpc, context)

    return wrapped


INFERENCE_SERVICE = "inference.GRPCInferenceService"


class InferenceService(gs_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, own_wire: bool = False) -> None:
        """`own_wire`: ModelInfer takes an InferCall and answers an Answer,
        for the own HTTP/2 server, which parses the one and writes the other
        as parts (add_inference_service)."""
        self.dataplane = dataplane
        self._own_wire = own_wire
        self._rpc_timers: dict[str, object] = {}

    # ------------------------------------------------------------ health/meta

    @grpc_errors
    async def ServerLive(self, request, context) -> gs.ServerLiveResponse:
        return gs.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request, context) -> gs.ServerReadyResponse:
        return gs.ServerReadyResponse(ready=self.dataplane.server_ready())

    @grpc_errors
    async def ModelReady(self, request: gs.ModelReadyRequest, context) -> gs.ModelReadyResponse:
        return gs.ModelReadyResponse(
            ready=self.dataplane.model_ready(request.name, request.version)
        )

    @grpc_errors
    async def ServerMetadata(self, request, context) -> gs.ServerMetadataResponse:
        return self.dataplane.server_metadata()

    @grpc_errors
    async def ModelMetadata(
        self, request: gs.ModelMetadataRequest, context
    ) -> gs.ModelMetadataResponse:
        return self.dataplane.model_metadata(request)

    @grpc_errors
    async def ModelConfig(self, request: gs.ModelConfigRequest, context) -> gs.ModelConfigResponse:
        return self.dataplane.model_config(request)

    # ------------------------------------------------------------------ infer

    @grpc_errors
    async def ModelInfer(self, call: gs.ModelInferRequest | InferCall, context) -> Answer:
        start = time.perf_counter()
        code = "INTERNAL"
        raws = None
        if isinstance(call, InferCall):
            request, raws = call.request, call.raws
        else:
            request = call
        try:
            traceparent = ""
            if self.dataplane.traces is not None and self.dataplane.traces.active:
                traceparent = _traceparent(context)
            if (forward := self.dataplane.grpc_forward) is not None:
                forward.apply(request, grpc_headers(context.invocation_metadata() or ()))
            answer = await self.dataplane.infer_answer(request, raws, traceparent=traceparent)
            code = "OK"
            return answer if self._own_wire else whole(answer)
        except StageError as err:
            code = err.code.name
            raise
        finally:
            self._rpc_timer(code).observe(time.perf_counter() - start)

    def _rpc_timer(self, code: str):
        timer = self._rpc_timers.get(code)
        if timer is None:
            timer = self._rpc_timers[code] = GATEWAY_RPC_DURATION.labels("ModelInfer", code)
        return timer

    @grpc_errors
    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; each response carries its
        request's id, and an error goes into that response's error_message
        without closing the stream."""

        forward = self.dataplane.grpc_forward
        headers = grpc_headers(context.invocation_metadata() or ()) if forward else []

        async def answer(request: gs.ModelInferRequest, respond) -> None:
            if forward is not None:
                forward.apply(request, headers)
            # A decoupled model's responses before the final one go out as they come.
            stream = self.dataplane.decoupled_stream(request, respond)
            response: gs.ModelStreamInferResponse | None
            try:
                response = gs.ModelStreamInferResponse(
                    infer_response=await self.dataplane.infer(request, stream=stream)
                )
                mark_final(response)
                if stream is not None and (response := stream.last(response)) is None:
                    return  # a final flag without a response, and no empty final asked for
            except Exception as exc:  # a bug must not drop this response silently
                response = _stream_error(request, client_message(exc, "ModelStreamInfer"))
            respond(response)

        # Public protocol: one response per message (no packing).
        async for response in serve_stream(
            request_iterator, unpack=_one, handle=answer, concurrent=True
        ):
            yield response

    # ----------------------------------------------------- system shared memory

    @grpc_errors
    async def SystemSharedMemoryRegister(
        self, request: gs.SystemSharedMemoryRegisterRequest, context
    ) -> gs.SystemSharedMemoryRegisterResponse:
        return self.dataplane.shm_register(request)

    @grpc_errors
    async def SystemSharedMemoryStatus(
        self, request: gs.SystemSharedMemoryStatusRequest, context
    ) -> gs.SystemSharedMemoryStatusResponse:
        return self.dataplane.shm_status(request)

    @grpc_errors
    async def SystemSharedMemoryUnregister(
        self, request: gs.SystemSharedMemoryUnregisterRequest, context
    ) -> gs.SystemSharedMemoryUnregisterResponse:
        return self.dataplane.shm_unregister(request)

    # ------------------------------------------------------- CUDA shared memory

    @grpc_errors
    async def CudaSharedMemoryRegister(
        self, request: gs.CudaSharedMemoryRegisterRequest, context
    ) -> gs.CudaSharedMemoryRegisterResponse:
        return self.dataplane.cuda_shm_register(request)

    @grpc_errors
    async def CudaSharedMemoryStatus(
        self, request: gs.CudaSharedMemoryStatusRequest, context
    ) -> gs.CudaSharedMemoryStatusResponse:
        return self.dataplane.cuda_shm_status(request)

    @grpc_errors
    async def CudaSharedMemoryUnregister(
        self, request: gs.CudaSharedMemoryUnregisterRequest, context
    ) -> gs.CudaSharedMemoryUnregisterResponse:
        return self.dataplane.cuda_shm_unregister(request)

    # ------------------------------------------------------------- statistics

    @grpc_errors
    async def ModelStatistics(
        self, request: gs.ModelStatisticsRequest, context
    ) -> gs.ModelStatisticsResponse:
        return await self.dataplane.statistics(request)

    # ------------------------------------------------------------- repository

    @grpc_errors
    async def RepositoryIndex(
        self, request: gs.RepositoryIndexRequest, context
    ) -> gs.RepositoryIndexResponse:
        return self.dataplane.repository_index(request)

    @grpc_errors
    async def RepositoryModelLoad(
        self, request: gs.RepositoryModelLoadRequest, context
    ) -> gs.RepositoryModelLoadResponse:
        return await self.dataplane.load(request)

    @grpc_errors
    async def RepositoryModelUnload(
        self, request: gs.RepositoryModelUnloadRequest, context
    ) -> gs.RepositoryModelUnloadResponse:
        return await self.dataplane.unload(request)

    # ------------------------------------------------------------ log settings

    @grpc_errors
    async def LogSettings(self, request: gs.LogSettingsRequest, context) -> gs.LogSettingsResponse:
        if self.dataplane.log_control is None:
            raise StageError(grpc.StatusCode.UNIMPLEMENTED, "log settings are not served here")
        return await grpc_log_settings(self.dataplane.log_control, request)

    # ---------------------------------------------------------------- trace

    @grpc_errors
    async def TraceSetting(
        self, request: gs.TraceSettingRequest, context
    ) -> gs.TraceSettingResponse:
        # A read has no settings; an update names some (an empty list clears one).
        settings = {k: list(v.value) or None for k, v in request.settings.items()}
        answer = await self.dataplane.trace_setting(request.model_name, settings or None)
        out = gs.TraceSettingResponse()
        for key, values in answer.items():
            out.settings[key].value.extend(values)
        return out


def _traceparent(context) -> str:
    """The client's W3C traceparent metadata, if it sent one."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def _stream_error(request: gs.ModelInferRequest, message: str) -> gs.ModelStreamInferResponse:
    return gs.ModelStreamInferResponse(
        error_message=message,
        infer_response=gs.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


def add_inference_service(dataplane: DataPlane, server: grpc.aio.Server | H2GrpcServer) -> None:
    """Triton's GRPCInferenceService on `server`. On the own HTTP/2 server
    ModelInfer's request keeps its raw inputs apart (infer_request.py) and
    its answer goes out as parts (infer_answer.py): its handler is
    registered again with that deserializer and serializer, in place of the
    generated ones."""
    own = isinstance(server, H2GrpcServer)
    service = InferenceService(dataplane, own_wire=own)
    gs_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    if own:
        infer = grpc.unary_unary_rpc_method_handler(
            service.ModelInfer,
            request_deserializer=parse_infer_request,
            response_serializer=serialize,
        )
        server.add_registered_method_handlers(INFERENCE_SERVICE, {"ModelInfer": infer})
