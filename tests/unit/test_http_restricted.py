"""--http-restricted-api on the HTTP front's ASGI app, called directly."""

from __future__ import annotations

import asyncio
import json
from typing import cast

from services.gateway.dataplane import DataPlane
from services.gateway.http.app import API_GROUP, HttpFront
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.security_options import GROUPS, parse_http_restriction


class FakePlane:
    """The two calls the health and metadata endpoints make; cast to DataPlane."""

    def server_ready(self) -> bool:
        return True

    def server_metadata(self) -> gs.ServerMetadataResponse:
        return gs.ServerMetadataResponse(name="fake")


def _call(app: HttpFront, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    asyncio.run(app(scope, receive, send))
    body = sent[1]["body"]
    return sent[0]["status"], json.loads(body) if body else {}


def test_a_restricted_api_needs_its_header_and_answers_tritons_403() -> None:
    app = HttpFront(
        cast(DataPlane, FakePlane()), [parse_http_restriction("health:admin-key=s3cret")]
    )
    assert _call(app, "/v2/health/ready") == (
        403,
        {"error": "This API is restricted, expecting header 'admin-key'"},
    )
    assert _call(app, "/v2/health/live", {"admin-key": "wrong"})[0] == 403
    assert _call(app, "/v2/health/ready", {"Admin-Key": "s3cret"})[0] == 200
    assert _call(app, "/v2")[0] == 200  # metadata is not restricted


def test_no_restriction_changes_nothing() -> None:
    app = HttpFront(cast(DataPlane, FakePlane()))
    assert _call(app, "/v2/health/ready")[0] == 200


def test_every_endpoint_belongs_to_one_of_tritons_groups() -> None:
    assert set(API_GROUP.values()) <= GROUPS
    assert {name for name, _ in HttpFront._MODEL_ROUTES.values()} <= set(API_GROUP)


def test_cuda_shared_memory_is_in_the_shared_memory_group() -> None:
    """As Triton: restricting shared-memory covers the CUDA endpoints too."""
    app = HttpFront(
        cast(DataPlane, FakePlane()), [parse_http_restriction("shared-memory:admin-key=s3cret")]
    )
    for path in ("/v2/cudasharedmemory/status", "/v2/cudasharedmemory/region/r/status"):
        assert _call(app, path)[0] == 403, path
    assert API_GROUP["cuda_shm_register"] == API_GROUP["cuda_shm_unregister"] == "shared-memory"
