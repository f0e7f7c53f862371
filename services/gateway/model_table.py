"""The gateway's hot path over the loaded models: what each request reads.

Every request resolves its model and version here (`resolve`) and is counted
in flight between `begin` and `end`; health RPCs ask `is_ready`/`all_ready`.
Nothing here awaits or touches Redis: loading, unloading and draining live in
model_lifecycle.py (as Triton keeps its repository manager apart from the
model lifecycle), which replaces entries and waits here for requests to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from stageserve.config import ModelSpec
from stageserve.errors import StageError, not_found, unavailable
from stageserve.generated import model_config_pb2 as mc
from stageserve.names import parse_version, printable

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclass
class ModelEntry:
    name: str
    versions: dict[int, str] = field(default_factory=dict)  # version -> state
    reasons: dict[int, str] = field(default_factory=dict)
    reason: str = ""  # model-level reason (config error, unloaded)
    config: mc.ModelConfig | None = None
    spec: ModelSpec | None = None
    generation: int = 0
    unloaded: bool = False  # by request: not counted by server readiness
    fingerprint: tuple = ()  # of the model folder when loaded (repository.fingerprint)
    path: Path | None = None  # the folder published to workers (an override's, or the repository's)

    def ready_versions(self) -> list[int]:
        return sorted(v for v, s in self.versions.items() if s == READY)


class ModelTable:
    """The entries the lifecycle publishes, and the requests admitted to them."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self._in_flight: dict[str, int] = {}
        self._version_in_flight: dict[tuple[str, int], int] = {}
        self._idle: dict[str, asyncio.Event] = {}

    # ----------------------------------------------------------------- lookup

    def resolve(self, name: str, version: str) -> tuple[ModelEntry, int]:
        """The entry and version a request addresses, or Triton's error.

        Once per request: the name is escaped for a message (printable, 0.6-1.5
        us) only on the error paths."""
        entry = self.entries.get(name)
        if entry is None or not entry.versions:
            shown = printable(name)  # as messages show it (a 64 KiB name would not fit a trailer)
            if entry is not None and entry.reason:
                # NOT_FOUND, as Triton 2.51 answers for a model whose load failed
                raise not_found(
                    f"Request for unknown model: '{shown}' is not ready: {entry.reason}"
                )
            raise not_found(f"Request for unknown model: '{shown}' is not found")
        v = parse_version(version)
        if v is not None:
            state = entry.versions.get(v)
            if state is None:
                raise not_found(
                    f"Request for unknown model: '{printable(name)}' version {v} is not found"
                )
            if state != READY:
                reason = "" if entry.unloaded else entry.reasons.get(v, "")
                raise unavailable(
                    f"Request for unknown model: '{printable(name)}' version {v} is not at "
                    f"ready state" + (f": {reason}" if reason else "")
                )
            return entry, v
        ready = entry.ready_versions()
        if not ready:
            reason = "" if entry.unloaded else entry.reason or "; ".join(entry.reasons.values())
            # Triton answers NOT_FOUND here (2.51, bench/triton_diff.py)
            raise not_found(
                f"Request for unknown model: '{printable(name)}' has no available versions"
                + (f": {reason}" if reason else "")
            )
        return entry, ready[-1]

    def is_ready(self, name: str, version: str) -> bool:
        """False for what is not ready; INVALID_ARGUMENT for a version Triton refuses."""
        parse_version(version)
        try:
            self.resolve(name, version)
        except StageError:
            return False
        return True

    def all_ready(self) -> bool:
        return all(
            e.ready_versions() for e in self.entries.values() if e.versions and not e.unloaded
        )

    def ready_now(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and bool(entry.ready_versions())

    # ------------------------------------------------------------- in-flight

    # Counted per model name and per version, not per entry: a reload replaces
    # the entry while requests admitted under the old one are still running
    # (an unload waits for the name's, a removed version's drain for its own).

    def in_flight(self, name: str) -> int:
        """Requests to model `name` between begin() and end()."""
        return self._in_flight.get(name, 0)

    def begin(self, entry: ModelEntry, version: int) -> None:
        self._in_flight[entry.name] = self._in_flight.get(entry.name, 0) + 1
        key = (entry.name, version)
        self._version_in_flight[key] = self._version_in_flight.get(key, 0) + 1

    def end(self, entry: ModelEntry, version: int) -> None:
        key = (entry.name, version)
        if not (left := self._version_in_flight[key] - 1):
            del self._version_in_flight[key]
        else:
            self._version_in_flight[key] = left
        total = self._in_flight[entry.name] = self._in_flight[entry.name] - 1
        if (total == 0 or left == 0) and entry.name in self._idle:
            self._idle[entry.name].set()

    async def wait_idle(self, name: str) -> None:
        """Until no request to model `name` is in flight."""
        idle = self._idle.setdefault(name, asyncio.Event())
        while self._in_flight.get(name, 0):
            idle.clear()
            await idle.wait()

    async def wait_versions_idle(
        self, name: str, versions: tuple[int, ...], timeout_s: float
    ) -> int:
        """Until no request to these versions of `name` is in flight, or
        `timeout_s` passed; returns how many were still in flight."""
        idle = self._idle.setdefault(name, asyncio.Event())
        deadline = time.monotonic() + timeout_s
        while (left := sum(self._version_in_flight.get((name, v), 0) for v in versions)) and (
            remaining := deadline - time.monotonic()
        ) > 0:
            idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), remaining)
        return left
