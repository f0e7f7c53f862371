"""Triton's `--model-control-mode=poll`: follow the repository on disk.

Every `--repository-poll-secs` the repository is scanned; a model directory
that appeared is loaded, one whose files changed (config.pbtxt, a version
directory added or removed, a model file rewritten) is reloaded, and one that
disappeared is unloaded. ModelLifecycle does the work: a reload publishes a new
generation, workers load it before they unload the old one and drain the old
instances' in-flight batches first, so requests admitted before the change
finish on the old version; a reload that fails keeps the old version serving.

Several gateways polling one repository apply each change once stack-wide:
a load adopts the record another gateway published for the same folder
(config, versions, path and file digest; ModelStateStore.publish_loaded,
atomic), so workers load a change once; and every gateway polls as soon as a
model event says one of them published a change (not only every
`--repository-poll-secs`), so they switch within milliseconds of each other.

The scan is pure (`snapshot`, `diff`); `RepositoryPoller` is the thin loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from services.gateway.model_lifecycle import ModelLifecycle
from stageserve import redis_keys as keys
from stageserve.errors import StageError
from stageserve.repository import model_names

log = logging.getLogger(__name__)

# A model's fingerprint: (relative path, size, mtime ns) of every file in it.
Fingerprint = frozenset[tuple[str, int, int]]


def fingerprint(model_dir: Path) -> Fingerprint:
    out = set()
    for root, _, files in os.walk(model_dir):
        for f in files:
            path = Path(root) / f
            try:
                st = path.stat()
            except OSError:  # removed while we looked: the next poll sees it
                continue
            out.add((str(path.relative_to(model_dir)), st.st_size, st.st_mtime_ns))
    return frozenset(out)


def snapshot(repository: Path) -> dict[str, Fingerprint]:
    """Every model of the repository and its fingerprint."""
    return {name: fingerprint(repository / name) for name in model_names(repository)}


@dataclass(frozen=True)
class Changes:
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def diff(before: dict[str, Fingerprint], after: dict[str, Fingerprint]) -> Changes:
    return Changes(
        added=tuple(sorted(set(after) - set(before))),
        changed=tuple(sorted(n for n in set(after) & set(before) if after[n] != before[n])),
        removed=tuple(sorted(set(before) - set(after))),
    )


class RepositoryPoller:
    def __init__(self, models: ModelLifecycle, repository: Path, poll_secs: float) -> None:
        self.models = models
        self.repository = repository
        self.poll_secs = poll_secs
        self.seen: dict[str, Fingerprint] = {}

    def baseline(self) -> None:
        """What the startup load saw (taken before it, so an edit made while the
        startup models load is picked up by the first poll)."""
        self.seen = snapshot(self.repository)

    async def poll_once(self) -> Changes:
        now = await asyncio.to_thread(snapshot, self.repository)
        changes = diff(self.seen, now)
        self.seen = now
        if not changes:
            return changes
        log.info(
            "repository changed",
            extra={
                "added": changes.added,
                "changed": changes.changed,
                "removed": changes.removed,
            },
        )
        for name in changes.removed:
            await self._apply("unload", name)
            self.models.forget(name)
        await asyncio.gather(*(self._apply("load", n) for n in (*changes.added, *changes.changed)))
        return changes

    async def _apply(self, what: str, name: str) -> None:
        try:
            if what == "load":
                await self.models.load(name, adopt=True)
            else:
                await self.models.unload(name)
        except StageError as err:  # logged; a failed reload keeps the old version
            log.error(f"poll: {what} failed", extra={"model": name, "reason": err.message})

    async def run_forever(self) -> None:
        events = self.models.state.redis.pubsub()
        try:
            await events.subscribe(keys.MODEL_EVENTS)
            while True:
                await self._wait(events)
                try:
                    await self.poll_once()
                except Exception:
                    log.exception("repository poll failed")
        finally:
            await events.aclose()

    async def _wait(self, events: aioredis.client.PubSub) -> None:
        """Until the next poll is due or a model event arrives (a gateway
        published a change: the others apply it now, not a period later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.poll_secs
        while (left := deadline - loop.time()) > 0:
            try:
                message = await events.get_message(ignore_subscribe_messages=True, timeout=left)
            except Exception:  # Redis away: poll on the period alone
                await asyncio.sleep(left)
                return
            if message is not None:
                return
