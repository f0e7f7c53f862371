"""Gateway process: wire the public service to Redis, rate limiter and scheduler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc

from services.gateway.dataplane import DEFAULT_SERVER_NAME, DataPlane
from services.gateway.http.app import HttpFront
from services.gateway.http.server import HttpServer, http_server
from services.gateway.models import ModelManager
from services.gateway.poller import RepositoryPoller
from services.gateway.republish import Republisher
from services.gateway.scheduler_link import SchedulerLink
from services.gateway.security import RestrictedProtocols, server_credentials
from services.gateway.service import InferenceService
from services.gateway.shared_stats import SharedStats
from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.generated import grpc_service_pb2_grpc as gs_grpc
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.model_state import ModelStateStore
from stageserve.net import SERVER_OPTIONS, stage_channel
from stageserve.redis_connect import connect
from stageserve.security_options import Restriction, TlsOptions
from stageserve.service_runtime import run_server
from stageserve.settings import GATEWAY
from stageserve.telemetry import serve_metrics

log = logging.getLogger(__name__)


async def serve(
    listen: str,
    redis_url: str,
    ratelimiter_address: str,
    scheduler_address: str,
    repository: Path,
    control_mode: str,
    load_models: list[str],
    metrics_port: int | None = None,
    autocomplete: AutoComplete = TRITON_DEFAULT,
    repository_poll_secs: float = 15.0,
    http_listen: str | None = None,
    tls: TlsOptions | None = None,
    restrictions: Sequence[Restriction] = (),
    http_restrictions: Sequence[Restriction] = (),
    server_name: str = DEFAULT_SERVER_NAME,
) -> None:
    """`http_listen` (host:port, port 0 picks one) also serves the HTTP/REST
    front on the same dataplane; None: gRPC only. `server_name`: the name
    ServerMetadata answers on both fronts."""
    redis = connect(redis_url)
    await redis.ping()
    rl_channel = stage_channel(ratelimiter_address)
    models = ModelManager(
        repository,
        ModelStateStore(redis),
        pb_grpc.RateLimiterStub(rl_channel),
        control_mode,
        autocomplete=autocomplete,
    )
    link = SchedulerLink(scheduler_address, hold_us=GATEWAY.scheduler_link_hold_us)
    dataplane = DataPlane(models, link, server_name)
    dataplane.shared = SharedStats(redis, dataplane.stats)
    dataplane.shared.start()
    republisher = Republisher(models, redis)
    await republisher.check()  # marks the model set as known before loading
    republisher.start()
    # Restricted protocols are a gRPC-front concern (Triton's --grpc-restricted-protocol);
    # unexpected errors become INTERNAL in service.py's grpc_errors.
    interceptors = [RestrictedProtocols(restrictions)] if restrictions else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    gs_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(dataplane), server)
    if metrics_port:
        serve_metrics(metrics_port)
    http: HttpServer | None = None
    announce: dict[str, str] = {}
    if http_listen is not None:
        host, port = http_listen.rsplit(":", 1)
        http = http_server(HttpFront(dataplane, http_restrictions), host, int(port))
        await http.start()
        announce["http"] = http.address

    poller = RepositoryPoller(models, repository, repository_poll_secs)
    polling: list[asyncio.Task] = []

    async def load_then_ready() -> None:
        poller.baseline()
        await models.startup(load_models)
        dataplane.ready = True
        log.info("startup models loaded", extra={"models": sorted(models.entries)})
        if control_mode == "poll":
            polling.append(asyncio.create_task(poller.run_forever()))

    # Serve health RPCs while models load; announce once loading finished.
    loader = asyncio.create_task(load_then_ready())
    try:
        if tls is None:
            await run_server(
                server, listen, "gateway", before_ready=loader, announce=announce, internal=False
            )
        else:  # Triton's --grpc-use-ssl: the public endpoint speaks TLS only
            port = server.add_secure_port(listen, server_credentials(tls))
            address = f"{listen.rsplit(':', 1)[0]}:{port}"
            await run_server(
                server, address, "gateway", bound=True, before_ready=loader, announce=announce
            )
    finally:
        loader.cancel()
        for task in polling:
            task.cancel()
        await republisher.close()
        if http is not None:
            await http.stop()
        await dataplane.shared.close()
        dataplane.overrides.close()
        await link.close()
        await rl_channel.close()
        await redis.aclose()
