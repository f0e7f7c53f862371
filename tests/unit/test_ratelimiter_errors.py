"""services/ratelimiter/errors.py: what a caller is told of a failure."""

from __future__ import annotations

import grpc
import pytest
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

from services.ratelimiter.errors import REDIS_UNAVAILABLE, stage_error
from stageserve.errors import StageError, not_found


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        TimeoutError("Timeout reading from socket"),
        BusyLoadingError("Redis is loading the dataset in memory"),
    ],
)
def test_redis_unreachable_is_unavailable_with_a_short_message(exc):
    err = stage_error(exc, "Acquire")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.message == REDIS_UNAVAILABLE  # no host, port or exception text


def test_a_stage_error_keeps_its_code_and_message():
    original = not_found("no such grant")
    assert stage_error(original, "Release") is original


def test_anything_else_is_internal_without_its_text():
    err = stage_error(ValueError("secret /path/detail"), "Renew")
    assert isinstance(err, StageError) and err.code == grpc.StatusCode.INTERNAL
    assert "secret" not in err.message and "Renew" in err.message
