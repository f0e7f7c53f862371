"""Triton's --cache-config, parsed: which response cache the gateway keeps.

Triton takes `--cache-config <cache>,<key>=<value>`, once per key
(`--cache-config redis,host=h --cache-config redis,port=6379`); the same
cache may also chain keys in one value (`redis,host=h,port=6379`). Two caches:

``local,size=N``
    an LRU of N bytes in each gateway's own memory (Triton's local cache).
``redis[,host=H,port=P,user=U,password=W,db=D,...,size=N]``
    a cache in Redis, shared by every gateway. Without host it is the stack's
    own Redis (--redis-url). The connection keys are Triton's redis cache's:
    host, port, user (`username` is taken too), password, db,
    connect_timeout and socket_timeout (ms; 0, the default, waits forever),
    pool_size and wait_timeout (ms, default 100: how long a request waits for
    one of the pool_size connections). Without pool_size the pool is unbounded
    (Triton's default is one connection, which would put every lookup of a
    gateway's concurrent requests in one line). `size` (bytes, default
    DEFAULT_REDIS_SIZE) is the budget StageServe keeps its entries under,
    evicting least recently used ones; Redis' own maxmemory is the
    operator's and is left alone.

Without --cache-config no response is cached, as in Triton 2.51, where a model
that sets `response_cache { enable: true }` then loads and runs uncached.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

#: The Redis cache's byte budget when no size is given.
DEFAULT_REDIS_SIZE = 64 * 1024 * 1024
_KEYS = {
    "local": ("size",),
    "redis": (
        "host",
        "port",
        "user",
        "username",
        "password",
        "db",
        "connect_timeout",
        "socket_timeout",
        "pool_size",
        "wait_timeout",
        "size",
    ),
}
_NUMBERS = ("port", "db", "connect_timeout", "socket_timeout", "pool_size", "wait_timeout")


@dataclass(frozen=True)
class CacheConfig:
    kind: str  # "local" | "redis"
    size: int  # byte budget
    host: str = ""  # redis: "" is the stack's own Redis
    port: int = 6379
    user: str = ""
    password: str = ""
    db: int = 0
    connect_timeout: int = 0  # ms; 0: wait forever
    socket_timeout: int = 0  # ms; 0: wait forever
    pool_size: int = 0  # 0: unbounded
    wait_timeout: int = 100  # ms, with pool_size

    def redis_url(self) -> str:
        """The Redis a `redis` cache with a host uses."""
        auth = ""
        if self.user or self.password:
            auth = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@"
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"

    def argv(self) -> list[str]:
        """The flags that give this cache to another process (`up`'s gateway)."""
        pairs = [("size", str(self.size))]
        if self.kind == "redis":
            if self.host:
                pairs += [("host", self.host)]
                pairs += [(k, str(getattr(self, k))) for k in _NUMBERS]
            pairs += [(k, v) for k, v in (("user", self.user), ("password", self.password)) if v]
        return [a for k, v in pairs for a in ("--cache-config", f"{self.kind},{k}={v}")]


def parse_cache_config(values: Sequence[str]) -> CacheConfig | None:
    """Every --cache-config value given, in order; None when none was.
    ValueError with a message for a malformed one."""
    if not values:
        return None
    kind = ""
    options: dict[str, str] = {}
    for value in values:
        name, _, rest = value.partition(",")
        name = name.strip()
        if name not in _KEYS:
            raise ValueError(
                f"--cache-config {value!r}: unknown cache '{name}' (expected local or redis)"
            )
        if kind and name != kind:
            raise ValueError(f"--cache-config: one cache only, got {kind} and {name}")
        kind = name
        # a comma starts another key only before "<key>=": a value (a
        # password) may hold commas, as in Triton's one-key-per-flag form
        known = "|".join(_KEYS[kind])
        for pair in filter(None, (p.strip() for p in re.split(rf",(?=(?:{known})=)", rest))):
            key, eq, val = pair.partition("=")
            if not eq or key not in _KEYS[kind]:
                expected = ", ".join(_KEYS[kind])
                raise ValueError(
                    f"--cache-config {value!r}: expected {kind},<key>=<value> with key one of "
                    f"{expected}"
                )
            options[key] = val
    size = _number(options, "size", DEFAULT_REDIS_SIZE if kind == "redis" else None)
    if kind == "local":
        return CacheConfig("local", size)
    defaults = CacheConfig("redis", size)
    return CacheConfig(
        "redis",
        size,
        host=options.get("host", ""),
        user=options.get("user", options.get("username", "")),
        password=options.get("password", ""),
        **{k: _number(options, k, getattr(defaults, k)) for k in _NUMBERS},
    )


def _number(options: dict[str, str], key: str, default: int | None) -> int:
    raw = options.get(key)
    if raw is None:
        if default is None:
            raise ValueError(f"--cache-config local needs {key}=<bytes>")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"--cache-config {key}={raw!r}: expected a whole number") from None
    if value < 0:
        raise ValueError(f"--cache-config {key}={raw!r}: must not be negative")
    return value
