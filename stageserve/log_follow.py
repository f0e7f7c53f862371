"""Every stage process follows the stack's log settings at run time.

The settings a gateway was asked to change live in the stack's Redis
(redis_keys.LOG_SETTINGS: a hash, one field per changed setting, over each
stage's own flags); the gateway publishes on redis_keys.LOG_EVENTS after
writing it. A stage reads the hash once at startup, before it serves (a stage
started or restarted later logs as the stack does from its first line), then
a daemon thread waits on the channel and reads the hash again on each
message, and every RESYNC_S seconds whatever comes (a message missed while
Redis restarted). Nothing on the request path: the thread only swaps the
log handler's filter settings and formatter (stageserve/logs.py).

A stage hands the follow on to the processes it starts (a Python model's stub)
in the environment (ENV): the Redis URL and the stage's own startup settings.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import redis

from stageserve import redis_keys as keys
from stageserve.log_settings import LogSettings, from_redis
from stageserve.logs import FOLLOW_ENV as ENV
from stageserve.logs import applied_count, apply_log_settings

log = logging.getLogger(__name__)

# Reads of the hash without a message: one HGETALL per stage per RESYNC_S.
RESYNC_S = 30.0
RETRY_S = 0.5
RETRY_CAP_S = 5.0
CONNECT_TIMEOUT_S = 2.0


class LogFollower:
    """Keeps this process's log settings on the stack's: `base` (its flags)
    with the Redis hash over it."""

    def __init__(self, redis_url: str, base: LogSettings, resync_s: float = RESYNC_S) -> None:
        self.redis_url = redis_url
        self.base = base
        self.resync_s = resync_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _client(self) -> redis.Redis:
        return redis.Redis.from_url(
            self.redis_url,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=CONNECT_TIMEOUT_S,
        )

    def sync(self, client: redis.Redis) -> None:
        """Read the hash and log under what it says from now on, unless this
        process applied settings of its own meanwhile (a gateway's update:
        what was read may predate it; the update's own message reads again)."""
        seen = applied_count()
        settings = from_redis(self.base, client.hgetall(keys.LOG_SETTINGS))
        if apply_log_settings(settings, unless_applied_since=seen):
            log.info("log settings changed", extra={"settings": settings.as_json()})

    def start(self) -> None:
        """Read the stack's settings now (a Redis that does not answer leaves
        the flags' until it does), then follow them in a daemon thread."""
        client = self._client()
        try:
            self.sync(client)
        except (redis.RedisError, OSError) as exc:
            log.warning("log settings not read from Redis yet", extra={"error": str(exc)})
        finally:
            client.close()
        self._thread = threading.Thread(target=self._run, name="log-settings", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop following (the thread ends at its next wake-up)."""
        self._stop.set()

    def _run(self) -> None:
        delay = RETRY_S
        while not self._stop.is_set():
            client = self._client()
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(keys.LOG_EVENTS)
                self.sync(client)  # after subscribing: no change falls in between
                delay = RETRY_S
                while not self._stop.is_set():
                    pubsub.get_message(timeout=self.resync_s)
                    if not self._stop.is_set():
                        self.sync(client)
            except (redis.RedisError, OSError):
                self._stop.wait(delay)
                delay = min(delay * 2, RETRY_CAP_S)
            finally:
                pubsub.close()
                client.close()


def follow(redis_url: str, base: LogSettings, environ: dict[str, str] | None = None) -> LogFollower:
    """Follow the stack's settings from now on, and have the processes this
    one starts follow them too (`environ`, default os.environ, gains ENV:
    call this before any thread that reads the environment starts)."""
    target = os.environ if environ is None else environ
    target[ENV] = json.dumps({"redis": redis_url, "settings": base.as_json()})
    follower = LogFollower(redis_url, base)
    follower.start()
    return follower
