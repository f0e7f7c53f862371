"""grpc.aio adapter of the public inference.GRPCInferenceService.

Each handler hands its request to the DataPlane (dataplane.py: validation,
conversion, statistics and metrics, shared with the HTTP front) and returns
its answer. Errors are StageErrors carrying Triton's status code; the
`grpc_errors` decorator ends the call with that code and message, and an
unexpected exception with INTERNAL, a short message and a log line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from services.gateway.dataplane import DataPlane
from services.gateway.python_models import mark_final
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc
from stageserve.telemetry import GATEWAY_RPC_DURATION

log = logging.getLogger(__name__)

R = TypeVar("R")
Handler = Callable[..., Awaitable[R]]


def grpc_errors(handler: Handler) -> Handler:
    """StageError -> its status and message; anything else -> INTERNAL, logged.

    The client never sees Python exception text: the log line has it."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except StageError as err:
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("unexpected error", extra={"rpc": handler.__name__, "error": repr(exc)})
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {handler.__name__}")

    return wrapped


class InferenceService(gs_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self._rpc_timers: dict[str, object] = {}

    # ------------------------------------------------------------ health/meta

    async def ServerLive(self, request, context) -> gs.ServerLiveResponse:
        return gs.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> gs.ServerReadyResponse:
        return gs.ServerReadyResponse(ready=self.dataplane.server_ready())

    async def ModelReady(self, request: gs.ModelReadyRequest, context) -> gs.ModelReadyResponse:
        return gs.ModelReadyResponse(
            ready=self.dataplane.model_ready(request.name, request.version)
        )

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
    async def ModelInfer(self, request: gs.ModelInferRequest, context) -> gs.ModelInferResponse:
        start = time.perf_counter()
        code = "INTERNAL"
        try:
            response = await self.dataplane.infer(request)
            code = "OK"
            return response
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

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; each response carries its
        request's id, and an error goes into that response's error_message
        without closing the stream."""
        responses: asyncio.Queue[gs.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def answer(request: gs.ModelInferRequest) -> None:
            # A decoupled model's responses before the final one go out as they come.
            stream = self.dataplane.decoupled_stream(request, responses.put_nowait)
            try:
                response = gs.ModelStreamInferResponse(
                    infer_response=await self.dataplane.infer(request, stream=stream)
                )
                mark_final(response)
                if stream is not None and (response := stream.last(response)) is None:
                    return  # a final flag without a response, and no empty final asked for
            except StageError as err:
                response = _stream_error(request, err.message)
            except Exception as exc:
                log.exception("unexpected error", extra={"rpc": "ModelStreamInfer"})
                response = _stream_error(request, f"internal error: {type(exc).__name__}")
            responses.put_nowait(response)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(answer(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.gather(*list(tasks))
            finally:
                responses.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await responses.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()

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


def _stream_error(request: gs.ModelInferRequest, message: str) -> gs.ModelStreamInferResponse:
    return gs.ModelStreamInferResponse(
        error_message=message,
        infer_response=gs.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )
