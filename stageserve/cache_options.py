"""Triton's --cache-config, parsed: which response cache the gateway keeps.

Triton takes `--cache-config <cache>,<key>=<value>`, once per key
(`--cache-config redis,host=h --cache-config redis,port=6379`); the same
cache may also chain keys in one value (`redis,host=h,port=6379`). Two caches:

``local,size=N``
    an LRU of N bytes in each gateway's own memory (Triton's local cache).
``redis[,host=H,port=P,username=U,password=W,db=D,size=N]``
    a cache in Redis, shared by every gateway. Without host it is the stack's
    own Redis (--redis-url). `size` (bytes, default DEFAULT_REDIS_SIZE) is the
    budget StageServe keeps its entries under, evicting least recently used
    ones; Redis' own maxmemory is the operator's and is left alone.

Without --cache-config no response is cached, as in Triton 2.51, where a model
that sets `response_cache { enable: true }` then loads and runs uncached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The Redis cache's byte budget when no size is given.
DEFAULT_REDIS_SIZE = 64 * 1024 * 1024
_KEYS = {
    "local": ("size",),
    "redis": ("host", "port", "username", "password", "db", "size"),
}


@dataclass(frozen=True)
class CacheConfig:
    kind: str  # "local" | "redis"
    size: int  # byte budget
    host: str = ""  # redis: "" is the stack's own Redis
    port: int = 6379
    username: str = ""
    password: str = ""
    db: int = 0

    def redis_url(self) -> str:
        """The Redis a `redis` cache with a host uses."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username}:{self.password}@"
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"

    def argv(self) -> list[str]:
        """The flags that give this cache to another process (`up`'s gateway)."""
        pairs = [("size", str(self.size))]
        if self.kind == "redis":
            if self.host:
                pairs += [("host", self.host), ("port", str(self.port)), ("db", str(self.db))]
            pairs += [
                (k, v) for k, v in (("username", self.username), ("password", self.password)) if v
            ]
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
        for pair in filter(None, (p.strip() for p in rest.split(","))):
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
    return CacheConfig(
        "redis",
        size,
        host=options.get("host", ""),
        port=_number(options, "port", 6379),
        username=options.get("username", ""),
        password=options.get("password", ""),
        db=_number(options, "db", 0),
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
