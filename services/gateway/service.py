"""grpc.aio adapter of the public inference.GRPCInferenceService.

Each handler converts the request once, asks the ModelManager / validation /
SchedulerLink, and converts the answer back. Errors are StageErrors carrying
Triton's status code; they end the call with that code and message.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.gateway.models import ModelManager
from services.gateway.python_models import (
    DecoupledStream,
    check_unary_allowed,
    decoupled_stream,
    mark_final,
    python_request_fields,
    stream_partials,
)
from services.gateway.recorder import RequestRecorder
from services.gateway.scheduler_link import SchedulerLink
from services.gateway.shared_memory import Region, SystemSharedMemory
from services.gateway.shared_stats import SharedStats
from services.gateway.statistics import StatsBook
from services.gateway.validation import SharedRef, validate_infer
from stageserve import __version__
from stageserve.errors import StageError, code_from_int, unavailable
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc
from stageserve.generated import stageserve_pb2 as pb
from stageserve.telemetry import GATEWAY_INFLIGHT, GATEWAY_RPC_DURATION

log = logging.getLogger(__name__)

SERVER_NAME = "stageserve"
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "statistics",
    "system_shared_memory",
]


class InferenceService(gs_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: ModelManager, scheduler: SchedulerLink) -> None:
        self.models = models
        self.scheduler = scheduler
        self.stats = StatsBook(self._generation_of)
        self.recorder = RequestRecorder(self.stats)
        self.shared: SharedStats | None = None  # set by the server: fleet-wide totals
        self._inflight_gauges: dict[str, object] = {}
        self._rpc_timers: dict[str, object] = {}
        self.ready = False
        self.shm = SystemSharedMemory()

    # ------------------------------------------------------------ health/meta

    async def ServerLive(self, request, context) -> gs.ServerLiveResponse:
        return gs.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> gs.ServerReadyResponse:
        return gs.ServerReadyResponse(ready=self.ready and self.models.all_ready())

    async def ModelReady(self, request: gs.ModelReadyRequest, context) -> gs.ModelReadyResponse:
        return gs.ModelReadyResponse(ready=self.models.is_ready(request.name, request.version))

    async def ServerMetadata(self, request, context) -> gs.ServerMetadataResponse:
        return gs.ServerMetadataResponse(
            name=SERVER_NAME, version=__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(
        self, request: gs.ModelMetadataRequest, context
    ) -> gs.ModelMetadataResponse:
        try:
            entry, _ = self.models.resolve(request.name, request.version)
        except StageError as err:
            await context.abort(err.code, err.message)
        spec = entry.spec
        assert spec is not None
        batch = [-1] if spec.batching else []
        return gs.ModelMetadataResponse(
            name=entry.name,
            versions=[str(v) for v in entry.ready_versions()],
            platform=spec.platform,
            inputs=[
                gs.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype.triton, shape=batch + list(t.dims)
                )
                for t in spec.inputs
            ],
            outputs=[
                gs.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype.triton, shape=batch + list(t.dims)
                )
                for t in spec.outputs
            ],
        )

    async def ModelConfig(self, request: gs.ModelConfigRequest, context) -> gs.ModelConfigResponse:
        try:
            entry, _ = self.models.resolve(request.name, request.version)
        except StageError as err:
            await context.abort(err.code, err.message)
        return gs.ModelConfigResponse(config=entry.config)

    # ------------------------------------------------------------------ infer

    async def ModelInfer(self, request: gs.ModelInferRequest, context) -> gs.ModelInferResponse:
        start = time.perf_counter()
        code = "OK"
        try:
            check_unary_allowed(self.models, request)
            return await self._infer(request)
        except StageError as err:
            code = err.code.name
            await context.abort(err.code, err.message)
        finally:
            self._rpc_timer(code).observe(time.perf_counter() - start)

    def _rpc_timer(self, code: str):
        timer = self._rpc_timers.get(code)
        if timer is None:
            timer = self._rpc_timers[code] = GATEWAY_RPC_DURATION.labels("ModelInfer", code)
        return timer

    async def _infer(
        self, request: gs.ModelInferRequest, stream: DecoupledStream | None = None
    ) -> gs.ModelInferResponse:
        start = time.monotonic_ns()
        entry, version = self.models.resolve(request.model_name, request.model_version)
        spec = entry.spec
        assert spec is not None
        inflight = self._inflight(entry.name)
        inflight.inc()
        self.models.begin(entry)
        held: dict[str, Region] = {}  # output -> its region, released when the request ends
        try:
            validated = validate_infer(request, spec, self._read_shared)
            for name, ref in validated.shared_outputs.items():
                held[name] = self.shm.acquire(ref.region)
                held[name].check(ref.offset, ref.byte_size)  # Triton checks before running
            resp = await self.scheduler.schedule(
                pb.ScheduleRequest(
                    model=entry.name,
                    version=version,
                    inputs=validated.inputs,
                    outputs=validated.outputs,
                    batch_size=validated.batch_size,
                    priority=validated.priority,
                    timeout_us=validated.timeout_us,
                    config_generation=entry.generation,
                    sequence_id=validated.sequence_id,
                    sequence_id_str=validated.sequence_id_str,
                    sequence_start=validated.sequence_start,
                    sequence_end=validated.sequence_end,
                    **python_request_fields(spec, request),
                ),
                on_more=stream_partials(stream, entry.name, version, request.id),
            )
            if stream is not None:
                stream.final(resp)
            self._record_steps(resp)
            if resp.code:
                raise StageError(code_from_int(resp.code), resp.message)
            out = gs.ModelInferResponse(
                model_name=entry.name, model_version=str(version), id=request.id
            )
            for t in resp.outputs:
                out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
                if t.name in held:  # as Triton: the bytes go to the region, the entry stays empty
                    _write_shared(held[t.name], validated.shared_outputs[t.name], t)
                    out.raw_output_contents.append(b"")
                else:
                    out.raw_output_contents.append(t.raw)
        except StageError as err:
            # Invalid requests count as failures too (Triton's reason OTHER);
            # they never reach the scheduler, so inference counts do not move.
            self.recorder.failure(
                entry.name, version, time.monotonic_ns() - start, err.code, err.message
            )
            raise
        finally:
            for region in held.values():
                self.shm.release(region)
            self.models.end(entry)
            inflight.dec()
        self.recorder.success(
            entry.name, version, time.monotonic_ns() - start, validated.batch_size, resp.timing
        )
        return out

    def _read_shared(self, ref: SharedRef) -> bytes:
        region = self.shm.acquire(ref.region)
        try:
            return region.read(ref.offset, ref.byte_size)
        finally:
            self.shm.release(region)

    # ----------------------------------------------------- system shared memory

    async def SystemSharedMemoryRegister(
        self, request: gs.SystemSharedMemoryRegisterRequest, context
    ) -> gs.SystemSharedMemoryRegisterResponse:
        try:
            self.shm.register(request.name, request.key, request.offset, request.byte_size)
        except StageError as err:
            await context.abort(err.code, err.message)
        return gs.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryStatus(
        self, request: gs.SystemSharedMemoryStatusRequest, context
    ) -> gs.SystemSharedMemoryStatusResponse:
        try:
            regions = self.shm.status(request.name)
        except StageError as err:
            await context.abort(err.code, err.message)
        status = gs.SystemSharedMemoryStatusResponse.RegionStatus
        return gs.SystemSharedMemoryStatusResponse(
            regions={
                r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size)
                for r in regions
            }
        )

    async def SystemSharedMemoryUnregister(
        self, request: gs.SystemSharedMemoryUnregisterRequest, context
    ) -> gs.SystemSharedMemoryUnregisterResponse:
        self.shm.unregister(request.name)
        return gs.SystemSharedMemoryUnregisterResponse()

    def _record_steps(self, resp: pb.ScheduleResponse) -> None:
        """An ensemble's composing executions count for their own models."""
        for st in resp.steps:
            if st.failed:
                code = code_from_int(st.code)
                self.recorder.failure(st.model, st.version, st.duration_ns, code, st.message)
            else:
                self.recorder.success(
                    st.model, st.version, st.duration_ns, st.batch_size, st.timing
                )

    def _inflight(self, model: str):
        gauge = self._inflight_gauges.get(model)
        if gauge is None:
            gauge = self._inflight_gauges[model] = GATEWAY_INFLIGHT.labels(model)
        return gauge

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; each response carries its
        request's id, and an error goes into that response's error_message
        without closing the stream."""
        responses: asyncio.Queue[gs.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def answer(request: gs.ModelInferRequest) -> None:
            stream = decoupled_stream(self.models, request, responses.put_nowait)
            try:
                response = gs.ModelStreamInferResponse(
                    infer_response=await self._infer(request, stream)
                )
                mark_final(response)
                if stream is not None and (response := stream.last(response)) is None:
                    return
            except StageError as err:
                response = gs.ModelStreamInferResponse(
                    error_message=err.message,
                    infer_response=gs.ModelInferResponse(
                        model_name=request.model_name,
                        model_version=request.model_version,
                        id=request.id,
                    ),
                )
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

    # ------------------------------------------------------------- statistics

    def _generation_of(self, model: str) -> int:
        entry = self.models.entries.get(model)
        return entry.generation if entry is not None else 0

    async def ModelStatistics(
        self, request: gs.ModelStatisticsRequest, context
    ) -> gs.ModelStatisticsResponse:
        wanted: list[tuple[str, int, int]] = []
        if request.name:
            try:
                entry, _ = self.models.resolve(request.name, request.version)
            except StageError as err:
                await context.abort(err.code, err.message)
            versions = [int(request.version)] if request.version else entry.ready_versions()
            wanted = [(entry.name, v, entry.generation) for v in versions]
        else:
            for name, entry in sorted(self.models.entries.items()):
                wanted += [(name, v, entry.generation) for v in entry.ready_versions()]
        out = gs.ModelStatisticsResponse()
        out.model_stats.extend(await self._statistics(wanted))
        return out

    async def _statistics(self, wanted: list[tuple[str, int, int]]) -> list[gs.ModelStatistics]:
        """Totals over every gateway; this gateway's own if Redis is away."""
        if self.shared is not None and wanted:
            try:
                return await self.shared.totals(wanted)
            except Exception as exc:
                log.warning("shared statistics unavailable", extra={"error": str(exc)})
        return [self.stats.of(m, v).to_pb(m, v) for m, v, _ in wanted]

    # ------------------------------------------------------------- repository

    async def RepositoryIndex(
        self, request: gs.RepositoryIndexRequest, context
    ) -> gs.RepositoryIndexResponse:
        out = gs.RepositoryIndexResponse()
        for name, version, state, reason in self.models.index():
            if request.ready and state != "READY":
                continue
            out.models.add(name=name, version=version, state=state, reason=reason)
        return out

    async def RepositoryModelLoad(
        self, request: gs.RepositoryModelLoadRequest, context
    ) -> gs.RepositoryModelLoadResponse:
        await self._check_explicit(context, "load")
        if request.repository_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "StageServe serves one model repository; repository_name must be empty",
            )
        if request.parameters:
            unsupported = sorted(request.parameters)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"load parameters {unsupported} are not supported (config/file overrides)",
            )
        try:
            await self.models.load(request.model_name)
        except StageError as err:
            await context.abort(err.code, err.message)
        self.stats.reset(request.model_name)
        return gs.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: gs.RepositoryModelUnloadRequest, context
    ) -> gs.RepositoryModelUnloadResponse:
        await self._check_explicit(context, "unload")
        try:
            await self.models.unload(request.model_name)
        except StageError as err:
            await context.abort(err.code, err.message)
        return gs.RepositoryModelUnloadResponse()

    async def _check_explicit(self, context, what: str) -> None:
        if self.models.control_mode != "explicit":
            err = unavailable(
                f"explicit model {what} is not allowed: model control mode is "
                f"'{self.models.control_mode}' (start with --model-control-mode explicit)"
            )
            await context.abort(err.code, err.message)


def _write_shared(region: Region, ref: SharedRef, t: pb.Tensor) -> None:
    if len(t.raw) > ref.byte_size:
        raise StageError(
            grpc.StatusCode.INTERNAL,
            f"shared memory size specified with the request for output '{t.name}' "
            f"({ref.byte_size} bytes) should be at least {len(t.raw)} bytes to hold the results",
        )
    region.write(ref.offset, t.raw)
