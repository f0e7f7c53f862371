"""The Redis client every stage uses: one that survives Redis restarting.

After Redis restarts, every pooled connection is stale and the first command
on each fails with "Connection closed by server"; without a retry, a
scheduler's sequence requests failed UNAVAILABLE for a while after Redis was
back (tests/integration/test_redis_restart.py saw it on the first request).
A few quick retries reconnect the connection transparently. They are short
(~0.15 s in all) so that while Redis is really down, callers still fail fast
with UNAVAILABLE rather than hang.

A retried command may, in the rare case that the connection broke after
Redis executed it and before the reply, run twice: the scripts that matter
are written so that this costs at most a grant held until its lease ends.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

from stageserve.settings import RedisClientSettings


def retry_options(client: RedisClientSettings) -> dict[str, Any]:
    """The connection options that retry as `client` says."""
    return {
        "retry": Retry(
            ExponentialBackoff(cap=client.backoff_cap_s, base=client.backoff_base_s),
            client.retries,
        ),
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def connect(url: str, client: RedisClientSettings, **options: Any) -> aioredis.Redis:
    """A client of `url` retrying as `client` (the settings tree's redis_client)
    says; `options` are more connection options (timeouts)."""
    return aioredis.from_url(url, **retry_options(client), **options)
