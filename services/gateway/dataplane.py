"""The one dataplane behind both public fronts (gRPC and HTTP/REST).

Every operation takes the request as the `inference.*` protobuf message the
gRPC front receives and answers the protobuf response, or raises a StageError
with Triton's status code and message. The gRPC front (service.py) is then a
thin adapter, and the HTTP front (http/) converts JSON / binary bodies to and
from the same messages, so validation, conversion to the internal request,
statistics and metrics exist once (MLServer's handlers/dataplane.py with thin
grpc/ and rest/ adapters is the model).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.gateway import cuda_inplace, shm_copies
from services.gateway.cache_metrics import CacheMetrics
from services.gateway.header_forward import HeaderForward
from services.gateway.infer_answer import PARTS_FROM, Answer, InferAnswer, whole
from services.gateway.log_control import LogControl
from services.gateway.model_lifecycle import ModelLifecycle
from services.gateway.model_table import ModelTable
from services.gateway.overrides import OverrideArea
from services.gateway.python_models import (
    DecoupledStream,
    check_unary_allowed,
    python_request_fields,
    stream_partials,
)
from services.gateway.request_trace import FileRequestTrace, RequestTrace
from services.gateway.shared_memory import CUDA, Region, SharedMemory
from services.gateway.shm_copies import OutputWrite
from services.gateway.tensor_transport import TensorTransport
from services.gateway.trace_settings import TraceSettingError, TraceSettings
from stageserve import __version__, cuda_ipc
from stageserve.config import ModelSpec
from stageserve.errors import StageError, invalid, unavailable
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.recorder import RequestRecorder
from stageserve.response_cache import (
    ResponseCache,
    decode_entry,
    encode_entry,
    request_key,
)
from stageserve.scheduler_routing import SchedulerRouter
from stageserve.settings import GatewaySettings
from stageserve.shared_stats import SharedStats
from stageserve.statistics import StatsBook, requested_versions
from stageserve.telemetry import GATEWAY_INFLIGHT
from stageserve.tensor_shm import take_outputs
from stageserve.validation import (
    PlaceRaw,
    ReadShared,
    SharedRef,
    ValidatedRequest,
    shared_inputs,
    validate_infer,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: ServerMetadata's name by default: "triton", as Triton answers, because Triton's
#: own client examples (simple_grpc_health_metadata, simple_http_health_metadata)
#: and clients written from them check it; `--server-name` sets another. The
#: version stays StageServe's own.
DEFAULT_SERVER_NAME = "triton"
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "statistics",
    "system_shared_memory",
    "binary_tensor_data",
]


def extensions() -> list[str]:
    """EXTENSIONS, with cuda_shared_memory where this gateway can open CUDA IPC
    handles (the first call probes CUDA once: stageserve/cuda_ipc.py)."""
    if not cuda_ipc.available():
        return EXTENSIONS
    at = EXTENSIONS.index("system_shared_memory") + 1
    return [*EXTENSIONS[:at], "cuda_shared_memory", *EXTENSIONS[at:]]


class DataPlane:
    def __init__(
        self,
        models: ModelTable,
        lifecycle: ModelLifecycle,
        scheduler: SchedulerRouter,
        server_name: str = DEFAULT_SERVER_NAME,
        *,
        shm_copy_thread_bytes: int = GatewaySettings.shm_copy_thread_bytes,
        shm_copy_threads: int = GatewaySettings.shm_copy_threads,
    ) -> None:
        """`models` is read on every request; `lifecycle` only by the repository
        RPCs; `server_name` is what ServerMetadata answers on both fronts;
        `shm_copy_*`: a request's shared-memory copies that total more bytes
        than this run on that many threads of their own (shm_copies.py)."""
        self.models = models
        self.lifecycle = lifecycle
        self.server_name = server_name
        self.scheduler = scheduler
        self.stats = StatsBook(self._generation_of)
        self.recorder = RequestRecorder(self.stats)
        self.shared: SharedStats | None = None  # set by the server: fleet-wide totals
        self.log_control: LogControl | None = None  # set by the server: LogSettings
        self._inflight_watched: set[str] = set()
        self.ready = False
        # Triton's --strict-readiness: ServerReady also needs every model ready
        self.strict_readiness = True
        self.shm = SharedMemory()  # system and CUDA regions, one table as Triton's
        self.shm_copy_thread_bytes = shm_copy_thread_bytes
        self._copy_threads = ThreadPoolExecutor(shm_copy_threads, thread_name_prefix="shm-copy")
        self.traces: TraceSettings | None = None  # set by the server
        # Triton's --grpc/http-header-forward-pattern (header_forward.py); set by the server
        self.grpc_forward: HeaderForward | None = None
        self.http_forward: HeaderForward | None = None
        self.overrides = OverrideArea()  # RepositoryModelLoad's config/file overrides
        # --cache-config's response cache (set by the server); None: nothing cached
        self.cache: ResponseCache | None = None
        # its cache-wide nv_cache_* gauges (set with it)
        self.cache_metrics: CacheMetrics | None = None
        # the gateway's shared-memory tensor transport (set by the server when
        # the stack's tensor_shm is on; stageserve/tensor_shm.py); None: inline bytes
        self.tensor_transport: TensorTransport | None = None

    def close(self) -> None:
        """Stop the copy threads once the copies given to them are done."""
        self._copy_threads.shutdown(wait=False)

    # ------------------------------------------------------------ health/meta

    def server_ready(self) -> bool:
        return self.ready and (not self.strict_readiness or self.models.all_ready())

    def model_ready(self, name: str, version: str) -> bool:
        return self.models.is_ready(name, version)

    def server_metadata(self) -> gs.ServerMetadataResponse:
        return gs.ServerMetadataResponse(
            name=self.server_name, version=__version__, extensions=extensions()
        )

    def model_metadata(self, request: gs.ModelMetadataRequest) -> gs.ModelMetadataResponse:
        entry, _ = self.models.resolve(request.name, request.version)
        spec = entry.spec
        assert spec is not None
        batch = [-1] if spec.batching else []
        meta = gs.ModelMetadataResponse.TensorMetadata
        return gs.ModelMetadataResponse(
            name=entry.name,
            versions=[str(v) for v in entry.ready_versions()],
            platform=spec.platform,
            inputs=[
                meta(name=t.name, datatype=t.datatype.triton, shape=batch + list(t.dims))
                for t in spec.inputs
            ],
            outputs=[
                meta(name=t.name, datatype=t.datatype.triton, shape=batch + list(t.dims))
                for t in spec.outputs
            ],
        )

    def model_config(self, request: gs.ModelConfigRequest) -> gs.ModelConfigResponse:
        entry, _ = self.models.resolve(request.name, request.version)
        return gs.ModelConfigResponse(config=entry.config)

    # ------------------------------------------------------------------ infer

    def decoupled_stream(
        self,
        request: gs.ModelInferRequest,
        put: Callable[[gs.ModelStreamInferResponse], None],
    ) -> DecoupledStream | None:
        """For a request to a decoupled model, the DecoupledStream that `put`s its
        responses before the final one as they arrive; None for other models."""
        entry = self.models.entries.get(request.model_name)
        spec = entry.spec if entry is not None else None
        return DecoupledStream(request, put) if spec is not None and spec.decoupled else None

    def is_decoupled(self, model: str) -> bool:
        entry = self.models.entries.get(model)
        return bool(entry is not None and entry.spec is not None and entry.spec.decoupled)

    async def infer(
        self,
        request: gs.ModelInferRequest,
        raw_contents: Sequence[bytes | memoryview] | None = None,
        *,
        stream: DecoupledStream | None = None,
        traceparent: str = "",
    ) -> gs.ModelInferResponse:
        """infer_answer's answer as one message."""
        answer = await self.infer_answer(
            request, raw_contents, stream=stream, traceparent=traceparent
        )
        return whole(answer)

    async def infer_answer(
        self,
        request: gs.ModelInferRequest,
        raw_contents: Sequence[bytes | memoryview] | None = None,
        *,
        stream: DecoupledStream | None = None,
        traceparent: str = "",
    ) -> Answer:
        """The answer, its raw outputs apart when they are large (infer_answer.py).
        `raw_contents` stands for request.raw_input_contents (validation.py).

        A decoupled model needs `stream` (decoupled_stream()): its earlier
        responses go there and this returns the final one (see stream.last());
        without one, a decoupled model is refused as Triton's ModelInfer does.
        `traceparent`: the client's W3C trace context, the parent of this
        request's spans when it is traced."""
        if stream is None:
            check_unary_allowed(self.models, request)
        start = time.monotonic_ns()
        entry, version = self.models.resolve(request.model_name, request.model_version)
        spec = entry.spec
        assert spec is not None
        if entry.name not in self._inflight_watched:
            self._watch_inflight(entry.name)
        trace: RequestTrace | FileRequestTrace | None = None
        if self.traces is not None and self.traces.active:  # untraced: this check only
            trace = await self.traces.begin(entry.name, version, traceparent, request.id, start)
        timing: pb.Timing | None = None
        self.models.begin(entry, version)
        held: dict[str, Region] = {}  # output -> its region, released when the request ends
        scheduled = False
        staged: list[pb.TensorPart] = []  # inputs in the tensor region, freed when it ends
        in_place = self._in_place(spec, trace)  # CUDA regions the worker uses itself
        try:
            # validation's first check, parsed once for the read-ahead and validation
            shared = shared_inputs(request.inputs, spec.name)
            read_shared: ReadShared = self.shm.read
            if shared:
                read_shared = await self._input_reader(request, shared, in_place)
            validated = validate_infer(
                request,
                spec,
                read_shared,
                raw_contents,
                in_place.input_part if in_place is not None else None,
                shared,
                self._placer(spec, trace, staged),
            )
            if trace is not None:
                trace.validated(start, time.monotonic_ns())
                trace.inputs(validated.inputs)
            for name, ref in validated.shared_outputs.items():
                held[name] = self.shm.acquire(ref.region)
                held[name].check(ref.offset, ref.byte_size)  # Triton checks before running
            cache_key, lookup_ns, hit = await self._cache_lookup(
                entry.generation, spec, version, validated
            )
            if hit is not None:
                out, writes = _response(entry.name, version, request.id, hit, held, validated)
                if writes:
                    await self._write_outputs(writes)
                request_ns = time.monotonic_ns() - start
                self.recorder.cache_hit(entry.name, version, request_ns, 0, lookup_ns)
                return out
            scheduled = True
            shm = self.tensor_transport
            if shm is not None:  # what validation did not place (a traced request's)
                staged += shm.stage(spec, validated.inputs)
            scheduled_request = pb.ScheduleRequest(
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
            )
            if trace is not None:
                scheduled_request.traceparent = trace.traceparent()
            if shm is not None:
                shm.address(spec, scheduled_request)
            if in_place is not None:
                scheduled_request.cuda_outputs.extend(in_place.outputs(spec, validated, held))
            resp = await self.scheduler.schedule(
                scheduled_request,
                on_more=stream_partials(stream, entry.name, version, request.id),
            )
            if resp.failure == pb.TENSOR_REGION_NOT_LOCAL and shm is not None:
                # a worker that cannot map this gateway's region (another host
                # or container, not yet seen as such) or open a client's CUDA
                # handle: once more, bytes inline
                if in_place is not None:
                    in_place.to_host(scheduled_request)
                shm.inline(spec, scheduled_request)
                resp = await self.scheduler.schedule(
                    scheduled_request,
                    on_more=stream_partials(stream, entry.name, version, request.id),
                )
            # the tensors' own bytes only for what reads them again: a cache
            # insert, a trace, a write into a client's region
            taken = take_outputs(
                resp.outputs, keep_raw=bool(held) or cache_key is not None or trace is not None
            )
            if in_place is not None and not resp.failure:
                cuda_inplace.count(scheduled_request, resp.outputs)
            if stream is not None:
                stream.final(resp)
            timing = resp.timing
            self._record_steps(resp)
            if trace is not None:
                trace.answered(resp)
            if resp.failure:
                if resp.model_error:  # the model answered: a success in Triton's statistics
                    scheduled = False
                    self.recorder.success(
                        entry.name,
                        version,
                        time.monotonic_ns() - start,
                        validated.batch_size,
                        resp.timing,
                    )
                raise StageError.of(resp.failure, resp.message)
            out, writes = _response(
                entry.name, version, request.id, resp.outputs, held, validated, taken
            )
            if writes:
                await self._write_outputs(writes)
        except StageError as err:
            # A request refused before scheduling (invalid) is no failure in
            # Triton 2.51's statistics nor metrics (measured: bench/triton_diff.py).
            if scheduled:
                self.recorder.failure(entry.name, version, time.monotonic_ns() - start, err.reason)
            if trace is not None:
                trace.end(time.monotonic_ns(), err.message, timing)
                trace = None
            raise
        finally:
            if trace is not None:
                trace.end(time.monotonic_ns(), timing=timing)
            for region in held.values():
                self.shm.release(region)
            if in_place is not None:
                in_place.release()
            if staged:
                assert self.tensor_transport is not None
                self.tensor_transport.release(staged)
            self.models.end(entry, version)
        self.recorder.success(
            entry.name, version, time.monotonic_ns() - start, validated.batch_size, resp.timing
        )
        if cache_key is not None and self.cache is not None:
            inserted = time.monotonic_ns()
            usage = await self.cache.insert(cache_key, encode_entry(resp.outputs))
            insert_ns = time.monotonic_ns() - inserted
            if self.cache_metrics is not None:
                self.cache_metrics.inserted(usage, insert_ns)
            self.recorder.cache_miss(entry.name, version, lookup_ns + insert_ns)
        return out

    async def _cache_lookup(
        self, generation: int, spec: ModelSpec, version: int, validated: ValidatedRequest
    ) -> tuple[bytes | None, int, list[pb.Tensor] | None]:
        """(key, lookup ns, cached outputs or None) for a model that enables the
        response cache on a gateway that keeps one; (None, 0, None) otherwise."""
        if self.cache is None or not spec.response_cache:
            return None, 0, None
        looked = time.monotonic_ns()
        # every output named is the same answer as none named (all), as in Triton
        named = set(validated.outputs)
        outputs = [] if named == {t.name for t in spec.outputs} else validated.outputs
        key = request_key(spec.name, version, generation, validated.inputs, outputs)
        data = await self.cache.lookup(key)
        hit = decode_entry(data) if data is not None else None
        lookup_ns = time.monotonic_ns() - looked
        if self.cache_metrics is not None:
            self.cache_metrics.looked_up(hit is not None, lookup_ns)
        return key, lookup_ns, hit

    def _placer(
        self,
        spec: ModelSpec,
        trace: RequestTrace | FileRequestTrace | None,
        staged: list[pb.TensorPart],
    ) -> PlaceRaw | None:
        """Validation's hook that puts large inputs in the tensor region as it
        checks them, where the request goes through shared memory and neither
        a trace (its tensor events) nor the response cache (its key) reads
        the inputs' bytes first."""
        if self.tensor_transport is None or trace is not None:
            return None
        if self.cache is not None and spec.response_cache:
            return None
        return self.tensor_transport.placer(spec, staged)

    def _in_place(
        self, spec: ModelSpec, trace: RequestTrace | FileRequestTrace | None
    ) -> cuda_inplace.InPlace | None:
        """This request's in-place references, where its model's worker may
        use CUDA regions directly (cuda_inplace.py); None: the copy path."""
        if self.tensor_transport is None or trace is not None:
            return None
        device = self.tensor_transport.cuda_device(spec)
        return None if device is None else cuda_inplace.InPlace(self.shm, device)

    async def _input_reader(
        self,
        request: gs.ModelInferRequest,
        shared: Mapping[str, SharedRef],
        in_place: cuda_inplace.InPlace | None,
    ) -> ReadShared:
        """validate_infer's reader of the `shared` inputs: reads on the loop,
        or, past shm_copy_thread_bytes, the bytes read ahead by a copy thread."""
        taken = in_place.takes if in_place is not None else None
        refs = shm_copies.input_refs(request, shared, taken)
        if not shm_copies.in_thread((r.byte_size for r in refs), self.shm_copy_thread_bytes):
            return self.shm.read
        done = await self._in_copy_thread(shm_copies.read_ahead, refs, self.shm.read_in_thread)
        return shm_copies.served(done, self.shm.read)

    async def _write_outputs(self, writes: list[OutputWrite]) -> None:
        """The outputs requested into regions, written before the response
        goes: on the loop, or, past shm_copy_thread_bytes, by a copy thread."""
        if not shm_copies.in_thread((w.byte_size() for w in writes), self.shm_copy_thread_bytes):
            shm_copies.write_outputs(writes)
            return
        for w in writes:  # the thread's own holds: a cancelled request releases only its own
            self.shm.hold(w.region)
        await self._in_copy_thread(self._write_held, writes)

    def _write_held(self, writes: list[OutputWrite]) -> None:
        try:
            shm_copies.write_outputs(writes, in_thread=True)
        finally:
            for w in writes:
                self.shm.release(w.region)

    async def _in_copy_thread(self, copy: Callable[..., T], *args: object) -> T:
        """`copy(*args)` on a copy thread. Shielded: a request cancelled while it
        waits leaves the copy to run (a copy releases the regions it holds)."""
        loop = asyncio.get_running_loop()
        return await asyncio.shield(loop.run_in_executor(self._copy_threads, copy, *args))

    def _record_steps(self, resp: pb.ScheduleResponse) -> None:
        """An ensemble's composing executions count for their own models."""
        for st in resp.steps:
            if st.failure and not st.model_error:
                self.recorder.failure(st.model, st.version, st.duration_ns, st.failure)
            elif st.cache_hit:  # answered from the response cache by the scheduler
                self.recorder.cache_hit(st.model, st.version, st.duration_ns, 0, st.cache_ns)
            else:
                self.recorder.success(
                    st.model, st.version, st.duration_ns, st.batch_size, st.timing
                )
                if st.cache_miss:
                    self.recorder.cache_miss(st.model, st.version, st.cache_ns)
            if self.cache_metrics is not None and (st.cache_hit or st.cache_miss):
                # a step's cache time is one figure: a hit's is its lookup's
                self.cache_metrics.looked_up(st.cache_hit, st.cache_ns if st.cache_hit else 0)

    def _watch_inflight(self, model: str) -> None:
        """The in-flight gauge reads ModelTable's count (begin/end) at scrape
        time: no lock taken twice per request (Gauge.inc/dec, 0.8 us)."""
        self._inflight_watched.add(model)
        GATEWAY_INFLIGHT.labels(model).set_function(lambda: self.models.in_flight(model))

    # ----------------------------------------------------- system shared memory

    def shm_register(
        self, request: gs.SystemSharedMemoryRegisterRequest
    ) -> gs.SystemSharedMemoryRegisterResponse:
        self.shm.register(request.name, request.key, request.offset, request.byte_size)
        return gs.SystemSharedMemoryRegisterResponse()

    def shm_status(
        self, request: gs.SystemSharedMemoryStatusRequest
    ) -> gs.SystemSharedMemoryStatusResponse:
        status = gs.SystemSharedMemoryStatusResponse.RegionStatus
        return gs.SystemSharedMemoryStatusResponse(
            regions={
                r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size)
                for r in self.shm.status(request.name)
            }
        )

    def shm_unregister(
        self, request: gs.SystemSharedMemoryUnregisterRequest
    ) -> gs.SystemSharedMemoryUnregisterResponse:
        self.shm.unregister(request.name)
        return gs.SystemSharedMemoryUnregisterResponse()

    # ------------------------------------------------------- CUDA shared memory

    def cuda_shm_status(
        self, request: gs.CudaSharedMemoryStatusRequest
    ) -> gs.CudaSharedMemoryStatusResponse:
        status = gs.CudaSharedMemoryStatusResponse.RegionStatus
        return gs.CudaSharedMemoryStatusResponse(
            regions={
                r.name: status(name=r.name, device_id=r.device_id, byte_size=r.byte_size)
                for r in self.shm.status(request.name, CUDA)
            }
        )

    def cuda_shm_register(
        self, request: gs.CudaSharedMemoryRegisterRequest
    ) -> gs.CudaSharedMemoryRegisterResponse:
        self.shm.register_cuda(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return gs.CudaSharedMemoryRegisterResponse()

    def cuda_shm_unregister(
        self, request: gs.CudaSharedMemoryUnregisterRequest
    ) -> gs.CudaSharedMemoryUnregisterResponse:
        self.shm.unregister(request.name, CUDA)
        return gs.CudaSharedMemoryUnregisterResponse()

    # ------------------------------------------------------------- statistics

    # ------------------------------------------------------------- tracing

    async def trace_setting(
        self, model: str, settings: dict[str, list[str] | None] | None
    ) -> dict[str, list[str]]:
        """Triton's TraceSetting: `settings` None reads, else updates (a None
        or empty value clears that field). INVALID_ARGUMENT or UNIMPLEMENTED
        with Triton's message when refused."""
        if model and not self.models.ready_now(model):
            raise invalid(f"Request for unknown model : {model}")
        if self.traces is None:
            raise StageError.of(pb.UNIMPLEMENTED, "tracing is not enabled on this gateway")
        try:
            if settings is None:
                return await self.traces.get(model)
            return await self.traces.update(model, settings)
        except TraceSettingError as err:
            reason = pb.UNIMPLEMENTED if err.unimplemented else pb.INVALID_INPUT
            raise StageError.of(reason, err.message) from None

    def loaded_series(self) -> None:
        """Every ready model version's Triton counters (0 until its first
        request), none of the others' (their failure counters stay). Runs on
        the metrics server's thread: reads a copy of the table's entries."""
        ready = {
            (name, version)
            for name, entry in list(self.models.entries.items())
            for version in entry.ready_versions()
        }
        self.recorder.unloaded(ready)
        for name, version in ready:
            self.recorder.loaded(name, version)

    def _generation_of(self, model: str) -> int:
        entry = self.models.entries.get(model)
        return entry.generation if entry is not None else 0

    async def statistics(self, request: gs.ModelStatisticsRequest) -> gs.ModelStatisticsResponse:
        wanted = requested_versions(self.models.entries, request.name, request.version)
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

    def repository_index(self, request: gs.RepositoryIndexRequest) -> gs.RepositoryIndexResponse:
        out = gs.RepositoryIndexResponse()
        for name, version, state, reason in self.lifecycle.index():
            if request.ready and state != "READY":
                continue
            out.models.add(name=name, version=version, state=state, reason=reason)
        return out

    async def load(self, request: gs.RepositoryModelLoadRequest) -> gs.RepositoryModelLoadResponse:
        self._check_explicit("load")
        if request.repository_name:
            raise invalid("StageServe serves one model repository; repository_name must be empty")
        name = request.model_name
        root = self.overrides.prepare(name, request.parameters, self.lifecycle.repository)
        loaded = False
        try:
            if await self.lifecycle.load(name, root=root):  # False: unchanged, a no-op
                self.stats.reset(name)
            loaded = True
        finally:
            self.overrides.settle(name, root, loaded)
        return gs.RepositoryModelLoadResponse()

    async def unload(
        self, request: gs.RepositoryModelUnloadRequest
    ) -> gs.RepositoryModelUnloadResponse:
        self._check_explicit("unload")
        dependents = request.parameters.get("unload_dependents")
        await self.lifecycle.unload(request.model_name, bool(dependents and dependents.bool_param))
        self.overrides.settle(request.model_name, None, loaded=True)
        return gs.RepositoryModelUnloadResponse()

    def _check_explicit(self, what: str) -> None:
        if self.lifecycle.control_mode != "explicit":
            raise unavailable(
                f"explicit model {what} is not allowed: model control mode is "
                f"'{self.lifecycle.control_mode}' (start with --model-control-mode explicit)"
            )


def _response(
    model: str,
    version: int,
    request_id: str,
    outputs: Iterable[pb.Tensor],
    held: dict[str, Region],
    validated: ValidatedRequest,
    taken: Sequence[bytes | None] = (),
) -> tuple[Answer, list[OutputWrite]]:
    """The answer, and the outputs to write into their regions, in order (as
    Triton: the bytes go to the region, the response's entry stays empty).
    `taken`: take_outputs' bytes of the outputs it copied out of shared memory
    (their `raw` not read again: a 49 KB copy less)."""
    out = gs.ModelInferResponse(model_name=model, model_version=str(version), id=request_id)
    contents = out.raw_output_contents
    apart: list[bytes] | None = None  # from the first large output on (infer_answer.py)
    writes = []
    for i, t in enumerate(outputs):
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        raw: bytes = b""
        if t.name in held:
            if not t.device_written:  # else the worker wrote the region itself
                writes.append(OutputWrite(held[t.name], validated.shared_outputs[t.name], t))
        else:
            copied = taken[i] if i < len(taken) else None
            raw = t.raw if copied is None else copied
        if apart is None and len(raw) < PARTS_FROM:
            contents.append(raw)
        elif apart is None:
            apart = [raw]
        else:
            apart.append(raw)
    return (out if apart is None else InferAnswer(out, apart)), writes
