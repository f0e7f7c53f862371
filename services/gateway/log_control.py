"""The LogSettings RPC and GET/POST /v2/logging: Triton's log settings, stack-wide.

An update is parsed as Triton 2.51 parses it (stageserve/log_settings.py), the
settings it changed are written to the stack's Redis (one hash field each) and
announced there, and applied to this gateway at once; every other stage
follows within a Redis round trip (stageserve/log_follow.py). The answer is
this gateway's settings afterwards, as Triton answers its own.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from stageserve import redis_keys as keys
from stageserve.errors import StageError, unavailable
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.log_settings import (
    LogSettings,
    LogSettingsError,
    Update,
    grpc_fields,
    parse_grpc,
    parse_http,
    to_redis,
)
from stageserve.logs import apply_log_settings, current_settings

log = logging.getLogger(__name__)

NOT_STORED = "log settings not changed: the stack's Redis did not answer"


class LogControl:
    """This gateway's side of the stack's log settings."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    def settings(self) -> LogSettings:
        return current_settings()

    async def update(self, update: Update) -> LogSettings:
        """Store and apply what `update` changed; then raise its error, if
        it has one (what came before the error stays changed, as in Triton)."""
        if update.changes:
            try:
                fields: dict[Any, Any] = to_redis(update.changes)
                await self.redis.hset(keys.LOG_SETTINGS, mapping=fields)
                await self.redis.publish(keys.LOG_EVENTS, "1")
            except (RedisError, OSError):
                raise unavailable(NOT_STORED) from None
            settings = current_settings().updated(update.changes)
            if apply_log_settings(settings):
                log.info("log settings changed", extra={"settings": settings.as_json()})
        if update.error is not None:
            raise update.error
        return current_settings()


def grpc_response(settings: LogSettings) -> gs.LogSettingsResponse:
    response = gs.LogSettingsResponse()
    for key, (field, value) in grpc_fields(settings).items():
        setattr(response.settings[key], field, value)
    return response


async def grpc_log_settings(
    control: LogControl, request: gs.LogSettingsRequest
) -> gs.LogSettingsResponse:
    """LogSettings: an empty request reads, any setting in it changes."""
    try:
        settings = await control.update(parse_grpc(request.settings))
    except LogSettingsError as err:
        raise StageError(grpc.StatusCode[err.code], err.message) from None
    return grpc_response(settings)


async def http_log_settings(
    control: LogControl, method: str, body: bytes
) -> tuple[int, dict[str, object]]:
    """GET or POST /v2/logging: (HTTP status, JSON document)."""
    if method == "GET":
        return 200, dict(control.settings().as_json())
    if method != "POST":
        return 405, {"error": "Method Not Allowed"}
    try:
        settings = await control.update(parse_http(body))
    except LogSettingsError as err:
        return err.http, {"error": err.message}
    return 200, dict(settings.as_json())
