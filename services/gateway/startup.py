"""The outcome of the gateway's startup load, as Triton's flags act on it.

Triton 2.51 (recorded in tests/integration/test_startup_flags.py): a model that
fails to load at startup, in ``none`` or ``explicit`` mode, makes the server
exit with status 1 under ``--exit-on-error=true`` (the default) before its
endpoints open; with ``false`` it serves, live, ModelReady false for that
model, and ServerReady false under ``--strict-readiness=true`` (the default),
true under ``false``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from services.gateway.model_lifecycle import ModelLifecycle
from services.gateway.model_table import READY
from stageserve.service_runtime import announce_startup

log = logging.getLogger(__name__)

EXIT_CODE = 1  # tritonserver's status when startup loads fail under --exit-on-error


@dataclass(frozen=True)
class LoadFailure:
    model: str
    version: str  # "" for a failure of the whole model (its config, say)
    reason: str


class StartupLoadFailed(Exception):
    """Startup models failed to load and --exit-on-error is on."""

    def __init__(self, failures: list[LoadFailure]) -> None:
        super().__init__("failed to load all models")
        self.failures = failures


def startup_failures(lifecycle: ModelLifecycle, wanted: list[str]) -> list[LoadFailure]:
    """A row per startup model (or version) that is not ready, with the reason
    the repository index gives."""
    rows: dict[str, list[LoadFailure]] = {name: [] for name in wanted}
    for name, version, state, reason in lifecycle.index():
        if name in rows and state != READY:
            rows[name].append(LoadFailure(name, version, reason or "not loaded"))
    failures: list[LoadFailure] = []
    for name in wanted:
        entry = lifecycle.table.entries.get(name)
        if entry is None and not rows[name]:  # a --load-model name the repository lacks
            failures.append(LoadFailure(name, "", "no such model in the repository"))
        failures += rows[name]
    return failures


def report(failures: list[LoadFailure]) -> None:
    """Log each failure and announce them all for `stageserve up`'s summary."""
    for f in failures:
        log.error(
            "startup model not loaded",
            extra={"model": f.model, "version": f.version, "reason": f.reason},
        )
    announce_startup([asdict(f) for f in failures])
