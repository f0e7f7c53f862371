"""Gateway process: wire the public service to Redis, rate limiter and scheduler."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from services.gateway.cache_metrics import CacheMetrics
from services.gateway.dataplane import DataPlane
from services.gateway.header_forward import HeaderForward
from services.gateway.http.app import HttpFront
from services.gateway.http.server import HttpServer, http_server
from services.gateway.log_control import LogControl
from services.gateway.model_lifecycle import ModelLifecycle
from services.gateway.model_table import ModelTable
from services.gateway.poller import RepositoryPoller
from services.gateway.queue_metrics import PendingGauge
from services.gateway.republish import Republisher
from services.gateway.security import RestrictedProtocols, server_credentials, ssl_context
from services.gateway.service import INFERENCE_SERVICE, add_inference_service
from services.gateway.startup import StartupLoadFailed, report, startup_failures
from services.gateway.tensor_transport import tensor_transport
from services.gateway.trace_settings import TraceSettings
from stageserve import tensor_shm
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.h2grpc.server import H2GrpcServer
from stageserve.model_state import ModelStateStore
from stageserve.net import SERVER_OPTIONS, listen_failed, stage_channel
from stageserve.redis_connect import connect
from stageserve.response_cache import open_cache
from stageserve.scheduler_routing import scheduler_router
from stageserve.service_runtime import end_on_listen_failure, run_server
from stageserve.settings import Settings
from stageserve.shared_stats import SharedStats
from stageserve.telemetry import render, serve_metrics
from stageserve.trace_store import TraceStore
from stageserve.tracing import parse_trace_config

log = logging.getLogger(__name__)

# The methods whose answers Triton's --grpc-infer-response-compression-level
# compresses (Triton 2.51, tests/integration/test_grpc_response_compression.py).
INFER_METHODS = ("ModelInfer", "ModelStreamInfer")


async def serve(
    listen: str,
    redis_url: str,
    ratelimiter_address: str,
    scheduler_address: str,
    repository: Path,
    load_models: list[str],
    settings: Settings,
    metrics_port: int | None = None,
    http_listen: str | None = None,
) -> None:
    """`http_listen` (host:port, port 0 picks one) also serves the HTTP/REST
    front on the same dataplane; None: gRPC only. `settings.gateway` holds the
    model control mode, the repository poll period, auto-complete, the public
    endpoints' TLS and restrictions, Triton's --exit-on-error and
    --strict-readiness (services/gateway/startup.py: a startup model that fails
    raises StartupLoadFailed under the first), and the gateway's figures."""
    gateway = settings.gateway
    tls, restrictions = gateway.public_tls, gateway.grpc_restrictions
    control_mode = gateway.model_control_mode
    redis = connect(redis_url, settings.redis_client)
    await redis.ping()
    rl_channel = stage_channel(ratelimiter_address, settings.stage_tls)
    models = ModelTable()
    lifecycle = ModelLifecycle(
        models,
        repository,
        ModelStateStore(redis),
        pb_grpc.RateLimiterStub(rl_channel),
        gateway,
        autocomplete=gateway.autocomplete,
    )
    link = await scheduler_router(redis, scheduler_address, settings)
    dataplane = DataPlane(
        models,
        lifecycle,
        link,
        gateway.server_name,
        shm_copy_thread_bytes=gateway.shm_copy_thread_bytes,
        shm_copy_threads=gateway.shm_copy_threads,
    )
    dataplane.strict_readiness = gateway.strict_readiness
    dataplane.shared = SharedStats(redis, dataplane.stats, gateway.stats_publish_s)
    dataplane.shared.start()
    dataplane.log_control = LogControl(redis)
    dataplane.cache = open_cache(gateway.response_cache, redis, settings.redis_client)
    if dataplane.cache is not None:
        dataplane.cache_metrics = CacheMetrics(dataplane.cache.size)
    if gateway.grpc_header_forward_pattern:
        dataplane.grpc_forward = HeaderForward(gateway.grpc_header_forward_pattern)
    if gateway.http_header_forward_pattern:
        dataplane.http_forward = HeaderForward(gateway.http_header_forward_pattern)
    dataplane.traces = TraceSettings(TraceStore(redis), parse_trace_config(gateway.trace_config))
    dataplane.tensor_transport = tensor_transport(
        tensor_shm.install(settings.stack, redis_url, "gateway"),
        pb_grpc.RateLimiterStub(rl_channel),
        redis,
    )
    await dataplane.traces.start()
    republisher = Republisher(lifecycle, redis, gateway)
    await republisher.check()  # marks the model set as known before loading
    republisher.start()
    # Restricted protocols are a gRPC-front concern (Triton's --grpc-restricted-protocol);
    # unexpected errors become INTERNAL in service.py's grpc_errors.
    interceptors = [RestrictedProtocols(restrictions)] if restrictions else []
    # grpc core turns SO_REUSEPORT on unless told: set it as Triton's
    # --reuse-grpc-port says, so a port another process holds fails the bind
    # unless several gateways are meant to share it.
    options = [*SERVER_OPTIONS, ("grpc.so_reuseport", int(gateway.reuse_grpc_port))]
    for option, ms in (
        ("grpc.max_connection_age_ms", gateway.grpc_max_connection_age_ms),
        ("grpc.max_connection_age_grace_ms", gateway.grpc_max_connection_age_grace_ms),
    ):
        if ms is not None:  # both servers take grpc's channel arguments
            options.append((option, ms))
    level = gateway.grpc_infer_response_compression
    if gateway.grpc_server == "h2":
        compressed = {f"/{INFERENCE_SERVICE}/{m}": level for m in INFER_METHODS}
        server = H2GrpcServer(options=options, interceptors=interceptors, compression=compressed)
    else:
        if level != "none":
            log.info(
                "flag accepted, no effect in StageServe",
                extra={"flag": "--grpc-infer-response-compression-level (grpcio's front)"},
            )
        server = grpc.aio.server(options=options, interceptors=interceptors)
    add_inference_service(dataplane, server)
    if metrics_port:
        pending = PendingGauge(models, link, asyncio.get_running_loop())

        def metrics_body() -> bytes:
            pending.refresh()
            dataplane.loaded_series()
            return render()

        serve_metrics(metrics_port, gateway.metrics_address, body=metrics_body)
    http: HttpServer | None = None
    announce: dict[str, str] = {}

    async def open_http() -> None:
        nonlocal http
        if http_listen is None:
            return
        host, port = http_listen.rsplit(":", 1)
        front = HttpFront(dataplane, gateway.http_restrictions)
        try:
            http = http_server(
                front, host, int(port), gateway.http_server, reuse_port=gateway.reuse_http_port
            )
            await http.start()
        except OSError as exc:
            end_on_listen_failure(listen_failed("HTTP", http_listen, exc))
        announce["http"] = http.address

    # A gateway that shares its ports with others opens them once its startup
    # models are loaded (as tritonserver opens its endpoints): the kernel
    # hands a listener new connections as soon as it listens, and a gateway
    # joining or restarted beside serving ones must not take requests for
    # models it has not adopted yet. Alone, it serves health while loading.
    sharing = gateway.reuse_grpc_port or gateway.reuse_http_port
    if not sharing:
        await open_http()

    poller = RepositoryPoller(lifecycle, repository, gateway.repository_poll_secs)
    polling: list[asyncio.Task] = []

    async def load_then_ready() -> None:
        poller.baseline()
        failures = startup_failures(lifecycle, await lifecycle.startup(load_models))
        report(failures)
        if failures and gateway.exit_on_error:
            raise StartupLoadFailed(failures)
        dataplane.ready = True
        log.info("startup models loaded", extra={"models": sorted(models.entries)})
        if control_mode == "poll":
            polling.append(asyncio.create_task(poller.run_forever()))

    # Serve health RPCs while models load; announce once loading finished.
    loader = asyncio.create_task(load_then_ready())
    try:
        if sharing:
            await loader
            await open_http()
        if tls is None:
            # The public port: plaintext, as Triton's without --grpc-use-ssl.
            await run_server(
                server,
                listen,
                "gateway",
                stage_tls=None,
                grace_s=gateway.exit_timeout_secs,
                before_ready=loader,
                announce=announce,
            )
        else:  # Triton's --grpc-use-ssl: the public endpoint speaks TLS only
            try:
                port = (
                    server.add_secure_port(listen, ssl_context(tls))
                    if isinstance(server, H2GrpcServer)
                    else server.add_secure_port(listen, server_credentials(tls))
                )
            except RuntimeError:
                port = 0
            if port == 0:
                end_on_listen_failure(listen_failed("GRPC", listen))
            address = f"{listen.rsplit(':', 1)[0]}:{port}"
            await run_server(
                server,
                address,
                "gateway",
                stage_tls=None,
                grace_s=gateway.exit_timeout_secs,
                bound=True,
                before_ready=loader,
                announce=announce,
            )
    except StartupLoadFailed:
        await server.stop(None)
        raise
    finally:
        loader.cancel()
        for task in polling:
            task.cancel()
        await republisher.close()
        if http is not None:
            await http.stop()
        await dataplane.shared.close()
        if dataplane.cache is not None:
            await dataplane.cache.close()
        await dataplane.traces.close()
        dataplane.overrides.close()
        dataplane.close()
        if dataplane.tensor_transport is not None:
            await dataplane.tensor_transport.local.close()
        await link.close()
        await rl_channel.close()
        await redis.aclose()
        tensor_shm.uninstall()
